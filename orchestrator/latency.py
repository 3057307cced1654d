"""Added round-trip latency on the orchestrator's calls to the backends (benchmarks only).

``disco orchestrator --added-rtt-ms N`` (and ``disco bench --added-rtt-ms N``) delays every
call to a draft or target service by N ms before it is sent: the round trip of draft and
target services on different nodes, on one machine. One delay per call, on the critical
path exactly as a network round trip would be (a streamed draft block pays it once).
"""

from __future__ import annotations

import time

import grpc


class AddedLatency(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Sleeps ``seconds`` before each call goes out."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def _delayed(self, continuation, client_call_details, request_or_iterator):
        time.sleep(self.seconds)
        return continuation(client_call_details, request_or_iterator)

    # One delay per call, whatever its shape.
    intercept_unary_unary = intercept_unary_stream = _delayed
    intercept_stream_unary = intercept_stream_stream = _delayed


def with_added_latency(channel: grpc.Channel, seconds: float) -> grpc.Channel:
    """``channel`` itself when ``seconds`` is 0, else the channel with every call delayed."""
    return grpc.intercept_channel(channel, AddedLatency(seconds)) if seconds > 0 else channel
