"""Run the HTTP gateway with uvicorn: :func:`start_in_thread` serves it from a background
thread of this process (``disco serve --http-port``, ``disco http``, the Ray actor, tests)
and returns once it listens.

Connections are uvicorn's h11 protocol with a header deadline added
(:class:`HeaderTimeoutProtocol`): uvicorn closes idle keep-alive connections
(``timeout_keep_alive``) but has no limit on the time a client takes to send a request
head, so a client that sends half a request line and stalls would hold its connection
forever (slowloris).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from disco.errors import DiscoError
from orchestrator.http.app import create_app
from orchestrator.http.config import HttpConfig
from protos.runtime.server import format_address

STARTUP_TIMEOUT_S = 30.0
#: How long open streams may run on after a stop before they are cut.
GRACEFUL_SHUTDOWN_S = 5.0

logger = logging.getLogger(__name__)


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, with a deadline on each request head.

    The clock starts when the connection opens and again when a response ends, and stops
    when a whole request head has arrived; bytes trickling in do not restart it. When it
    runs out the connection is closed (nothing is answered: no request was received).

    Args:
        header_timeout_s: the deadline, in seconds.
        *args, **kwargs: those of :class:`~uvicorn.protocols.http.h11_impl.H11Protocol`.
    """

    def __init__(self, *args: Any, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_header()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()  # runs on new bytes and after each response
        self._watch_header()

    def _watch_header(self) -> None:
        """Start the clock while no request head is in (the client's state ``IDLE``), else stop it."""
        if self.conn.their_state is not h11.IDLE:
            self._stop_header_timer()
        elif self._header_timer is None and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timed_out)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.debug("closing a connection that sent no whole request head in %g s", self.header_timeout_s)
            self.transport.close()


@dataclass
class RunningGateway:
    """A gateway serving from a background thread."""

    config: HttpConfig
    port: int
    _server: uvicorn.Server
    _thread: threading.Thread

    @property
    def address(self) -> str:
        """``HOST:PORT`` it listens on."""
        return format_address(self.config.host, self.port)

    @property
    def url(self) -> str:
        """Base URL of the OpenAI API (``http://HOST:PORT/v1``)."""
        return f"{'https' if self.config.https else 'http'}://{self.address}/v1"

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = GRACEFUL_SHUTDOWN_S + 5.0) -> None:
        """Stop listening, let open requests finish for up to :data:`GRACEFUL_SHUTDOWN_S`, then return."""
        self._server.should_exit = True
        self._thread.join(timeout_s)


def start_in_thread(config: HttpConfig, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> RunningGateway:
    """Serve the gateway from a daemon thread; returns once it listens.

    Raises:
        DiscoError: bad settings (see :meth:`HttpConfig.validate`), or the address cannot be bound.
    """
    config.validate()
    server = uvicorn.Server(uvicorn.Config(
        create_app(config), host=config.host, port=config.port, log_config=None, access_log=config.access_log,
        ssl_certfile=config.https_cert, ssl_keyfile=config.https_key, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        lifespan="on", server_header=False, timeout_keep_alive=config.keep_alive_timeout_s,
        http=functools.partial(HeaderTimeoutProtocol, header_timeout_s=config.header_timeout_s)))
    thread = threading.Thread(target=server.run, name="disco-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive():
            raise DiscoError(f"cannot serve HTTP on {format_address(config.host, config.port)} "
                             "(address in use or not available; see the log above)")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise DiscoError(f"the HTTP gateway did not start within {startup_timeout_s:.0f} s")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    running = RunningGateway(replace(config, port=port), port, server, thread)
    logger.info("OpenAI-compatible HTTP API on %s (orchestrator %s)", running.url, config.server)
    return running
