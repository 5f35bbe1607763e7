"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}`, never a traceback.

400 bad parameters / prompt too long / a request that failed alone · 401 bad key · 404 unknown
model or route · 405 wrong method (with Allow) · 408 body too slow · 413 body too large · 422 body
does not match the schema · 503 queue full (with Retry-After) · 500 anything unexpected (one log
line; see `guard.py`, which answers it without closing the connection).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    503: "ServiceUnavailableError",
    500: "InternalServerError",
    501: "NotImplementedError",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.type = type or TYPES.get(status, "Error")


def error_body(status: int, message: str, param: str | None = None, type: str | None = None) -> dict:
    return {"error": {"message": message, "type": type or TYPES.get(status, "Error"), "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors()[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = param or (".".join(loc) or None)
        if err.get("type") == "json_invalid":
            return "the request body is not valid JSON", None
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts), param


def parse_body(model: type[BaseModel], body: bytes) -> BaseModel:
    """`body` as the route's pydantic model, with FastAPI's errors: pydantic reads the bytes
    itself, so a route that parses on a worker thread holds the GIL once, briefly (see /tokenize)."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:  # locations as FastAPI writes them: under "body"
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None


def body_schema(model: type[BaseModel]) -> dict:
    """The OpenAPI requestBody of a route that parses `model` itself (`parse_body`)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):  # "#/$defs/X" means this schema's own defs, not the OpenAPI document's
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            return (
                inline(defs[ref.rsplit("/", 1)[1]])
                if ref.startswith("#/$defs/")
                else {k: inline(v) for k, v in node.items()}
            )
        return [inline(v) for v in node] if isinstance(node, list) else node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return JSONResponse(
            error_body(exc.status, exc.message, exc.param, exc.type), status_code=exc.status, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        status = 400 if message.startswith("the request body is not valid JSON") else 422
        return error_response(status, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        message = "route not found" if exc.status_code == 404 else str(exc.detail)
        response = error_response(exc.status_code, message)
        response.headers.update(exc.headers or {})  # 405 keeps its Allow header
        return response
