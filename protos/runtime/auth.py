"""Who may call a service: bearer tokens, the backend credential, and the caller's identity.

Two credentials, never the same (docs/security.md):

* the **public token(s)** of the orchestrator and the HTTP gateway (``$DISCO_AUTH_TOKEN``,
  ``--auth-token-file``: one token per line, several API keys allowed);
* the **backend credential** the orchestrator presents to the draft and target services:
  mTLS (a client certificate signed by the backends' ``--tls-ca``) and/or a backend token
  (``$DISCO_BACKEND_TOKEN``, ``--backend-token-file``) sent as ``authorization: Bearer``.
  A client holding only the public token is refused by the backends.

:func:`caller_of` names the authenticated caller of a call (the certificate it presented,
else the token it presented, else ``anonymous``): a backend session belongs to the caller
that started it (:func:`session_key`), so another caller can neither read nor extend it.

Tokens never travel on command lines (``/proc/*/cmdline`` is world-readable): they come
from the environment or from files.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import secrets
from pathlib import Path
from typing import Any, Callable, Sequence

import grpc

from disco.errors import DiscoError, InvalidRequest

#: Environment variable holding the public bearer token (server and clients).
AUTH_TOKEN_ENV = "DISCO_AUTH_TOKEN"
#: Environment variable holding the backend token (backends and the orchestrator).
BACKEND_TOKEN_ENV = "DISCO_BACKEND_TOKEN"
#: Call metadata key of a token (lower case, as gRPC requires).
AUTH_METADATA_KEY = "authorization"
#: Methods under these prefixes need no token (load balancers and tools must reach them).
UNAUTHENTICATED_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
#: Shortest token accepted (a token is a secret, not a password someone types).
MIN_TOKEN_CHARS = 16
#: Longest session id a backend accepts, and its characters (ids travel in logs and metrics).
MAX_SESSION_ID_CHARS = 128
_SESSION_ID = re.compile(r"[A-Za-z0-9._~:-]+")
#: Hosts that are loopback (a server bound there is reachable from this machine only).
LOOPBACK_HOSTS = ("localhost",)


def read_token_file(path: str | os.PathLike, flag: str = "--auth-token-file") -> tuple[str, ...]:
    """The tokens of a file: one per line; blank lines and ``#`` comments are skipped.

    Raises:
        DiscoError: the file is unreadable, holds no token, or a token is shorter than
            :data:`MIN_TOKEN_CHARS` or contains whitespace.
    """
    try:
        text = Path(path).expanduser().read_text()
    except OSError as error:
        raise DiscoError(f"cannot read {flag} {path}: {error.strerror or error}") from None
    tokens = tuple(line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))
    if not tokens:
        raise DiscoError(f"{flag} {path} holds no token (one token per line)")
    for token in tokens:
        check_token(token, flag)
    return tokens


def check_token(token: str, source: str) -> None:
    """Raises :class:`DiscoError` unless ``token`` is a usable secret."""
    if len(token) < MIN_TOKEN_CHARS or any(char.isspace() for char in token) or not token.isprintable():
        raise DiscoError(f"a token from {source} must be at least {MIN_TOKEN_CHARS} printable characters "
                         "without spaces (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")


def public_tokens(token: str | None = None, token_file: str | os.PathLike | None = None) -> tuple[str, ...]:
    """The public API's tokens: ``--auth-token-file`` (every line), else ``token`` (the
    deprecated ``--auth-token`` flag), else ``$DISCO_AUTH_TOKEN``; empty: no token."""
    if token_file:
        return read_token_file(token_file, "--auth-token-file")
    token = token if token is not None else os.environ.get(AUTH_TOKEN_ENV)
    return (token,) if token else ()


def auth_token_from_env(token: str | None = None) -> str | None:
    """A client's public token: ``token`` if given, else ``$DISCO_AUTH_TOKEN``; empty means none."""
    token = token if token is not None else os.environ.get(AUTH_TOKEN_ENV)
    return token or None


def backend_tokens(token_file: str | os.PathLike | None = None) -> tuple[str, ...]:
    """The backend tokens: ``--backend-token-file`` (every line; a backend accepts each of
    them, an orchestrator presents the first), else ``$DISCO_BACKEND_TOKEN``; empty: none."""
    if token_file:
        return read_token_file(token_file, "--backend-token-file")
    token = os.environ.get(BACKEND_TOKEN_ENV)
    if token:
        check_token(token, f"${BACKEND_TOKEN_ENV}")
    return (token,) if token else ()


def new_token() -> str:
    """A fresh random token (256 bits), e.g. the backend token of one ``disco serve`` launch."""
    return secrets.token_urlsafe(32)


