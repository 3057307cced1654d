"""What grpcio itself costs on this machine: the floor under ``disco bench-transport``.

A bare grpcio server (bytes in, bytes out: no protobuf, no interceptors, no model) runs
in a child process; the client times the call patterns of one speculation iteration:

- ``unary``: one unary call (a Verify),
- ``stream``: one server stream of ``k + 1`` messages (a Draft block of ``k`` tokens and
  its summary),
- ``bidi``: one message out and one back on an already open bidirectional stream.

Each pattern is timed back to back (``idle_ms = 0``) and after the client slept
``idle_ms`` before the call. The idle rows are what a speculation loop sees: every
Draft or Verify call follows a model forward of milliseconds to seconds, during which
the threads that carry the call (client, gRPC pollers, server workers) went to sleep,
and waking them is part of the call's latency. ``iteration_floor_ms`` = ``stream +
unary`` at each idle time: a lower bound for ``transport ms/iter`` before any model,
protobuf or interceptor work.
"""

from __future__ import annotations

import os
import queue
import statistics
import subprocess
import sys
import time
from concurrent import futures
from typing import Callable

import grpc

_SERVICE = "floor.Bare"


def _identity(data: bytes) -> bytes:
    return data


def serve() -> None:
    """Child process: serve the three patterns, print the port, run until killed."""

    def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
        return b"x"

    def stream(request: bytes, context: grpc.ServicerContext):
        for _ in range(request[0]):
            yield b"x"

    def bidi(requests, context: grpc.ServicerContext):
        for request in requests:
            for _ in range(request[0]):
                yield b"x"

    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(unary, _identity, _identity),
        "Stream": grpc.unary_stream_rpc_method_handler(stream, _identity, _identity),
        "Bidi": grpc.stream_stream_rpc_method_handler(bidi, _identity, _identity),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(_SERVICE, handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


def _median_ms(call: Callable[[], None], calls: int, idle_s: float) -> float:
    for _ in range(max(calls // 10, 3)):  # warm-up
        call()
    samples = []
    for _ in range(calls):
        if idle_s:
            time.sleep(idle_s)
        started = time.perf_counter_ns()
        call()
        samples.append(time.perf_counter_ns() - started)
    return statistics.median(samples) / 1e6


def measure(block_tokens: int = 6, idle_ms: tuple[float, ...] = (0.0, 5.0, 100.0), calls: int = 200) -> dict:
    """Median latency (ms) of each pattern at each idle time; see the module docstring."""
    child = subprocess.Popen([sys.executable, "-m", "disco_cli.bench.grpc_floor", "--serve"],
                             stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    requests: queue.SimpleQueue = queue.SimpleQueue()
    try:
        port = int(child.stdout.readline())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            unary = channel.unary_unary(f"/{_SERVICE}/Unary", _identity, _identity)
            stream = channel.unary_stream(f"/{_SERVICE}/Stream", _identity, _identity)
            bidi = channel.stream_stream(f"/{_SERVICE}/Bidi", _identity, _identity)
            responses = bidi(iter(requests.get, None))
            block = bytes([block_tokens + 1])

            def round_trip() -> None:
                requests.put(b"\x01")
                next(responses)

            patterns = {"unary": lambda: unary(b"x"), "stream": lambda: list(stream(block)), "bidi": round_trip}
            rows = []
            for idle in idle_ms:
                row = {"idle_ms": idle}
                for name, call in patterns.items():
                    row[f"{name}_ms"] = _median_ms(call, calls if idle < 50 else max(calls // 4, 10), idle / 1e3)
                row["iteration_floor_ms"] = row["stream_ms"] + row["unary_ms"]
                rows.append(row)
            requests.put(None)
    finally:
        child.kill()
        child.wait()
    return {"block_tokens": block_tokens, "calls": calls, "grpcio": grpc.__version__, "rows": rows}


def print_table(result: dict) -> None:
    print(f"bare grpcio {result['grpcio']} on loopback, median of {result['calls']} calls "
          f"(stream = {result['block_tokens'] + 1} messages)")
    print(f"{'idle before call':>16} {'unary ms':>9} {'stream ms':>10} {'bidi rt ms':>11} {'iteration floor ms':>19}")
    for row in result["rows"]:
        print(f"{row['idle_ms']:>13.0f} ms {row['unary_ms']:>9.3f} {row['stream_ms']:>10.3f} {row['bidi_ms']:>11.3f} "
              f"{row['iteration_floor_ms']:>19.3f}")


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    serve()
