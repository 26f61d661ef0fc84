"""The live dashboard routes: `/stats` (JSON: the engine's recent heartbeat) and `/dashboard` (one
plain HTML page, no build step, that polls `/stats` and draws it).

`add_dashboard_routes(app, engine)` registers a `Heartbeat` stat logger on the engine and the two
routes on the app; the page itself is `dashboard.html` next to this module. With `--api-key` the
server's access middleware covers `/stats` and leaves the page open (it carries no data, and a browser
cannot attach a bearer token to a page's URL); the page sends the key it is given (kept in the
browser's localStorage) as a bearer token on every `/stats` poll.
"""

from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse

from roofline.metrics.heartbeat import Heartbeat

PAGE_FILE = os.path.join(os.path.dirname(__file__), "dashboard.html")


def add_dashboard_routes(app: FastAPI, engine: Any, dependencies: Any = None) -> Heartbeat:
    """Add `/stats` and `/dashboard` to `app`, fed by a Heartbeat logger on `engine`."""
    heartbeat = Heartbeat()
    engine.stat_loggers.append(heartbeat)
    app.state.heartbeat = heartbeat
    with open(PAGE_FILE, encoding="utf-8") as f:
        page = f.read()
    model_name = app.state.model_names[0] if getattr(app.state, "model_names", None) else ""

    @app.get("/stats", dependencies=dependencies)
    async def stats() -> JSONResponse:
        return JSONResponse({"model": model_name, **heartbeat.snapshot()})

    @app.get("/dashboard", dependencies=dependencies)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page)

    return heartbeat
