"""How a draft or target service authenticates its caller (:class:`BackendSecurity`).

A backend serves one orchestrator, never the public: it authenticates every call with
mTLS (a client certificate signed by its ``--tls-ca``) and/or a backend token
(:mod:`protos.runtime.auth`). Before it binds, :meth:`BackendSecurity.check` refuses a
backend that the network could reach without those credentials protecting the call:

* a non-loopback interface without TLS (a token or a session would travel in clear), or
  with TLS but no client authentication (neither mTLS nor a token): refused, unless
  ``--insecure`` (then a loud warning, and ``Info.security`` and ``/metrics`` say so);
* loopback without any credential: allowed for development, with a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from disco.errors import DiscoError
from protos.runtime.auth import BACKEND_REFUSAL, BACKEND_TOKEN_ENV, BearerTokenInterceptor, is_loopback
from protos.runtime.tls import TlsFiles

logger = logging.getLogger(__name__)

REFUSED_HINT = (f"give it TLS with client authentication (--tls-cert, --tls-key and --tls-ca: mTLS) or TLS plus a "
                f"backend token (${BACKEND_TOKEN_ENV} or --backend-token-file), bind 127.0.0.1, or pass --insecure "
                "to accept the risk (docs/security.md)")


@dataclass(frozen=True)
class BackendSecurity:
    """The credentials a backend accepts.

    Args:
        tokens: backend tokens it accepts as ``authorization: Bearer`` (empty: none needed
            beyond mTLS, or none at all on loopback in development).
        insecure: serve on a non-loopback interface without TLS or without client
            authentication (``--insecure``): warned about and reported, never the default.
    """

    tokens: tuple[str, ...] = ()
    insecure: bool = False

    def statement(self, host: str, tls: TlsFiles | None) -> str:
        """How callers are authenticated, as ``Info.security`` and ``/metrics`` say it.

        Raises:
            DiscoError: the backend would be reachable without credentials (see the module docstring).
        """
        mtls = tls is not None and tls.cert is not None and tls.ca is not None
        encrypted = tls is not None and tls.cert is not None
        how = " + ".join((["mTLS"] if mtls else []) + (["backend token"] if self.tokens else []))
        if is_loopback(host):
            if how:
                return f"authenticated ({how}) on loopback"
            return "development: loopback without credentials (any local process may call it)"
        if encrypted and how:
            return f"authenticated ({how}) over TLS"
        problem = ("without TLS" if not encrypted else "with TLS but no client authentication")
        if not self.insecure:
            raise DiscoError(f"refusing to serve a backend on {host} {problem}: anyone who can reach it could run "
                             f"the model and read or alter sessions; {REFUSED_HINT}")
        return f"INSECURE (--insecure): {host} {problem}" + (f", {how}" if how else ", no credentials")

    def warn(self, statement: str) -> None:
        """Log the warning a statement deserves (insecure, or development without credentials)."""
        if statement.startswith("INSECURE"):
            logger.warning("!!! this backend is %s: anyone who can reach it can use it !!!", statement)
        elif statement.startswith("development"):
            logger.warning("backend on loopback without credentials (development only): set $%s or "
                           "--backend-token-file, or --tls-ca (mTLS), before sharing this machine", BACKEND_TOKEN_ENV)

    def interceptors(self) -> list[grpc.ServerInterceptor]:
        """The server interceptors that check the token (none without tokens)."""
        return [BearerTokenInterceptor(self.tokens, BACKEND_REFUSAL)] if self.tokens else []
