"""Where a row gets other bits on a GPU: linears by row count, attention by batch, the whole forward.

Run on a CUDA machine from the project's root (no network; random weights of the default
target's architecture, built on the device):

    python docs/analysis/cuda_exactness.py [--out FILE.json] [--dtype bfloat16]

Parts, each printed as it finishes and written to the JSON:

1. ``linears``: for each linear shape of the target (and the LM head), cancelling inputs
   (:func:`disco.models.row_stable.cancelling_inputs`): the call sizes M whose rows differ from
   the same rows multiplied alone (M=1), with torch's default and with
   ``allow_bf16_reduced_precision_reduction = False``.
2. ``linear_ms``: one call at 1 / 64 / 128 rows (CUDA events, median of 50).
3. ``attention``: the packed forward's one-call attention
   (:func:`disco.engines.varlen_attention.one_call_attention`): 16 sessions of 1-21 queries
   over 30-700 keys, alone vs packed, and each block's queries decoded one by one: the
   engine's plan, then sdpa under each backend (``sdpa_kernel``: process-wide flags, fine in
   this one-threaded script, never in the engines).
4. ``model``: the target in ``--dtype`` without row plans, then with the GPU's
   (:func:`disco.models.row_stable.stabilize`: linears and norms; the one-call attention is
   the engine's, :data:`disco.engines.varlen_attention.ONE_CALL_CUDA`): the decoding proof, the packing proof over
   2-16 sessions, the first op whose output differs where it fails (forward hooks), and a
   packed forward's time (1 session x 1 token, 8 sessions x 5 tokens, after 200 keys).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from disco.engines import packing_proof  # noqa: E402
from disco.engines.kv import CachedSequence  # noqa: E402
from disco.engines.batch_layout import packed_layout  # noqa: E402
from disco.engines.varlen_attention import attention_plan, one_call_attention  # noqa: E402
from disco.models import hub_kernels, row_stable  # noqa: E402
from disco.models.architectures import default_pair_architectures  # noqa: E402

ROW_COUNTS = (*range(1, 34), 40, 48, 56, 63, 64, 65, 80, 96, 128, 129, 160, 200, 256)
TARGET_SHAPES = {"q_proj": (1536, 1536, True), "k_proj": (256, 1536, True), "o_proj": (1536, 1536, False),
                 "gate_proj": (8960, 1536, False), "down_proj": (1536, 8960, False),
                 "lm_head": (151936, 1536, False)}


def log(*args) -> None:
    print(*args, flush=True)


def linear_row_counts(dtype: torch.dtype) -> dict:
    """Per shape: the M whose rows differ from the rows alone."""
    result = {}
    for name, (out_features, in_features, bias) in TARGET_SHAPES.items():
        inputs, weight, b = row_stable.cancelling_inputs(max(ROW_COUNTS), out_features, in_features, dtype)
        inputs, weight, b = (t.to(dtype=dtype, device="cuda") for t in (inputs, weight, b))
        b = b if bias else None
        with torch.inference_mode():
            alone = torch.cat([torch.nn.functional.linear(inputs[i:i + 1], weight, b)
                               for i in range(max(ROW_COUNTS))])
            differ = [m for m in ROW_COUNTS
                      if not torch.equal(torch.nn.functional.linear(inputs[:m], weight, b), alone[:m])]
        result[name] = differ
        log(f"  {name} {out_features}x{in_features}: rows differ from M=1 at M = {differ or 'none'}")
    return result


def cuda_ms(fn, repeats: int = 50) -> float:
    samples = []
    for _ in range(repeats + 5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples[5:])


def linear_ms(dtype: torch.dtype) -> dict:
    result = {}
    for name, (out_features, in_features, _) in TARGET_SHAPES.items():
        weight = torch.randn(out_features, in_features, dtype=dtype, device="cuda")
        row = {}
        for m in (1, 64, 128):
            x = torch.randn(m, in_features, dtype=dtype, device="cuda")
            with torch.inference_mode():
                row[m] = round(cuda_ms(lambda: torch.nn.functional.linear(x, weight)), 4)
        plan = row_stable.GPU_PLANS[0]
        x = torch.randn(1, in_features, dtype=dtype, device="cuda")
        with torch.inference_mode():
            row["1 padded"] = round(cuda_ms(lambda: plan.run(x, lambda r: torch.nn.functional.linear(r, weight))), 4)
        result[name] = row
        log(f"  {name}: ms by rows {row}")
    return result


def attention_backends(dtype: torch.dtype) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, sessions = 12, 2, 128, 16
    keys = [int(k) for k in torch.randint(30, 700, (sessions,), generator=generator)]
    queries = [1 + (i * 5) % 21 for i in range(sessions)]
    states = [(torch.randn(1, kv_heads, k, head_dim, generator=generator).to(dtype=dtype, device="cuda"),
               torch.randn(1, kv_heads, k, head_dim, generator=generator).to(dtype=dtype, device="cuda")) for k in keys]
    rows = [torch.randn(1, heads, q, head_dim, generator=generator).to(dtype=dtype, device="cuda") for q in queries]
    engine_plan = attention_plan("cuda")  # the engine's: the memory-efficient kernel, called directly
    sdpa_plan = dataclasses.replace(engine_plan, memory_efficient=False)  # sdpa, under each backend below
    result = {}
    for label, backends in (("engine", None), ("sdpa default", None), ("efficient", [SDPBackend.EFFICIENT_ATTENTION]),
                            ("math", [SDPBackend.MATH]), ("cudnn", [SDPBackend.CUDNN_ATTENTION])):
        plan = engine_plan if label == "engine" else sdpa_plan
        try:
            context = sdpa_kernel(backends) if backends else torch.inference_mode()
            with context, torch.inference_mode():
                def layout_of(key_counts, query_counts):  # keys after the update, the last ones the queries'
                    return packed_layout([n - q for n, q in zip(key_counts, query_counts)], query_counts,
                                         [True] * len(query_counts), kv_heads, heads // kv_heads, plan.key_granule,
                                         "cuda")

                alone = [one_call_attention(q, [k], [v], layout_of([n], [q.shape[2]]), 0.088, plan)
                         for q, (k, v), n in zip(rows, states, keys)]
                layout = layout_of(keys, queries)
                packed = one_call_attention(torch.cat(rows, dim=2), [s[0] for s in states], [s[1] for s in states],
                                            layout, 0.088, plan).split(queries, dim=1)
                # decoding: each query alone over its keys, against the same query inside its block
                decoded_wrong = 0
                for q, (k, v), n, block in zip(rows[:6], states[:6], keys[:6], alone[:6]):
                    width = q.shape[2]
                    for i in range(width):
                        visible = n - width + 1 + i
                        one = one_call_attention(q[:, :, i:i + 1], [k[:, :, :visible]], [v[:, :, :visible]],
                                                 layout_of([visible], [1]), 0.088, plan)
                        decoded_wrong += not torch.equal(one[0, 0], block[0, i])
            wrong = sum(not torch.equal(a, b) for a, b in zip(alone, packed))
            result[label] = {"packed_changed": wrong, "sessions": sessions, "decoded_vs_block_changed": decoded_wrong}
        except RuntimeError as error:
            result[label] = {"error": str(error).splitlines()[0][:200]}
        log(f"  attention {label}: {result[label]}")
    return result


def first_divergence(model: torch.nn.Module, specs: list, members: list[int]) -> dict:
    """Per session of the packed forward ``members``: the first hooked op whose output differs."""
    names, store = [], {}
    hooks = []
    order = ("input_layernorm", "q_proj", "k_proj", "v_proj", "o_proj", "post_attention_layernorm",
             "gate_proj", "up_proj", "down_proj", "norm", "lm_head")  # execution order within a layer
    modules = sorted(((name, module) for name, module in model.named_modules()
                      if name.rsplit(".", 1)[-1] in order),
                     key=lambda item: (int(item[0].split(".")[2]) if item[0].startswith("model.layers.") else 10**6,
                                       order.index(item[0].rsplit(".", 1)[-1])))
    for name, module in modules:
        names.append(name)
        hooks.append(module.register_forward_hook(
            lambda m, inputs, output, name=name: store.setdefault(name, []).append(
                (inputs[0].detach().reshape(-1, inputs[0].shape[-1]).clone(),
                 output.detach().reshape(-1, output.shape[-1]).clone()))))
    try:
        alone = []
        for index in members:
            store.clear()
            sequence = specs[index].build(model)
            CachedSequence.forward_batch([sequence], [specs[index].num_logits], [False])
            alone.append({name: calls[-1] for name, calls in store.items()})
        store.clear()
        batch = [specs[index].build(model) for index in members]
        CachedSequence.forward_batch(batch, [specs[i].num_logits for i in members], [False] * len(members))
        packed = {name: calls[-1] for name, calls in store.items()}
    finally:
        for hook in hooks:
            hook.remove()
    firsts: dict[str, int] = {}
    row, logit_row = 0, 0
    for position, index in enumerate(members):
        rows, logits = len(specs[index].block), specs[index].num_logits
        first = None
        for name in names:
            if name not in alone[position]:
                continue
            span = (logit_row, logit_row + logits) if name.endswith("lm_head") else (row, row + rows)
            for slot, what in ((0, "input"), (1, "output")):
                got = packed[name][slot][span[0]:span[1]]
                if not torch.equal(got, alone[position][name][slot]):
                    first = f"{name} {what}"
                    break
            if first:
                break
        key = (first or "none").split(".", 3)[-1] if first and first.startswith("model.layers.") else (first or "none")
        layer = first.split(".")[2] if first and first.startswith("model.layers.") else "-"
        firsts[f"{key} (layer {layer})"] = firsts.get(f"{key} (layer {layer})", 0) + 1
        row += rows
        logit_row += logits
    return firsts


def forward_ms(model: torch.nn.Module, sessions: int, block: int) -> float:
    from disco.engines.packing_proof import SyntheticSession

    specs = [SyntheticSession(200, tuple(range(1, block + 1)), block, i) for i in range(sessions)]
    bases = [spec.build(model) for spec in specs]

    def run():
        for sequence in bases:
            sequence.truncate(200)
            sequence.tokens.extend(range(1, block + 1))
        CachedSequence.forward_batch(bases, [block] * sessions, [False] * sessions)

    return round(cuda_ms(run, repeats=20), 2)


def model_checks(dtype: torch.dtype) -> dict:
    architecture = default_pair_architectures()["target"]
    started = time.perf_counter()
    with torch.device("cuda"):
        model = architecture.random_model(0, dtype)
    log(f"  random target built on cuda in {time.perf_counter() - started:.1f} s")
    result = {}
    specs = packing_proof.synthetic_sessions(model, 16 + len(packing_proof.GPU_PROOF.prefill_blocks))
    for stage in ("no row plans", "gpu row plans"):
        if stage == "gpu row plans":
            started = time.perf_counter()
            result["stabilize"] = row_stable.stabilize(model)
            result["stabilize_s"] = round(time.perf_counter() - started, 2)
            log(f"  stabilize: {result['stabilize']} ({result['stabilize_s']} s)")
        part = {}
        started = time.perf_counter()
        part["decoding"] = packing_proof.prove_decoding(model).statement
        part["packing"] = packing_proof.prove_packing(model, 16, sizes=range(2, 17)).detail
        part["proofs_s"] = round(time.perf_counter() - started, 2)
        if part["packing"].startswith("one by one"):
            part["first_divergence_16"] = first_divergence(model, specs, list(range(16)))
        part["forward_ms"] = {f"{s}x{b}": forward_ms(model, s, b) for s, b in ((1, 1), (1, 5), (8, 5), (16, 5))}
        result[stage] = part
        log(f"  {stage}: {json.dumps(part, indent=1)}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--parts", default="linears,linear_ms,attention,model")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device: torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    hub_kernels.keep_off()
    dtype = getattr(torch, args.dtype)
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "dtype": args.dtype}
    parts = args.parts.split(",")
    log(f"{report}")
    if "linears" in parts:
        log("linears, default settings:")
        report["linears"] = linear_row_counts(dtype)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        log("linears, reduced-precision reduction off:")
        report["linears_no_reduced_precision"] = linear_row_counts(dtype)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = True
    if "linear_ms" in parts:
        report["linear_ms"] = linear_ms(dtype)
    if "attention" in parts:
        report["attention"] = attention_backends(dtype)
    if "model" in parts:
        report["model"] = model_checks(dtype)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
