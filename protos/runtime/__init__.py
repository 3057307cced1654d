"""The gRPC runtime the three services share (apart from the generated contract).

:mod:`~protos.runtime.server` (server builder with health and reflection, the error
interceptor mapping domain errors to status codes, graceful shutdown, channel options),
:mod:`~protos.runtime.tls` (TLS / mTLS files, bearer tokens), :mod:`~protos.runtime.metrics`
(Prometheus ``/metrics``), :mod:`~protos.runtime.logs` (structured logs with per-call fields).
"""
