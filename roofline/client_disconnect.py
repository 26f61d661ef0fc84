"""run_cancellable: a non-streaming HTTP handler that is cancelled when its client disconnects.  Shared
by the OpenAI server's routes (entrypoints/openai/server.py) and the router's (router/app.py)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from fastapi import Request
from fastapi.responses import Response


async def run_cancellable(request: Request, coro: Any) -> Any:
    """Run a non-streaming handler, cancelling it (and so aborting its requests) if the client
    disconnects before the answer is ready (then a 499 answer, which nobody reads)."""
    task = asyncio.ensure_future(coro)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        return Response(status_code=499)
    return task.result()
