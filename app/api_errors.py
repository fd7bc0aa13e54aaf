"""Errors of the OpenAI-compatible API, in OpenAI's error shape: {"error": {"message", "type",
"param", "code"}}. The request checks (api_request.py and the field readers api_tools.py,
api_format.py, api_logprobs.py) raise them naming the field at fault."""
from __future__ import annotations

from fastapi.responses import JSONResponse


class ApiError(Exception):
    """An answer in OpenAI's error shape: HTTP status, message, type, the field (param) and a code."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=self.body(), headers=headers)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
