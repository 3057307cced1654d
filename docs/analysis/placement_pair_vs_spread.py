"""Issue 31: `disco up --placement pair` against `--placement spread` on a multi-node Ray
cluster built on this machine (``ray.cluster_utils.Cluster``: a head and two workers of 2
CPUs each), the same model pair, the same requests, one deployment after the other.

On one machine both placements share the same cores and the same loopback, so this shows
what placement costs in orchestration alone (expected: nothing), not what it does on real
nodes (docs/deploy.md, "Which placement").

Usage: python docs/analysis/placement_pair_vs_spread.py TARGET_DIR DRAFT_DIR [--requests 8] [--tokens 48]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from deploy.ray_head import use_loopback, use_token_auth

use_token_auth(generate=True)
use_loopback()  # every node on 127.0.0.1: the backends may then serve without TLS

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from deploy.ray_launcher import UpConfig, down, status, up  # noqa: E402
from orchestrator.client import DiscoClient  # noqa: E402

PROMPTS = ("def fibonacci(n):\n    ", "import os\nimport sys\n\nclass Wrapper(object):", "for item in items:")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 80 * 2**20,
                                                            "node_ip_address": "127.0.0.1"})
    for _ in range(2):
        cluster.add_node(num_cpus=2, object_store_memory=80 * 2**20, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    home = Path(tempfile.mkdtemp(prefix="placement_"))
    rows = []
    try:
        for placement in ("spread", "pair", "spread", "pair"):
            namespace = f"placement-{placement}-{len(rows)}"
            info = up(UpConfig(target=args.target, draft=args.draft, dtype=args.dtype, address=cluster.address,
                               namespace=namespace, port=0, placement=placement), home)
            nodes = {a["name"]: a["node_id"][:8] for a in status(cluster.address, namespace, home)["actors"]}
            walls = []
            with DiscoClient(info["orchestrator"], timeout=300) as client:
                client.generate(PROMPTS[0], policy="static:3", max_new_tokens=8, ignore_eos=True)  # warm-up
                for index in range(args.requests):
                    started = time.perf_counter()
                    client.generate(PROMPTS[index % len(PROMPTS)], policy="static:3", max_new_tokens=args.tokens,
                                    ignore_eos=True)
                    walls.append(time.perf_counter() - started)
            rows.append({"placement": placement, "strategy": info["placement"], "nodes": nodes,
                         "tokens_per_s": round(args.tokens / statistics.median(walls), 1),
                         "median_request_s": round(statistics.median(walls), 4)})
            print(json.dumps(rows[-1]), flush=True)
            down(cluster.address, namespace, home)
    finally:
        ray.shutdown()
        cluster.shutdown()
    for placement in ("spread", "pair"):
        rates = [row["tokens_per_s"] for row in rows if row["placement"] == placement]
        print(f"{placement}: {rates} tok/s")


if __name__ == "__main__":
    main()
