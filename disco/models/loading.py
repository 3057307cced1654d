"""Model loading: a local HF folder, a ``.gguf`` file, a hub id, or the default pair.

Every model ends up as a :class:`LoadedModel`: the HF causal LM (eval mode, on its
device, in the requested dtype), its tokenizer, and the identities the services compare
(weights ``fingerprint``, ``tokenizer_hash``).

A ``.gguf`` file is dequantized and converted **once** into a dense bfloat16 HF folder
under ``<home>/converted/<stem>-<sha12>/`` (:mod:`disco.models.gguf`); later loads read
that folder (seconds instead of about a minute) and cast it to the requested dtype. The
default pair comes from :mod:`disco.models.default_pair`.

``dtype="int8"`` is the int8 weight-only engine (:mod:`disco.models.quantize`): the dense model is
quantized once and cached under ``<home>/quantized/<name>-<fingerprint>-<format>/``; later
loads read only that cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from disco.config import ModelConfig, PairConfig
from disco.errors import ModelError, VocabularyMismatch, first_line
from disco.models import hub_kernels, quantize, row_stable
from disco.models.default_pair import ROLES, default_model, ensure_default_model
from disco.models.gguf import SOURCE_FILE, convert_gguf, gguf_source
from disco.models.gguf_blocks import checked_native_weights
from disco.models.int4 import use_chosen_kernel
from disco.models.vocab_subset import use_vocab_subset
from disco.models.weight_only import choose_dense_dtype, choose_prefill_path, prefill_path

logger = logging.getLogger(__name__)

QUANTIZED_DIR = "quantized"

# Torch dtype each engine loads the dense weights in (int8: its compute dtype, then quantized).
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "int8": quantize.COMPUTE_DTYPE, "int4": quantize.COMPUTE_DTYPE}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
_FINGERPRINT_CHARS = 16
_SAMPLES_PER_FILE = 16
_SAMPLE_BYTES = 64 * 1024


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A model ready to run, with the identities the services compare.

    Attributes:
        model: HF causal LM in eval mode, on the requested device and dtype.
        tokenizer: its tokenizer.
        name: display name (default-pair model name, folder or file stem, or hub id).
        fingerprint: short sha256 hex identifying the weights; the same weights loaded
            twice (in any dtype) give the same fingerprint.
        tokenizer_hash: sha256 hex over the vocabulary and special tokens; equal
            tokenizers give equal hashes.
        vocab_size: number of logits the model produces (output embedding rows).
        eos_token_ids: every token id that ends generation, deduplicated.
        engine: the concrete engine the model runs as: ``"float32"``, ``"bfloat16"``,
            ``"float16"``, ``"int8"`` or ``"int4"`` (weight-only, bfloat16 activations); empty
            when built outside :func:`load_model` (then the weights' dtype tells).
        kernel: the kernel of the int4 engine's decoded rows on this machine
            (:func:`disco.models.q4q8.choose_kernel`: a build of :data:`disco.models.q4q8.KERNELS`,
            e.g. ``"q4q8-amx"``, or ``"int4pack"``); empty
            for the other engines.
        prefill: how the weight-only engines multiply prefill blocks on this machine
            (:func:`disco.models.weight_only.prefill_path`: ``"kernel"``, ``"bfloat16 GEMM"`` or
            ``"float32 GEMM"``); empty for the other engines.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    fingerprint: str
    tokenizer_hash: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    engine: str = ""
    kernel: str = ""
    prefill: str = ""


def disco_home() -> Path:
    """The cache folder for models and artifacts: ``$DISCO_HOME`` or ``~/.cache/disco``.

    Call this at entry points only and pass the result down.
    """
    env = os.environ.get("DISCO_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "disco"


def load_model(config: ModelConfig, role: str, home: Path, progress: bool = True) -> LoadedModel:
    """Load one model as ``config`` describes.

    Args:
        config: ``spec`` is a local HF folder, a ``.gguf`` file, a hub id, or ``None``
            for the default model of ``role``; ``dtype`` (concrete: ``"auto"`` is resolved
            at the entry point, see :func:`disco.platform.resolve_dtype`) and ``device``
            say how it runs.
        role: ``"target"`` or ``"draft"`` (picks the default model; used in log lines).
        home: the disco cache folder (see :func:`disco_home`).
        progress: show progress bars while preparing a default model.

    Returns:
        The loaded model.

    Raises:
        ModelError: the model cannot be found, fetched, converted or loaded.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    config.validate()
    for what, value in (("a vocabulary subset", config.vocab_subset), ("a prefill window", config.prefill_window)):
        if value and role != "draft":  # refused before the weights load
            raise ModelError(f"{what} is for the draft only, not the {role}")
    hub_kernels.keep_off()  # before any from_pretrained (entry points set it too)
    start = time.perf_counter()
    location, name, is_hub = resolve_location(config.spec, role, home, progress)
    logger.info("loading %s model %s from %s (%s, %s) ...", role, name, location, config.dtype, config.device)
    if config.dtype in quantize.QUANT_FORMATS:
        model, tokenizer, fingerprint = _load_quantized(location, name, is_hub, home, config.dtype)
    else:
        model, tokenizer = _load_hf(location, _DTYPES[config.dtype], is_hub, config.device)
        fingerprint = _hub_fingerprint(location, model) if is_hub else folder_fingerprint(Path(location))
    try:
        model.to(config.device)  # a no-op where the weights were loaded onto the device (dense, not CPU)
    except (RuntimeError, AssertionError) as error:
        raise ModelError(f"could not move {role} model {name} to {config.device}: {first_line(error)}") from error
    model.eval()
    hub_kernels.check_model(model, name)
    if config.vocab_subset:  # before the kernel and the row plans: the new head gets them too
        special = [*_eos_token_ids(model, tokenizer), *tokenizer.all_special_ids]
        try:
            logger.info("%s model %s: %s", role, name, use_vocab_subset(model, config.vocab_subset, special))
        except ValueError as error:
            raise ModelError(f"{role} model {name}: {error}") from error
        fingerprint = f"{fingerprint}-vocab{config.vocab_subset}"  # its costs are another model's
    kernel = ""
    if config.dtype == "int4" and config.device == "cpu":  # before the row plans: they probe the kernel
        if (choice := use_chosen_kernel(model, home)) is not None:
            logger.info("%s model %s: %s", role, name, choice.reason)
            kernel = choice.kernel
    if config.dtype != "float32":  # the probe runs on the model's device (CUDA: one call shape)
        logger.info("%s model %s: %s", role, name, row_stable.stabilize(model))
    if config.dtype in quantize.QUANT_FORMATS and config.device == "cpu":
        logger.info("%s model %s: %s", role, name, choose_dense_dtype(model))
        if (line := choose_prefill_path(model)) is not None:  # after the row plans: the kernel runs in them
            logger.info("%s model %s: %s", role, name, line)
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        fingerprint=fingerprint,
        tokenizer_hash=tokenizer_hash(tokenizer),
        vocab_size=_vocab_size(model),
        eos_token_ids=_eos_token_ids(model, tokenizer),
        engine=config.dtype,
        kernel=kernel,
        prefill=prefill_path(model),
    )
    logger.info(
        "loaded %s model %s in %.1f s (vocab %d, eos %s, fingerprint %s)",
        role, name, time.perf_counter() - start, loaded.vocab_size, list(loaded.eos_token_ids),
        loaded.fingerprint,
    )
    return loaded


