"""Does the calling thread change a forward's time? (issue 50 item 5: the target's forward is
~34% slower in the target service than in process.)

A gRPC server runs each call on one of its pool's threads, and the batcher's leader is whichever
caller arrives first, so successive forwards of one stream start on different OS threads. With
torch's OpenMP intra-op pool every thread that opens a parallel region is the master of its own
team: another caller thread means another team of workers, and the previous team's workers spin
for a while after their region. This times the same one-token forward of the prepared default
target (``--dtype``, the engine the service runs) called

* ``main``: from the main thread, as in process;
* ``one worker``: always from one other thread (a dedicated engine thread);
* ``pool of N``: round robin over N threads (what a gRPC pool does when calls land on new threads),
* ``main + poller``: from the main thread while another Python thread wakes every 0.5 ms (as a
  server's polling threads do), taking the GIL from the forward's Python layer loop,
* ``main + process``: from the main thread while another *process* wakes every 0.5 ms (the
  other services and the orchestrator on the same cores: no GIL shared, only the cores),
* ``main + bursts``: beside another process that computes for 2 ms every 20 ms (~10% of a core,
  in bursts, as the orchestrator and a client handle each streamed token),

alternating the three, and prints the medians and ratios.

Run on a quiet machine::

    python docs/analysis/forward_threads.py --dtype int4 --rounds 15 --pool 8
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from disco.config import ModelConfig
from disco.models.loading import disco_home, load_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--pool", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    args = parser.parse_args()
    loaded = load_model(ModelConfig(dtype=args.dtype), "target", disco_home())
    model = loaded.model
    context = torch.randint(0, 1000, (1, args.context))
    with torch.inference_mode():
        out = model(context, use_cache=True)
    cache = out.past_key_values
    token = torch.tensor([[42]])

    def forward() -> float:
        with torch.inference_mode():
            started = time.perf_counter()
            model(token, past_key_values=cache, use_cache=True)
            elapsed = time.perf_counter() - started
            cache.crop(-1)  # back to the context: every call sees the same cache
        return elapsed

    one = ThreadPoolExecutor(1)
    pool = [ThreadPoolExecutor(1) for _ in range(args.pool)]  # N threads, called in turn
    for _ in range(3):
        forward()
        one.submit(forward).result()
        for thread in pool:
            thread.submit(forward).result()
    times: dict[str, list[float]] = {"main": [], "one worker": [], f"pool of {args.pool}": [], "main + poller": [],
                                     "main + process": [], "main + bursts": []}
    other = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.0005)"])
    other.send_signal(signal.SIGSTOP)  # the other process runs only during its case
    bursts = subprocess.Popen([sys.executable, "-c", "import time\nwhile True:\n    end = time.perf_counter() + 0.002\n"
                               "    while time.perf_counter() < end: pass\n    time.sleep(0.018)"])
    bursts.send_signal(signal.SIGSTOP)

    def with_poller() -> float:
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                time.sleep(0.0005)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            return forward()
        finally:
            stop.set()
            poller.join()

    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, {args.dtype} target, "
          f"context {args.context}, {args.rounds} rounds", flush=True)
    for round_ in range(args.rounds):
        times["main"].append(forward())
        times["one worker"].append(one.submit(forward).result())
        times[f"pool of {args.pool}"].append(pool[round_ % args.pool].submit(forward).result())
        times["main + poller"].append(with_poller())
        other.send_signal(signal.SIGCONT)
        time.sleep(0.05)
        times["main + process"].append(forward())
        other.send_signal(signal.SIGSTOP)
        bursts.send_signal(signal.SIGCONT)
        time.sleep(0.05)
        times["main + bursts"].append(forward())
        bursts.send_signal(signal.SIGSTOP)
        if round_ % 5 == 4:
            print(f"  round {round_ + 1}/{args.rounds}", flush=True)
    other.kill()
    bursts.kill()
    base = statistics.median(times["main"])
    print(f"{'caller':<14} {'median ms':>10} {'vs main':>8}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<14} {median * 1e3:>10.2f} {median / base:>7.3f}x")


if __name__ == "__main__":
    main()
