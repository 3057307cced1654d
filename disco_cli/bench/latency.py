"""Added round-trip latency on the orchestrator's calls to the backends (benchmarks only).

``disco bench --added-rtt-ms N`` runs the orchestrator through this module instead of
``disco orchestrator``: ``python -m disco_cli.bench.latency --added-rtt-ms N orchestrator ...``
is that command with every call to a draft or target service delayed by N ms before it is
sent — the round trip of services on different nodes, on one machine. One delay per call,
on the critical path exactly as a network round trip would be (a streamed draft block pays
it once). The production command has no such option: the delay is a client interceptor the
bench hands to :func:`orchestrator.server.serve`.
"""

from __future__ import annotations

import argparse
import sys
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


def main(argv: list[str] | None = None) -> int:
    """``--added-rtt-ms N orchestrator ARGS...``: ``disco orchestrator ARGS...`` with the delay."""
    from disco_cli import main as cli  # noqa: PLC0415 - tunes the CPU math env first
    from disco_cli.commands.serve import run_orchestrator  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="python -m disco_cli.bench.latency")
    parser.add_argument("--added-rtt-ms", type=float, required=True)
    known, rest = parser.parse_known_args(argv)
    args = cli.build_parser().parse_args(rest)
    if args.func is not run_orchestrator:
        parser.error("only the orchestrator command takes an added latency")
    return cli.run(args, lambda parsed: run_orchestrator(parsed, [AddedLatency(known.added_rtt_ms / 1000)]))


if __name__ == "__main__":
    sys.exit(main())