def load_pair(pair: PairConfig, home: Path, progress: bool = True) -> tuple[LoadedModel, LoadedModel]:
    """Load the target and the draft model and check they share one vocabulary.

    Returns:
        ``(target, draft)``.

    Raises:
        ModelError: a model cannot be loaded.
        VocabularyMismatch: the two tokenizers differ.
    """
    target = load_model(pair.target, "target", home, progress)
    draft = load_model(pair.draft, "draft", home, progress)
    check_same_vocabulary(target, draft)
    return target, draft


def model_fingerprint(config: ModelConfig, role: str, home: Path) -> str | None:
    """The fingerprint :func:`load_model` would report, without loading the weights
    (``None`` for a hub id without a local snapshot). Prepares a default model if needed."""
    location, _, is_hub = resolve_location(config.spec, role, home, progress=False)
    return _hub_fingerprint(location, None) if is_hub else folder_fingerprint(Path(location))


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose tokenizer differs from the target's.

    Different embedding sizes with the same tokenizer are fine (Qwen pads its
    embeddings to a multiple of 128, and sizes differ between family members).

    Raises:
        VocabularyMismatch: the tokenizer hashes differ.
    """
    if target.tokenizer_hash != draft.tokenizer_hash:
        raise VocabularyMismatch(
            f"draft model {draft.name!r} does not share the tokenizer of target model {target.name!r}: "
            f"target has {len(target.tokenizer)} tokens / {target.vocab_size} logits "
            f"(tokenizer hash {target.tokenizer_hash[:12]}), draft has {len(draft.tokenizer)} tokens / "
            f"{draft.vocab_size} logits (tokenizer hash {draft.tokenizer_hash[:12]}); "
            "speculative decoding needs both models to use the same vocabulary"
        )
    if target.vocab_size != draft.vocab_size:
        logger.info(
            "target and draft share a tokenizer but have %d and %d logits; the extra rows are padding",
            target.vocab_size, draft.vocab_size,
        )


def folder_fingerprint(folder: Path) -> str:
    """Short sha256 hex identifying the weights in an HF folder.

    A converted gguf is identified by the gguf's sha256. Otherwise the hash covers
    ``config.json`` and, per weight file, its name, size and evenly spaced samples of
    its bytes (which include the safetensors header).

    NOTE: sampling instead of hashing every byte keeps this at ~1 MiB read per file;
    any real change of the weights (a fine-tune, added noise) changes the samples.
    """
    source = folder / SOURCE_FILE
    if source.is_file():
        sha = json.loads(source.read_text())["gguf_sha256"]
        return hashlib.sha256(f"gguf:{sha}".encode()).hexdigest()[:_FINGERPRINT_CHARS]
    digest = hashlib.sha256()
    config = folder / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    weights = sorted(p for p in folder.iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file())
    for path in weights:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        digest.update(_sample_bytes(path, size))
    return digest.hexdigest()[:_FINGERPRINT_CHARS]


def tokenizer_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 hex over the sorted vocabulary (token, id) and the special tokens."""
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": sorted(tokenizer.all_special_tokens),
    }
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode()).hexdigest()


