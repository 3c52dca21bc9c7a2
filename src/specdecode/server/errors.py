"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with a status."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class APIError(Exception):
    """A request the server refuses: HTTP `status`, OpenAI error `kind` (its "type"), the
    offending field `param` (None when no one field is at fault) and a short `code`."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code

    def body(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None) -> APIError:
    """400: a malformed body or a field with a value that is not allowed."""
    return APIError(400, message, "invalid_request_error", param, "invalid_value")
