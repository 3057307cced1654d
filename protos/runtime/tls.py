"""TLS and mutual TLS of the services and their clients.

* :class:`TlsFiles` — the ``--tls-cert/--tls-key/--tls-ca`` PEM files of one process,
  read once; :meth:`TlsFiles.server_credentials` for its server and
  :meth:`TlsFiles.channel_credentials` for its clients (the orchestrator presents the
  same certificate to the backends as its client identity).
* :func:`secure_channel` / :func:`aio_channel` — a channel, TLS when files are given.

Tokens (the public one and the backend credential) live in :mod:`protos.runtime.auth`.

Roles (see docs/operations.md): a backend started with ``--tls-ca`` requires a client
certificate signed by that CA (mTLS); the orchestrator verifies the backends with its
``--tls-ca`` and, only with ``--tls-require-client-cert``, its own clients as well.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import grpc

from disco.errors import DiscoError


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