def token_fingerprint(token: str) -> str:
    """A short, non-reversible name of a token (for logs and caller identities)."""
    return hashlib.sha256(token.encode()).hexdigest()[:16]


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``token`` (empty without one)."""
    return ((AUTH_METADATA_KEY, f"Bearer {token}"),) if token else ()


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a server reachable from this machine only
    (``0.0.0.0``, ``::`` and names other than ``localhost`` are not)."""
    host = host.strip("[]")
    if host in LOOPBACK_HOSTS or host.startswith("unix:"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_session_id(session_id: str) -> None:
    """Raises :class:`InvalidRequest` unless ``session_id`` is 1-128 characters of
    ``[A-Za-z0-9._~:-]`` (ids reach logs and thread names; nothing else may be in them)."""
    if not session_id:
        raise InvalidRequest("session_id is empty")
    if len(session_id) > MAX_SESSION_ID_CHARS:
        raise InvalidRequest(f"session_id has {len(session_id)} characters, at most {MAX_SESSION_ID_CHARS} allowed")
    if not _SESSION_ID.fullmatch(session_id):
        raise InvalidRequest("session_id may contain only letters, digits and . _ ~ : -")


def caller_of(context: grpc.ServicerContext) -> str:
    """The authenticated caller of a call: ``cert:<fingerprint>`` for a client certificate
    (mTLS), else ``token:<fingerprint>`` for the bearer token it presented (already checked
    by :class:`BearerTokenInterceptor`), else ``anonymous``."""
    auth = context.auth_context() or {}
    certificate = b"".join(auth.get("x509_pem_cert", ()))
    if certificate:
        return "cert:" + hashlib.sha256(certificate).hexdigest()[:16]
    presented = _presented(context.invocation_metadata())
    if presented:
        return "token:" + hashlib.sha256(presented).hexdigest()[:16]
    return "anonymous"


class SessionKey(str):
    """The engine's key of one caller's session: ``"<caller>/<session id>"``, so another
    caller's key never names it; its ``repr`` is the caller's own id, so error messages
    (``session 'abc' not found``) say what the caller sent and nothing of who owns what."""

    session_id: str

    def __new__(cls, caller: str, session_id: str) -> "SessionKey":
        key = super().__new__(cls, f"{caller}/{session_id}")
        key.session_id = session_id
        return key

    def __repr__(self) -> str:
        return repr(self.session_id)


def session_key(caller: str, session_id: str) -> SessionKey:
    """The engine's key of ``caller``'s session ``session_id`` (checked first, see
    :func:`check_session_id`): a session belongs to the caller that started it."""
    check_session_id(session_id)
    return SessionKey(caller, session_id)


def _presented(metadata: Sequence[Any] | None) -> bytes:
    for item in metadata or ():
        key, value = (item.key, item.value) if hasattr(item, "key") else item
        if key == AUTH_METADATA_KEY:
            return value.encode() if isinstance(value, str) else bytes(value)
    return b""


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuses calls without ``authorization: Bearer <token>`` (one of ``tokens``) with
    ``UNAUTHENTICATED``.

    Each comparison takes constant time, and every token is compared (which one matched
    does not show in the timing); health checks and reflection are exempt. The handler is
    swapped before the request is read, so a refused call costs no work.
    """

    def __init__(self, tokens: str | Sequence[str], refusal: str | None = None) -> None:
        tokens = (tokens,) if isinstance(tokens, str) else tuple(tokens)
        if not tokens or not all(tokens):
            raise DiscoError("the auth token is empty")
        self._expected = tuple(f"Bearer {token}".encode() for token in tokens)
        self._refusal = refusal or _REFUSAL

    def accepts(self, presented: bytes) -> bool:
        matched = False
        for expected in self._expected:
            matched |= hmac.compare_digest(presented, expected)
        return matched

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(UNAUTHENTICATED_PREFIXES):
            return handler
        if self.accepts(_presented(handler_call_details.invocation_metadata)):
            return handler
        return refusing(handler, grpc.StatusCode.UNAUTHENTICATED, self._refusal)


_REFUSAL = "missing or invalid bearer token (send `authorization: Bearer <token>` metadata)"
BACKEND_REFUSAL = ("missing or invalid backend credential: this backend serves only its orchestrator "
                   "(the backend token, or a client certificate; see docs/security.md)")


def refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that answers ``code`` with ``message``."""
    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    def refuse_stream(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)
        yield  # pragma: no cover - makes this a generator

    ignore = lambda data: data  # noqa: E731 - the request of a refused call is never parsed (None = failure)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, ignore, handler.response_serializer)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, ignore, handler.response_serializer)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, ignore, handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(refuse, ignore, handler.response_serializer)


class TokenCallInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call of a channel (the orchestrator's
    backend credential)."""

    def __init__(self, token: str) -> None:
        self._metadata = auth_metadata(token)

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [item for item in (details.metadata or ()) if item[0] != AUTH_METADATA_KEY]
        return _CallDetails(details.method, details.timeout, [*metadata, *self._metadata], details.credentials,
                            getattr(details, "wait_for_ready", None), getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation: Callable, details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Callable, details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._with_token(details), request)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method: str, timeout: float | None, metadata: Sequence[tuple[str, str]], credentials: Any,
                 wait_for_ready: bool | None, compression: Any) -> None:
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression
