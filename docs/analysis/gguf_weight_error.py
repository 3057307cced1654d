"""Issue 28, item 1: what each way of loading a GGUF tensor into an engine costs in weight error.

For a sample of the default pair's linears (layers 0, middle, last, and the LM head), the
reference is the GGUF's own float32 dequantization (``gguf.quants.dequantize``, what
llama.cpp multiplies by). Against it, relative Frobenius error ``||W - W_ref|| / ||W_ref||`` of:

* ``bf16 dense``: the converted bf16 folder (the dense engine);
* ``int4 native``: a Q4_K tensor's own ``q`` with ``d*sc`` / ``8*d*sc - dmin*m`` rounded to bf16
  (:mod:`disco.models.gguf_blocks`, the int4 engine since v2);
* ``int4 g64 (v1)``: the bf16 dense weight re-quantized min/max per group of 64 (the int4
  engine before);
* ``int4 g32 requant``: the same at groups of 32 (v2, for tensors that are not Q4_K);
* ``int8``: symmetric per output channel (the int8 engine).

Usage: python docs/analysis/gguf_weight_error.py [--json-out FILE]
"""

from __future__ import annotations

import argparse
import collections
import json

import gguf
import numpy as np
import torch

from disco.models.default_pair import default_model, ensure_gguf
from disco.models.gguf_blocks import q4_k_groups
from disco.models.int4 import quantize_weight_int4
from disco.models.loading import disco_home
from disco.models.quantize import quantize_weight


def relative_error(weight: torch.Tensor, reference: torch.Tensor) -> float:
    return float((weight - reference).norm() / reference.norm())


def int4_dequantized(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    out_features, in_features = q.shape
    grouped = q.float().view(out_features, -1, group) - 8
    return (grouped * scales.float()[..., None] + zeros.float()[..., None]).view(out_features, in_features)


def variants(tensor, reference: torch.Tensor) -> dict[str, float]:
    dense = reference.to(torch.bfloat16)
    errors = {"bf16 dense": relative_error(dense.float(), reference)}
    if tensor.tensor_type == gguf.GGMLQuantizationType.Q4_K:
        groups = q4_k_groups(np.asarray(tensor.data), *reference.shape)
        errors["int4 native"] = relative_error(
            int4_dequantized(groups.q, groups.scales.to(torch.bfloat16), groups.zeros.to(torch.bfloat16), 32), reference)
    for group, label in ((64, "int4 g64 (v1)"), (32, "int4 g32 requant")):
        errors[label] = relative_error(int4_dequantized(*quantize_weight_int4(dense, group), group), reference)
    q, scales = quantize_weight(dense)
    errors["int8"] = relative_error(q.float() * scales.float()[:, None], reference)
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json-out")
    args = parser.parse_args()
    rows = []
    for role in ("target", "draft"):
        path = ensure_gguf(default_model(role), disco_home())
        reader = gguf.GGUFReader(str(path))
        blocks = 1 + max(int(t.name.split(".")[1]) for t in reader.tensors if t.name.startswith("blk."))
        wanted = {f"blk.{layer}." for layer in (0, blocks // 2, blocks - 1)}
        for tensor in reader.tensors:
            if tensor.name != "output.weight" and not (tensor.name[:tensor.name.index(".", 4) + 1] in wanted
                                                      and tensor.name.endswith(".weight") and "norm" not in tensor.name):
                continue
            reference = torch.from_numpy(gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)).float()
            rows.append({"role": role, "tensor": tensor.name, "type": tensor.tensor_type.name,
                         **variants(tensor, reference)})
            print(f"{role} {tensor.name} {tensor.tensor_type.name}", flush=True)
    table = collections.defaultdict(list)
    for row in rows:
        table[(row["role"], row["type"])].append(row)
    columns = ["bf16 dense", "int4 native", "int4 g64 (v1)", "int4 g32 requant", "int8"]
    print("\n| model | GGUF type | tensors | " + " | ".join(columns) + " |")
    print("|---|---|---:|" + "---:|" * len(columns))
    for (role, kind), group in sorted(table.items()):
        cells = [f"{np.mean([r[c] for r in group]):.4f}" if c in group[0] else "-" for c in columns]
        print(f"| {role} | {kind} | {len(group)} | " + " | ".join(cells) + " |")
    if args.json_out:
        with open(args.json_out, "w") as out:
            json.dump({"rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
