"""What a paged KV pool would cost a CPU forward (issue 49 item 3's design question): per layer
the keys and values of one session gathered from a pool of fixed-size blocks into the contiguous
``[1, kv_heads, length, head_dim]`` the attention kernels take, against reading them in place
from a per-session buffer (today's packed path). The default target's shape (28 layers, 2 KV
heads of 128, bf16), blocks of 16 positions scattered over a pool; prints ms per forward (all
layers, keys and values), min of 20 repeats, for one session and for 8 sessions' gathers.

    python docs/analysis/paged_gather.py [--threads 2]
"""
import argparse
import time

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--threads", type=int, default=2)
args = parser.parse_args()
torch.set_num_threads(args.threads)
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 28, 2, 128, 16
generator = torch.Generator().manual_seed(0)
for length in (256, 1024, 4096):
    blocks = length // BLOCK
    for sessions in (1, 8):
        pool_blocks = blocks * sessions * 2  # the pool holds twice what these sessions use
        pool = [torch.randn(pool_blocks, KV_HEADS, BLOCK, HEAD_DIM, generator=generator).to(torch.bfloat16)
                for _ in range(2)]
        tables = [torch.randperm(pool_blocks, generator=generator)[:blocks] for _ in range(sessions)]
        best = float("inf")
        for _ in range(20):
            started = time.perf_counter()
            for _layer in range(LAYERS):
                for buffer in pool:
                    for table in tables:
                        # [blocks, kv, 16, dim] -> [1, kv, blocks * 16, dim], contiguous
                        buffer.index_select(0, table).transpose(0, 1).reshape(1, KV_HEADS, length, HEAD_DIM)
            best = min(best, time.perf_counter() - started)
        print(f"context {length:5d}, {sessions} session(s): gather {best * 1e3:7.2f} ms per forward "
              f"({LAYERS} layers, keys and values; {2 * LAYERS * sessions * length * KV_HEADS * HEAD_DIM * 2 / 2**20:.0f} MiB)",
              flush=True)
