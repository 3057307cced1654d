"""Settings of the HTTP gateway (:class:`HttpConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from disco.errors import DiscoError
from orchestrator.client import DEFAULT_TIMEOUT_S, client_tls
from orchestrator.http import DEFAULT_HTTP_PORT
from protos.runtime.server import format_address
from protos.runtime.tls import TlsFiles

#: Hosts that mean "every interface": a server bound there is reached through loopback.
ANY_HOST = ("0.0.0.0", "::", "[::]", "")
#: Largest request body (8 MiB): the orchestrator's largest public gRPC message
#: (``orchestrator.server.PUBLIC_MAX_RECEIVE_BYTES``), so a larger body could never become
#: one ``Generate`` call anyway; the orchestrator's own prompt limit (from the model's
#: context) is below it and answers 400.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
#: Time a client has to send a whole request head, from the connection's start or the end of
#: the previous response (Go's usual ``ReadHeaderTimeout``; nginx's ``client_header_timeout`` is 60 s).
DEFAULT_HEADER_TIMEOUT_S = 10.0
#: An idle keep-alive connection is closed after this long (uvicorn's default).
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5.0
#: Longest wait for the next piece of a request body (nginx's ``client_body_timeout`` is 60 s).
DEFAULT_BODY_TIMEOUT_S = 30.0
#: Largest ``max_tokens`` a request may ask for (NOTE: the orchestrator's own default limit,
#: ``OrchestratorLimits.max_new_tokens``; a gateway above its orchestrator's limit gets 400s from it).
DEFAULT_MAX_TOKENS_LIMIT = 4096
#: Generation requests served at once (NOTE: the orchestrator's default ``--max-sessions``).
DEFAULT_MAX_CONCURRENT = 64
#: Outputs one request may ask for: ``n`` (or completions' ``best_of``) times its prompts (vLLM has no
#: such limit; each output here is its own generation, and takes one of ``max_concurrent``'s places).
DEFAULT_MAX_CHOICES = 16
#: Waiting requests per running one, by default: ``--max-queue`` is this times ``--max-concurrent``.
DEFAULT_QUEUE_PER_SLOT = 2
#: Deadline of a request, from its arrival (the queue wait included) to its last byte.
DEFAULT_REQUEST_TIMEOUT_S = DEFAULT_TIMEOUT_S


def orchestrator_limits_for(http_limits: dict) -> dict:
    """The orchestrator's :class:`~orchestrator.servicer.OrchestratorLimits` fields that follow
    the HTTP limits (as ``disco serve`` ties them): the largest ``max_new_tokens`` and the
    concurrent requests."""
    names = {"max_tokens_limit": "max_new_tokens", "max_concurrent": "max_sessions"}
    return {names[key]: value for key, value in http_limits.items() if key in names and value is not None}


@dataclass(frozen=True)
class HttpConfig:
    """One gateway in front of one orchestrator.

    Args:
        server: ``HOST:PORT`` of the orchestrator.
        host: interface to bind.
        port: port to bind (0: a free one, read :attr:`RunningGateway.port`).
        tls_ca, tls_cert, tls_key, tls_server_name: TLS towards the orchestrator, as
            :class:`~orchestrator.client.DiscoClient` takes them (plaintext without).
        auth_tokens: the API keys: ``/v1/...`` requests must carry ``Authorization: Bearer
            <token>`` with one of them (each compared in constant time), and the first is sent
            on to the orchestrator (which accepts the same list); empty: no check, no token sent.
        https_cert, https_key: serve HTTPS with this certificate chain and key (plain HTTP without).
        timeout_s: deadline of each request, from its arrival (its wait in the queue
            included) to the end of its answer, and of each gRPC call (``None``: none);
            past it the answer is 504 ``deadline_exceeded``.
        model_name: the model name of ``/v1/models`` and of responses to requests that
            name none (default: the target model's name, from the orchestrator's ``Info``).
        access_log: log one line per request (uvicorn's access log).
        max_body_bytes: largest request body; a larger one is answered 413 before it is read
            beyond the limit (see :data:`DEFAULT_MAX_BODY_BYTES`).
        header_timeout_s: a connection that has not sent a whole request head this long after
            it opened (or after its previous response) is closed (slowloris guard).
        keep_alive_timeout_s: an idle keep-alive connection is closed after this long.
        body_timeout_s: a request whose body stalls this long between two reads is answered 408.
        max_tokens_limit: largest ``max_tokens`` (``max_completion_tokens``) a request may ask
            for; more is a 400 naming the field. Defaults are capped to it.
        max_concurrent: generations served at once (a request takes one place per output: ``n``,
            or ``best_of``, times its prompts); the next requests wait in the queue.
        max_queue: generation requests that may wait for a slot (first come, first served,
            each up to its deadline); one more is answered 429 at once. ``None``:
            :data:`DEFAULT_QUEUE_PER_SLOT` times ``max_concurrent``; 0: no queue.
        max_choices: outputs one request may ask for (``n``, or completions' ``best_of``, times
            its prompts); more, or more than ``max_concurrent``, is a 400 naming the field.
    """

    server: str
    host: str = "127.0.0.1"
    port: int = DEFAULT_HTTP_PORT
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None
    auth_tokens: tuple[str, ...] = ()
    https_cert: str | None = None
    https_key: str | None = None
    timeout_s: float | None = DEFAULT_REQUEST_TIMEOUT_S
    model_name: str | None = None
    access_log: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT
    max_concurrent: int = DEFAULT_MAX_CONCURRENT
    max_queue: int | None = None
    max_choices: int = DEFAULT_MAX_CHOICES

    def __post_init__(self) -> None:
        # NOTE: a lone string would otherwise become a tuple of one-character keys.
        object.__setattr__(self, "auth_tokens", as_tokens(self.auth_tokens))

    @classmethod
    def fronting(cls, server: str, host: str, port: int, *, tls_cert: str | None = None, tls_key: str | None = None,
                 tls_ca: str | None = None, tls_server_name: str | None = None, auth_tokens: Sequence[str] = (),
                 auth_token: str | Sequence[str] | None = None) -> "HttpConfig":
        """The gateway of a deployment whose services share one set of TLS files
        (``disco serve``, ``disco up``): with a certificate the orchestrator serves TLS, so
        the gateway connects over TLS (verifying it with ``tls_ca``, presenting the
        certificate) and serves HTTPS with the same certificate. ``auth_token`` is the
        deprecated spelling of ``auth_tokens`` (both may be given: the keys of both)."""
        tokens = (*as_tokens(auth_tokens), *as_tokens(auth_token))
        if not tls_cert:
            return cls(server, host, port, auth_tokens=tokens)
        return cls(server, host, port, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
                   tls_server_name=tls_server_name, auth_tokens=tokens, https_cert=tls_cert, https_key=tls_key)

    @property
    def upstream_token(self) -> str | None:
        """The token sent on to the orchestrator: the first API key (``None`` without keys)."""
        return self.auth_tokens[0] if self.auth_tokens else None

    @property
    def choices_limit(self) -> int:
        """Outputs one request may ask for: ``max_choices``, and no more than can run at once."""
        return min(self.max_choices, self.max_concurrent)

    @property
    def https(self) -> bool:
        return self.https_cert is not None

    @property
    def queue_limit(self) -> int:
        """Requests that may wait for a slot (``max_queue``, or its default)."""
        return DEFAULT_QUEUE_PER_SLOT * self.max_concurrent if self.max_queue is None else self.max_queue

    def validate(self) -> None:
        """Check the settings and read the TLS files once.

        Raises:
            DiscoError: a file is unreadable, a certificate comes without its key, the port is
                out of range, a key is empty or holds whitespace, or a limit is not positive
                (``max_queue``: negative).
        """
        if not 0 <= self.port <= 65535:
            raise DiscoError(f"--http-port must be in [0, 65535], got {self.port}")
        if any(not token or any(char.isspace() for char in token) for token in self.auth_tokens):
            raise DiscoError("an API key of the HTTP gateway is empty or contains whitespace")
        for name in ("max_body_bytes", "header_timeout_s", "keep_alive_timeout_s", "body_timeout_s",
                     "max_tokens_limit", "max_concurrent", "max_choices"):
            if not getattr(self, name) > 0:
                raise DiscoError(f"the HTTP gateway's {name} must be positive, got {getattr(self, name)}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise DiscoError(f"the HTTP gateway's request timeout must be positive, got {self.timeout_s}")
        if self.max_queue is not None and self.max_queue < 0:
            raise DiscoError(f"the HTTP gateway's max_queue must be >= 0, got {self.max_queue}")
        if (self.https_cert is None) != (self.https_key is None):
            raise DiscoError("the HTTPS certificate and key go together")
        client_tls(self.tls_ca, self.tls_cert, self.tls_key, self.tls_server_name)
        TlsFiles.from_paths(self.https_cert, self.https_key)


def as_tokens(tokens: str | Sequence[str] | None) -> tuple[str, ...]:
    """``tokens`` as a tuple of keys: ``None`` and ``""`` are none, a string is one key."""
    if not tokens:
        return ()
    return (tokens,) if isinstance(tokens, str) else tuple(tokens)


def local_address(host: str, port: int) -> str:
    """The address a gateway in the same process or pod uses to reach a server bound to
    ``host:port`` (loopback for a wildcard host)."""
    return format_address("127.0.0.1" if host in ANY_HOST else host, port)
