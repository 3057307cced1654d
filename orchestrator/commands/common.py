"""Arguments shared by several subcommands, and turning them into config objects."""

from __future__ import annotations

import argparse

from disco.config import ModelConfig, PairConfig


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """``--target/--draft/--dtype/--device``; omitted models mean the default pair."""
    group = parser.add_argument_group("models")
    group.add_argument("--target", default=None,
                       help="target model: HF folder, hub id or .gguf file (default: the prepared default pair)")
    group.add_argument("--draft", default=None,
                       help="draft model: HF folder, hub id or .gguf file (default: the prepared default pair)")
    group.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                       help="weights and compute dtype (default bfloat16; use float32 to check exactness)")
    group.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")


def pair_config_from_args(args: argparse.Namespace) -> PairConfig:
    pair = PairConfig(
        target=ModelConfig(spec=args.target, dtype=args.dtype, device=args.device),
        draft=ModelConfig(spec=args.draft, dtype=args.dtype, device=args.device),
    )
    pair.target.validate()
    pair.draft.validate()
    return pair
