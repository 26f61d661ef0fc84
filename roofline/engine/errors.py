"""Errors a request can meet in the engine that the API answers as the client's fault (a 400)."""

from __future__ import annotations


class RequestInvalidError(ValueError):
    """The request's own input (the field `param`) made the engine reject or fail it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param
