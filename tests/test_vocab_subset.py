"""A draft LM head over a vocabulary subset (issue 50, item 3): the kept logits are the full
head's, the output is target-only's (greedy, seeded samples, under a grammar that only allows
tokens outside the subset), and the option travels from the command line to the loader."""

from __future__ import annotations

import copy

import pytest
import torch

from disco.config import ModelConfig, SamplingParams, SpeculationConfig
from disco.errors import InvalidRequest, ModelError
from disco.models.int4 import Int4Linear
from disco.models.quantize import Int8Linear
from disco.models.vocab_subset import VocabSubsetHead, frequent_ids, subset_rows, use_vocab_subset
from tests.helpers import EOS_ID, PROMPTS, local_generator
from tests.tiny import VOCAB_SIZE

SUBSET = 128


def _heads() -> dict[str, torch.nn.Module]:
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(VOCAB_SIZE, 64, generator=generator)
    dense = torch.nn.Linear(64, VOCAB_SIZE, bias=False)
    with torch.no_grad():
        dense.weight.copy_(weight)
    return {"float32": dense, "int8": Int8Linear.from_weight(weight), "int4": Int4Linear.from_weight(weight)}


@pytest.mark.parametrize("kind", ["float32", "int8", "int4"])
def test_the_kept_logits_are_the_full_head_s(kind):
    head = _heads()[kind]
    ids = frequent_ids(VOCAB_SIZE, SUBSET, [EOS_ID])
    subset = VocabSubsetHead(subset_rows(head, ids), ids, VOCAB_SIZE)
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    if kind != "float32":
        hidden = hidden.to(torch.bfloat16)
    with torch.inference_mode():
        full, got = head(hidden), subset(hidden)
    others = [token for token in range(VOCAB_SIZE) if token not in set(ids.tolist())]
    assert got.shape == full.shape and torch.isneginf(got[:, others]).all()
    assert torch.equal(got[:, ids], full[:, ids])  # each output channel on its own: the same bits


def test_the_subset_holds_the_special_tokens_then_the_lowest_ids():
    ids = frequent_ids(VOCAB_SIZE, 8, [500, 400]).tolist()
    assert ids == [0, 1, 2, 3, 4, 5, 400, 500]  # the special tokens, then the lowest ids
    with pytest.raises(ValueError, match="1 to 512 tokens"):
        frequent_ids(VOCAB_SIZE, VOCAB_SIZE + 1, [])


@pytest.fixture(scope="module")
def subset_draft(drafts):
    draft = copy.deepcopy(drafts["same"])  # the target itself: every difference is the subset's
    use_vocab_subset(draft, SUBSET, [EOS_ID])
    return draft


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, top_p=0.95, seed=7)], ids=["greedy", "seeded"])
def test_the_output_is_target_only_s(target_model, subset_draft, tokenizer, sampling):
    generator = local_generator(target_model, subset_draft, tokenizer)
    params = SamplingParams(max_new_tokens=32, ignore_eos=True, **sampling)
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        reference = generator.generate(ids, params, SpeculationConfig(policy="none")).token_ids
        result = generator.generate(ids, params, SpeculationConfig(policy="static:4"))
        assert result.token_ids == reference
        assert result.stats.draft_tokens > 0
        outside = sum(token not in range(SUBSET) and token != EOS_ID for token in reference)
        if outside:  # a token the draft cannot propose is a rejection: the draft was not always right
            assert result.stats.accepted_tokens < result.stats.draft_tokens


def test_controls_that_ban_every_token_of_the_subset_end_the_draft_s_blocks(target_model, drafts, tokenizer):
    """A byte-level vocabulary's subset holds the single bytes, so a grammar rarely bans all of it;
    banned words can (each of a small subset's tokens a bad word): then the draft has nothing to
    propose, ends each block before a token, and the target's own tokens are the output."""
    draft = copy.deepcopy(drafts["same"])
    use_vocab_subset(draft, 8, [])  # tokens 0-7
    generator = local_generator(target_model, draft, tokenizer)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, bad_words_token_ids=tuple((i,) for i in range(8)))
    ids = tokenizer(PROMPTS[0])["input_ids"]
    reference = generator.generate(ids, params, SpeculationConfig(policy="none")).token_ids
    result = generator.generate(ids, params, SpeculationConfig(policy="static:4"))
    assert result.token_ids == reference and len(reference) == 12
    assert result.stats.draft_tokens == 0  # every block ended before a token


def test_the_target_takes_no_subset_and_a_negative_size_is_refused(tmp_path, tiny_pair_dirs):
    from disco.models.loading import load_model  # noqa: PLC0415

    with pytest.raises(InvalidRequest, match="vocabulary subset"):
        ModelConfig(vocab_subset=-1).validate()
    folder = str(tiny_pair_dirs["draft"])
    with pytest.raises(ModelError, match="for the draft only"):
        load_model(ModelConfig(spec=folder, dtype="float32", vocab_subset=SUBSET), "target", tmp_path, False)
    loaded = load_model(ModelConfig(spec=folder, dtype="float32", vocab_subset=SUBSET), "draft", tmp_path, False)
    assert isinstance(loaded.model.get_output_embeddings(), VocabSubsetHead)
    assert loaded.fingerprint.endswith(f"-vocab{SUBSET}") and loaded.vocab_size == VOCAB_SIZE


def test_the_flags_reach_the_configs_and_the_launched_draft_server():
    from disco_cli.launcher import _model_args  # noqa: PLC0415
    from disco_cli.main import build_parser  # noqa: PLC0415

    args = build_parser().parse_args(["draft-server", "--vocab-subset", "4096"])
    assert args.vocab_subset == 4096
    args = build_parser().parse_args(["generate", "--prompt", "x", "--draft-vocab", "2048"])
    assert args.draft_vocab == 2048
    assert _model_args(ModelConfig(vocab_subset=2048))[-2:] == ["--vocab-subset", "2048"]
    assert "--vocab-subset" not in _model_args(ModelConfig())
