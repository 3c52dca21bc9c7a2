"""Every refusal in OpenAI's shape: the app's handlers for FastAPI's, Starlette's and our own
errors (`add_error_handlers`), so a bad body, a wrong route or a bug each gets an OpenAI-shaped
error body with its status."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdecode.errors import UserError
from specdecode.server.errors import APIError, bad_request


def add_error_handlers(app: FastAPI) -> None:
    """Answer `APIError` as itself, a `UserError` as a 400, a body FastAPI refuses as a 400
    naming the field, Starlette's refusals (unknown route, wrong method, unparsable body) with
    their status, and anything else as a 500 naming the exception."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(UserError)
    async def refused(_: Request, error: UserError) -> JSONResponse:
        return bad_request(str(error)).response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        return _validation_error(error).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return _http_error(error).response()

    @app.exception_handler(Exception)
    async def internal(_: Request, error: Exception) -> JSONResponse:
        message = f"internal error: {type(error).__name__}: {error}"
        return APIError(500, message, "internal_server_error", None, "internal_error").response()


def _validation_error(error: RequestValidationError) -> APIError:
    """400 for a body that is not JSON, or has a bad or missing field (naming the first)."""
    first = error.errors()[0]
    if first.get("type") == "json_invalid":
        reason = first.get("ctx", {}).get("error", first.get("msg"))
        return APIError(400, f"the body is not valid JSON: {reason}", code="bad_json")
    if isinstance(error.body, bytes):  # sent without a JSON content type: FastAPI kept bytes
        try:
            json.loads(error.body)
        except (ValueError, RecursionError) as bad:
            return APIError(400, f"the body is not valid JSON: {bad}", code="bad_json")
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(where) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    return bad_request(message, param)


def _http_error(error: StarletteHTTPException) -> APIError:
    """Starlette's and FastAPI's own refusals (an unknown route, a wrong method, a body that
    cannot be parsed: invalid UTF-8, nesting too deep) in the OpenAI shape."""
    kinds = {404: ("not_found_error", "not_found"), 405: ("invalid_request_error", "bad_method")}
    kind, code = kinds.get(error.status_code, ("invalid_request_error", "invalid_value"))
    message = str(error.detail)
    if error.status_code == 400 and "parsing the body" in message:
        message = "the body cannot be parsed: it must be UTF-8 JSON, not nested too deeply"
        code = "bad_json"
    return APIError(error.status_code, message, kind, None, code)
