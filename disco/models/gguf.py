"""A ``.gguf`` file converted once into a dense bfloat16 HF folder.

Both loaders use this: :mod:`disco.models.loading` for a user's ``.gguf``, :mod:`disco.models.default_pair`
for the default pair. The folder is ``<home>/converted/<stem>-<sha12>/``; a
:data:`SOURCE_FILE` written last marks it complete and names its source.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

from disco.errors import ModelError, first_line
from disco.models import hub_kernels

logger = logging.getLogger(__name__)

CONVERTED_DIR = "converted"
# Written last into a converted folder: marks the conversion complete and names its source.
SOURCE_FILE = "disco_source.json"

_HASH_CHUNK = 8 * 1024 * 1024


def convert_gguf(
    gguf_path: Path, home: Path, sha256: str | None = None, eos_token_ids: Sequence[int] | None = None
) -> Path:
    """Dequantize a ``.gguf`` file once into a dense bfloat16 HF folder and return it.

    The folder is ``<home>/converted/<stem>-<sha12>/``; it is written under a temporary
    name and renamed when complete, so an interrupted conversion is never used.

    Args:
        gguf_path: the ``.gguf`` file.
        home: the disco cache folder.
        sha256: the file's sha256 if already known (saves hashing it again).
        eos_token_ids: if given, written into the generation config (a GGUF keeps only
            one EOS id where the upstream model may list several).

    Raises:
        ModelError: transformers cannot read or convert the file.
    """
    sha256 = sha256 or _cached_gguf_sha256(gguf_path, home)
    folder = converted_folder(home, gguf_path.stem, sha256)
    if (folder / SOURCE_FILE).is_file():
        logger.info("loading cached conversion %s", folder)
        return folder
    start = time.perf_counter()
    logger.info("converting %s to a dense bfloat16 model in %s (once; this takes a few minutes) ...",
                gguf_path, folder)
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent,
            gguf_file=gguf_path.name,
            dtype=torch.bfloat16,
            quantization_config=GgufConfig(dequantize=True),
            **hub_kernels.LOAD_KWARGS,
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        if eos_token_ids:
            model.generation_config.eos_token_id = list(eos_token_ids)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del model
    except Exception as error:  # noqa: BLE001 -- NOTE: the gguf reader raises anything on a bad file
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelError(f"could not convert {gguf_path}: {first_line(error)}") from error
    source = {"gguf_file": gguf_path.name, "gguf_sha256": sha256, "gguf_size": gguf_path.stat().st_size,
              "gguf_path": str(gguf_path.resolve())}
    (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
    for path in tmp.iterdir():  # NOTE: the weights are written 0600; services may run as another user
        path.chmod(0o644)
    if (folder / SOURCE_FILE).is_file():  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - start)
    return folder


def gguf_source(folder: Path, home: Path) -> Path | None:
    """The ``.gguf`` file a converted ``folder`` was made from, if it is still there (same
    size as converted): the path recorded at conversion, else ``<home>/gguf/<file>`` (where
    the default pair keeps its files). ``None`` for a folder that is no conversion."""
    try:
        source = json.loads((folder / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    candidates = [Path(source["gguf_path"])] if source.get("gguf_path") else []
    candidates.append(home / "gguf" / str(source.get("gguf_file", "")))
    for candidate in candidates:
        if candidate.is_file() and candidate.stat().st_size == source.get("gguf_size"):
            return candidate
    return None


def converted_folder(home: Path, stem: str, sha256: str) -> Path:
    """Where :func:`convert_gguf` puts the conversion of a gguf file."""
    return home / CONVERTED_DIR / f"{stem}-{sha256[:12]}"


def file_sha256(path: Path) -> str:
    """sha256 hex of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _cached_gguf_sha256(gguf_path: Path, home: Path) -> str:
    """sha256 of a user's gguf file, remembered per (path, size, mtime) under ``home``."""
    stat = gguf_path.stat()
    key = {"path": str(gguf_path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    marker = home / CONVERTED_DIR / "gguf-hashes" / (hashlib.sha256(key["path"].encode()).hexdigest()[:16] + ".json")
    try:
        cached = json.loads(marker.read_text())
        if {k: cached.get(k) for k in key} == key:
            return cached["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    logger.info("hashing %s ...", gguf_path)
    sha256 = file_sha256(gguf_path)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({**key, "sha256": sha256}) + "\n")
    return sha256