def resolve_location(spec: str | None, role: str, home: Path, progress: bool) -> tuple[str, str, bool]:
    """Turn a spec into ``(location, display name, is_hub_id)``; prepares files if needed."""
    if spec is None:
        folder = ensure_default_model(role, home, progress)
        return str(folder), default_model(role).display_name, False
    path = Path(spec).expanduser()
    if path.is_dir():
        return str(path), path.resolve().name, False
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelError(f"model path {spec} is a file but not a .gguf file; pass a folder, a .gguf or a hub id")
        return str(convert_gguf(path, home)), path.stem, False
    if _looks_like_path(spec):
        raise ModelError(f"model path {spec} does not exist")
    return spec, spec, True


def _looks_like_path(spec: str) -> bool:
    return ("/" in spec and spec.startswith((".", "/", "~"))) or spec.endswith(".gguf")


def _load_hf(location: str, dtype: torch.dtype, is_hub: bool, device: str = "cpu"
             ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A dense HF model, its weights loaded straight onto ``device``: transformers builds the
    skeleton without allocating it and copies each tensor from the checkpoint to the device
    (``device_map``), so a GPU model is never materialised in host memory first. On a CPU the
    call is the plain one (no ``device_map``: nothing to move, and the same code path as ever)."""
    placement = {} if torch.device(device).type == "cpu" else {"device_map": device}
    try:
        model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, **placement, **hub_kernels.LOAD_KWARGS)
        tokenizer = AutoTokenizer.from_pretrained(location)
    except Exception as error:  # noqa: BLE001 -- NOTE: loaders raise anything (hub, json, safetensors)
        if is_hub:
            raise ModelError(
                f"model {location!r} not found: not a local folder, not a .gguf file, "
                f"and the hub could not provide it ({first_line(error)})"
            ) from error
        raise ModelError(f"could not load model from {location}: {first_line(error)}") from error
    return model, tokenizer


def _hub_fingerprint(spec: str, model: PreTrainedModel | None) -> str | None:
    """Fingerprint of a hub model: of its resolved local snapshot when there is one (else
    of its config; ``None`` without a snapshot or a model)."""
    from transformers.utils import cached_file

    try:
        config_file = cached_file(spec, "config.json")
    except Exception:  # noqa: BLE001 -- no snapshot: fall back to the config
        config_file = None
    if config_file:
        return folder_fingerprint(Path(config_file).parent)
    if model is None:
        return None
    text = f"hub:{spec}:{model.config.to_json_string()}"
    return hashlib.sha256(text.encode()).hexdigest()[:_FINGERPRINT_CHARS]


def quantized_folder(home: Path, name: str, fingerprint: str, lm_head: bool = quantize.QUANTIZE_LM_HEAD,
                     engine: str = "int8") -> Path:
    """Where the ``engine`` (int8 or int4) build of the weights ``fingerprint`` is cached."""
    slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64]
    suffix = "" if lm_head else "-densehead"
    return home / QUANTIZED_DIR / f"{slug}-{fingerprint}-{quantize.QUANT_FORMATS[engine]}{suffix}"


def _load_quantized(location: str, name: str, is_hub: bool, home: Path,
                    engine: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """The int8/int4 engine of a model: from the cache when there is one, else quantized
    from the dense weights (and cached). Returns ``(model, tokenizer, fingerprint)``."""
    fingerprint = _hub_fingerprint(location, None) if is_hub else folder_fingerprint(Path(location))
    if fingerprint is not None:
        folder = quantized_folder(home, name, fingerprint, engine=engine)
        if quantize.read_manifest(folder) is not None:
            try:
                return _load_quantized_cached(location, folder, engine), _load_tokenizer(location), fingerprint
            except Exception as error:  # noqa: BLE001 -- NOTE: a damaged file raises anything; quantize again
                logger.warning("discarding the quantized cache %s: %s", folder, first_line(error))
                shutil.rmtree(folder, ignore_errors=True)
    start = time.perf_counter()
    model, tokenizer = _load_hf(location, _DTYPES[engine], is_hub)
    fingerprint = fingerprint or _hub_fingerprint(location, model)
    logger.info("quantizing %s to %s weight-only (once; cached in %s) ...", name, engine, home / QUANTIZED_DIR)
    native, report = {}, {}
    gguf_path = None if is_hub or engine != "int4" else gguf_source(Path(location), home)
    if gguf_path is not None:
        native, report = checked_native_weights(gguf_path, model)
        logger.info("%s: %d linears keep the GGUF's own Q4_K weights, re-quantized: %s",
                    name, report["native_int4"], report["requantized"])
    quantize.quantize_model(model, engine=engine, native=native)
    folder = quantized_folder(home, name, fingerprint, engine=engine)
    manifest = {"source": location, "fingerprint": fingerprint, "lm_head": quantize.QUANTIZE_LM_HEAD,
                "torch": torch.__version__, **({"gguf": report} if report else {})}
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        quantize.save_quantized(model, folder, manifest, engine)
    except OSError as error:  # NOTE: a read-only cache only costs the next load a re-quantization
        logger.warning("could not cache the quantized model in %s: %s", folder, error)
    logger.info("quantized %s in %.1f s", name, time.perf_counter() - start)
    return model, tokenizer, fingerprint


def _load_quantized_cached(location: str, folder: Path, engine: str) -> PreTrainedModel:
    """Build the model skeleton on the meta device and fill it from the quantized cache."""
    config = AutoConfig.from_pretrained(location)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=quantize.COMPUTE_DTYPE)
    quantize.quantized_skeleton(skeleton, engine=engine)
    model = quantize.load_quantized(skeleton, folder)
    try:
        model.generation_config = GenerationConfig.from_pretrained(location)
    except (OSError, ValueError):  # no generation_config.json: the one derived from the config stays
        pass
    logger.info("loaded the quantized model from %s", folder)
    return model


def _load_tokenizer(location: str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(location)
    except Exception as error:  # noqa: BLE001 -- NOTE: loaders raise anything (hub, json)
        raise ModelError(f"could not load the tokenizer of {location}: {first_line(error)}") from error


def _sample_bytes(path: Path, size: int) -> bytes:
    if size <= _SAMPLES_PER_FILE * _SAMPLE_BYTES:
        return path.read_bytes()
    step = (size - _SAMPLE_BYTES) // (_SAMPLES_PER_FILE - 1)
    chunks = []
    with path.open("rb") as f:
        for i in range(_SAMPLES_PER_FILE):
            f.seek(i * step)
            chunks.append(f.read(_SAMPLE_BYTES))
    return b"".join(chunks)


def _vocab_size(model: PreTrainedModel) -> int:
    embeddings = model.get_output_embeddings()
    if embeddings is not None and getattr(embeddings, "weight", None) is not None:
        return int(embeddings.weight.shape[0])
    return int(model.config.get_text_config().vocab_size)


def _eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    candidates: list[int] = []
    generation_config = getattr(model, "generation_config", None)
    configured = getattr(generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        candidates.append(configured)
    elif configured is not None:
        candidates.extend(int(i) for i in configured)
    if tokenizer.eos_token_id is not None:
        candidates.append(int(tokenizer.eos_token_id))
    return tuple(dict.fromkeys(candidates))

