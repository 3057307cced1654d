"""Regenerate the committed Python modules of the disco.v1 protos.

Usage (from anywhere)::

    python -m protos.generate            # rewrite protos/disco/v1/*_pb2*.py and *.pyi
    python -m protos.generate --out DIR  # write the tree under DIR instead (tests diff it)

protoc runs with the repository root as the only include path, so the generated modules
import each other as ``protos.disco.v1.common_pb2`` with no fix-ups, on Ray workers and
in CI alike. The output depends on the grpcio-tools version (it stamps its version into
the ``*_pb2_grpc.py`` files); regenerate after upgrading it.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos" / "disco" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def proto_files() -> list[Path]:
    """The contract's ``.proto`` files, sorted."""
    return sorted(PROTO_DIR.glob("*.proto"))


def generated_files(root: Path = ROOT) -> list[Path]:
    """The committed generated modules (relative to ``root``), sorted."""
    folder = root / PROTO_DIR.relative_to(ROOT)
    return sorted(path for suffix in GENERATED_SUFFIXES for path in folder.glob(f"*{suffix}"))


def generate(out: Path = ROOT) -> list[Path]:
    """Run protoc on every proto file, writing the modules under ``out``.

    Returns:
        The generated files.

    Raises:
        RuntimeError: protoc reported an error (printed on stderr).
    """
    from grpc_tools import protoc  # NOTE: imported here: only this tool needs grpcio-tools

    well_known = resources.files("grpc_tools") / "_proto"
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"--proto_path={ROOT}",
        f"--proto_path={well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(str(path.relative_to(ROOT)) for path in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed (see the messages above)")
    return generated_files(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m protos.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repository root)")
    args = parser.parse_args(argv)
    for path in generate(args.out.resolve()):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
