"""Run the HTTP gateway with uvicorn: :func:`start_in_thread` serves it from a background
thread of this process (``disco serve --http-port``, ``disco http``, the Ray actor, tests)
and returns once it listens.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace

import uvicorn

from disco.errors import DiscoError
from orchestrator.http.app import create_app
from orchestrator.http.config import HttpConfig
from protos.runtime.server import format_address

STARTUP_TIMEOUT_S = 30.0
#: How long open streams may run on after a stop before they are cut.
GRACEFUL_SHUTDOWN_S = 5.0

logger = logging.getLogger(__name__)


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
        lifespan="on", server_header=False))
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
