"""The OpenAI-compatible HTTP gateway in front of the orchestrator (docs/http.md).

* :mod:`orchestrator.http.config` — :class:`~orchestrator.http.config.HttpConfig`.
* :mod:`orchestrator.http.app` — the ASGI app (FastAPI) and its routes.
* :mod:`orchestrator.http.schemas` / :mod:`orchestrator.http.responses` — OpenAI request
  bodies mapped to one gRPC ``GenerateRequest``, and results shaped as OpenAI objects.
* :mod:`orchestrator.http.choices` — several outputs per request (``n``, ``best_of``, a list of
  prompts): one gRPC call each, run together.
* :mod:`orchestrator.http.errors` — the OpenAI error shape and the one gRPC -> HTTP status map.
* :mod:`orchestrator.http.middleware` — bearer token check, request counters and admission.
* :mod:`orchestrator.http.server` — run it with uvicorn from a background thread.

This package imports nothing heavy itself, so that the CLI can read
:data:`DEFAULT_HTTP_PORT` without loading the web stack.
"""

#: Port of the HTTP API when none is given (vLLM's and most OpenAI-compatible servers' default).
DEFAULT_HTTP_PORT = 8000
