"""TLS, mutual TLS and the bearer token of the public API.

* :class:`TlsFiles` — the ``--tls-cert/--tls-key/--tls-ca`` PEM files of one process,
  read once; :meth:`TlsFiles.server_credentials` for its server and
  :meth:`TlsFiles.channel_credentials` for its clients (the orchestrator presents the
  same certificate to the backends as its client identity).
* :func:`secure_channel` / :func:`aio_channel` — a channel, TLS when files are given.
* :class:`BearerTokenInterceptor` — ``UNAUTHENTICATED`` unless the call carries
  ``authorization: Bearer <token>``; health checks and reflection are exempt.

Roles (see docs/operations.md): a backend started with ``--tls-ca`` requires a client
certificate signed by that CA (mTLS); the orchestrator verifies the backends with its
``--tls-ca`` and, only with ``--tls-require-client-cert``, its own clients as well.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import grpc

from disco.errors import DiscoError

#: Environment variable holding the bearer token (server and clients), so that it never
#: appears on a command line (``/proc/*/cmdline`` is world-readable).
AUTH_TOKEN_ENV = "DISCO_AUTH_TOKEN"
#: Call metadata key of the token (lower case, as gRPC requires).
AUTH_METADATA_KEY = "authorization"
#: Methods under these prefixes need no token (load balancers and tools must reach them).
UNAUTHENTICATED_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


@dataclass(frozen=True)
class TlsFiles:
    """PEM contents of a process's TLS material.

    Args:
        cert: certificate chain (server identity; also the client identity towards backends).
        key: private key of ``cert``.
        ca: CA bundle that verifies the peer (backends: client certificates, then required;
            orchestrator: the backends; clients: the server).
        server_name: name to check the server certificate against when it differs from
            the host of the address (e.g. the address is an IP, the certificate names a host).
    """

    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None
    server_name: str | None = None

    @classmethod
    def from_paths(cls, cert: str | os.PathLike | None = None, key: str | os.PathLike | None = None,
                   ca: str | os.PathLike | None = None, server_name: str | None = None) -> "TlsFiles | None":
        """Read the files; ``None`` when none is given.

        Raises:
            DiscoError: a file is unreadable, or a certificate comes without its key (or the reverse).
        """
        if cert is None and key is None and ca is None:
            return None
        if (cert is None) != (key is None):
            raise DiscoError("--tls-cert and --tls-key go together (a certificate and its private key)")
        return cls(_read(cert, "--tls-cert"), _read(key, "--tls-key"), _read(ca, "--tls-ca"), server_name or None)

    def server_credentials(self, require_client_cert: bool) -> grpc.ServerCredentials:
        """Credentials of a TLS server; with ``require_client_cert`` clients must present a
        certificate signed by ``ca`` (mutual TLS).

        Raises:
            DiscoError: no certificate/key, or client certificates required without a CA.
        """
        if self.cert is None or self.key is None:
            raise DiscoError("a TLS server needs --tls-cert and --tls-key")
        if require_client_cert and self.ca is None:
            raise DiscoError("requiring client certificates needs --tls-ca (the CA that signs them)")
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca if require_client_cert
                                           else None, require_client_auth=require_client_cert)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client credentials: verify the server with ``ca`` (the system roots when absent)
        and present ``cert`` when there is one."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def channel_options(self) -> tuple[tuple[str, Any], ...]:
        return (("grpc.ssl_target_name_override", self.server_name),) if self.server_name else ()


def _read(path: str | os.PathLike | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as error:
        raise DiscoError(f"cannot read {flag} {path}: {error.strerror or error}") from None


def secure_channel(address: str, tls: TlsFiles | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A blocking channel to ``address``: TLS with ``tls``, plaintext without."""
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.channel_credentials(), options=[*options, *tls.channel_options()])


def aio_channel(address: str, tls: TlsFiles | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """The ``grpc.aio`` counterpart of :func:`secure_channel`."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=[*options, *tls.channel_options()])


def auth_token_from_env(token: str | None = None) -> str | None:
    """``token`` if given, else ``$DISCO_AUTH_TOKEN``; empty means none."""
    token = token if token is not None else os.environ.get(AUTH_TOKEN_ENV)
    return token or None


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``token`` (empty without one)."""
    return ((AUTH_METADATA_KEY, f"Bearer {token}"),) if token else ()


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuses calls without ``authorization: Bearer <token>`` with ``UNAUTHENTICATED``.

    The comparison takes constant time; health checks and reflection are exempt. The
    handler is swapped before the request is read, so a refused call costs no work.
    """

    def __init__(self, token: str) -> None:
        if not token:
            raise DiscoError("the auth token is empty")
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(UNAUTHENTICATED_PREFIXES):
            return handler
        presented = dict(handler_call_details.invocation_metadata or ()).get(AUTH_METADATA_KEY, "")
        presented = presented.encode() if isinstance(presented, str) else bytes(presented)
        if hmac.compare_digest(presented, self._expected):
            return handler
        return _refusing(handler)


_REFUSAL = "missing or invalid bearer token (send `authorization: Bearer <token>` metadata)"


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that answers ``UNAUTHENTICATED``."""
    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)

    def refuse_stream(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)
        yield  # pragma: no cover - makes this a generator

    ignore = lambda data: data  # noqa: E731 - the request of a refused call is never parsed (None = failure)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, ignore, handler.response_serializer)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, ignore, handler.response_serializer)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, ignore, handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(refuse, ignore, handler.response_serializer)
