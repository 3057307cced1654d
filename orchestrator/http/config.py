"""Settings of the HTTP gateway (:class:`HttpConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from disco.errors import DiscoError
from orchestrator.client import DEFAULT_TIMEOUT_S, client_tls
from orchestrator.http import DEFAULT_HTTP_PORT
from protos.runtime.server import format_address
from protos.runtime.tls import TlsFiles

#: Hosts that mean "every interface": a server bound there is reached through loopback.
ANY_HOST = ("0.0.0.0", "::", "[::]", "")


@dataclass(frozen=True)
class HttpConfig:
    """One gateway in front of one orchestrator.

    Args:
        server: ``HOST:PORT`` of the orchestrator.
        host: interface to bind.
        port: port to bind (0: a free one, read :attr:`RunningGateway.port`).
        tls_ca, tls_cert, tls_key, tls_server_name: TLS towards the orchestrator, as
            :class:`~orchestrator.client.DiscoClient` takes them (plaintext without).
        auth_token: when set, ``/v1/...`` requests must carry ``Authorization: Bearer
            <auth_token>``, and it is sent on to the orchestrator; ``None``: no check, no token sent.
        https_cert, https_key: serve HTTPS with this certificate chain and key (plain HTTP without).
        timeout_s: deadline of each gRPC call (``None``: none).
        model_name: the model name of ``/v1/models`` and of responses to requests that
            name none (default: the target model's name, from the orchestrator's ``Info``).
        access_log: log one line per request (uvicorn's access log).
    """

    server: str
    host: str = "127.0.0.1"
    port: int = DEFAULT_HTTP_PORT
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None
    auth_token: str | None = None
    https_cert: str | None = None
    https_key: str | None = None
    timeout_s: float | None = DEFAULT_TIMEOUT_S
    model_name: str | None = None
    access_log: bool = False

    @classmethod
    def fronting(cls, server: str, host: str, port: int, *, tls_cert: str | None = None, tls_key: str | None = None,
                 tls_ca: str | None = None, tls_server_name: str | None = None,
                 auth_token: str | None = None) -> "HttpConfig":
        """The gateway of a deployment whose services share one set of TLS files
        (``disco serve``, ``disco up``): with a certificate the orchestrator serves TLS, so
        the gateway connects over TLS (verifying it with ``tls_ca``, presenting the
        certificate) and serves HTTPS with the same certificate."""
        if not tls_cert:
            return cls(server, host, port, auth_token=auth_token)
        return cls(server, host, port, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
                   tls_server_name=tls_server_name, auth_token=auth_token, https_cert=tls_cert, https_key=tls_key)

    @property
    def https(self) -> bool:
        return self.https_cert is not None

    def validate(self) -> None:
        """Check the settings and read the TLS files once.

        Raises:
            DiscoError: a file is unreadable, a certificate comes without its key, or the port is out of range.
        """
        if not 0 <= self.port <= 65535:
            raise DiscoError(f"--http-port must be in [0, 65535], got {self.port}")
        if (self.https_cert is None) != (self.https_key is None):
            raise DiscoError("the HTTPS certificate and key go together")
        client_tls(self.tls_ca, self.tls_cert, self.tls_key, self.tls_server_name)
        TlsFiles.from_paths(self.https_cert, self.https_key)


def local_address(host: str, port: int) -> str:
    """The address a gateway in the same process or pod uses to reach a server bound to
    ``host:port`` (loopback for a wildcard host)."""
    return format_address("127.0.0.1" if host in ANY_HOST else host, port)
