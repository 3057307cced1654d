"""Errors of the HTTP gateway in the OpenAI error shape.

Every error answer has the body ``{"error": {"message", "type", "param", "code"}}``.
:data:`GRPC_TO_HTTP` is the one place where a gRPC status of the orchestrator becomes an
HTTP status; :func:`from_rpc_error` applies it.
"""

from __future__ import annotations

import re
from typing import Any

import grpc

#: The HTTP status of each gRPC status the orchestrator answers with; any other is 500.
GRPC_TO_HTTP: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

#: ``error.type`` by HTTP status, as the OpenAI API names them (5xx: ``server_error``).
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}

#: Field a refusal of the orchestrator is about, from the start of its message (best
#: effort; ``None`` when nothing matches): the gRPC API names its own fields.
_PARAM_HINTS: tuple[tuple[str, str], ...] = (
    (r"(unknown|malformed) policy|policy '", "policy"),
    (r"max_new_tokens\b", "max_tokens"),
    (r"max_lookahead\b", "max_lookahead"),
    (r"temperature\b", "temperature"),
    (r"top_p\b", "top_p"),
    (r"top_k\b", "top_k"),
    (r"seed\b", "seed"),
    (r"stop strings?\b", "stop"),
    *((rf"{name}\b", name) for name in ("stop_token_ids", "min_tokens", "repetition_penalty", "presence_penalty",
                                         "frequency_penalty", "logit_bias", "min_p", "bad_words")),
    (r"bad_words_token_ids\b", "bad_words"),
    (r"--chat\b|.*chat template|messages\b|the last message", "messages"),
    (r"prompt\b", "prompt"),
)


class ApiError(Exception):
    """An HTTP error answer in the OpenAI shape.

    Args:
        status: the HTTP status.
        message: what went wrong, for the client.
        param: the request field at fault, if one is.
        code: a short machine-readable code (the gRPC status name, lower case, for
            errors of the orchestrator).
        error_type: the ``type``, where it is not the status's (:data:`ERROR_TYPES`).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 error_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self._type = error_type

    @property
    def type(self) -> str:
        if self._type is not None:
            return self._type
        return ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 ``invalid_request_error``."""
    return ApiError(400, message, param, code)


def route_error(status: int, method: str, path: str, allowed: str = "") -> ApiError:
    """The 404 of an unknown URL and the 405 of a method a route does not take, in OpenAI's
    words (``Invalid URL (POST /v1/foo)``), typed ``invalid_request_error`` as OpenAI's are."""
    if status == 405:
        message = f"Invalid method for URL ({method} {path})" + (f"; allowed: {allowed}" if allowed else "")
        return ApiError(405, message, code="method_not_allowed", error_type="invalid_request_error")
    if status == 404:
        return ApiError(404, f"Invalid URL ({method} {path})", code="not_found", error_type="invalid_request_error")
    return ApiError(status, f"{method} {path}: HTTP {status}")


def deadline_exceeded(timeout_s: float | None) -> ApiError:
    """The 504 of a request past its deadline (in the queue, or generating)."""
    return ApiError(504, f"the request did not finish within its deadline of {timeout_s:g} s",
                    code="deadline_exceeded")


def from_rpc_error(error: grpc.RpcError, prompt_param: str = "prompt") -> ApiError:
    """The HTTP error for a failed gRPC call (the one status mapping, :data:`GRPC_TO_HTTP`).

    ``prompt_param`` names the request's prompt field (``messages`` for a chat) when the
    orchestrator refused the prompt.
    """
    code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
    code = code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN
    details = (error.details() if callable(getattr(error, "details", None)) else None) or code.name
    status = GRPC_TO_HTTP.get(code, 500)
    param = param_hint(details) if status == 400 else None
    if param == "prompt":
        param = prompt_param
    return ApiError(status, details, param, code.name.lower())


def param_hint(message: str) -> str | None:
    """The request field an orchestrator message is about (see :data:`_PARAM_HINTS`)."""
    for pattern, param in _PARAM_HINTS:
        if re.match(pattern, message, flags=re.IGNORECASE):
            return param
    return None
