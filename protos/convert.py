"""Conversions between disco.v1 messages and the core's dataclasses and tensors.

Servicers and clients only call these, so each message shape is translated in exactly
one place (request statistics live in the torch-free :mod:`protos.stats`). Decoders of
untrusted input raise :class:`~disco.errors.InvalidRequest` naming the offending field.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import torch

import disco
from disco.config import MAX_LOOKAHEAD_LIMIT, SamplingParams, StructuredOutput
from disco.engines.sessions import SessionLimits
from disco.errors import InvalidRequest
from disco.interfaces import (DraftEvent, DraftSummary, DraftToken, Feedback, PrefillResult, TokenLogprobs,
                              VerifyResult)
from disco.models.loading import LoadedModel
from protos.disco.v1 import common_pb2, draft_pb2, target_pb2

#: Refuse distributions larger than any real vocabulary (protects the receiver's memory).
MAX_VOCAB_SIZE = 1 << 22
_DEFAULT_SAMPLING = SamplingParams()


def check_prompt_length(num_tokens: int, max_prompt_tokens: int | None, where: str = "") -> None:
    """Refuse a prompt longer than ``max_prompt_tokens`` (``None`` or 0: no limit).

    Raises:
        InvalidRequest: naming the limit and the flag that sets it.
    """
    if max_prompt_tokens and num_tokens > max_prompt_tokens:
        raise InvalidRequest(f"prompt has {num_tokens} tokens, more than the limit of {max_prompt_tokens}"
                             f"{' of ' + where if where else ''} (--max-prompt-tokens)")


def check_token_ids(token_ids: Sequence[int], vocab_size: int, field: str) -> None:
    """Refuse token ids outside the model's vocabulary ``[0, vocab_size)``.

    Raises:
        InvalidRequest: naming ``field``.
    """
    if any(not 0 <= token < vocab_size for token in token_ids):
        raise InvalidRequest(f"{field}: token ids must be in [0, {vocab_size})")


def elapsed_ns(started_ns: int) -> int:
    """Nanoseconds since ``started_ns`` (a :func:`time.perf_counter_ns` reading)."""
    return time.perf_counter_ns() - started_ns


def sampling_to_pb(sampling: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
        top_k=sampling.top_k, seed=sampling.seed, stop=list(sampling.stop), ignore_eos=sampling.ignore_eos,
        logprobs=sampling.logprobs, prompt_logprobs=sampling.prompt_logprobs,
        **_controls_to_pb(sampling))


def _controls_to_pb(sampling: SamplingParams) -> dict:
    """The sampling controls' fields of a ``SamplingParams`` message (defaults left out)."""
    return dict(
        stop_token_ids=list(sampling.stop_token_ids), min_tokens=sampling.min_tokens,
        include_stop_str_in_output=sampling.include_stop_str_in_output,
        repetition_penalty=None if sampling.repetition_penalty == 1.0 else sampling.repetition_penalty,
        presence_penalty=sampling.presence_penalty, frequency_penalty=sampling.frequency_penalty,
        logit_bias=dict(sampling.logit_bias), min_p=sampling.min_p, bad_words=list(sampling.bad_words),
        bad_words_token_ids=[common_pb2.TokenSequence(token_ids=list(ids)) for ids in sampling.bad_words_token_ids],
        eos_token_ids=list(sampling.eos_token_ids), resumed_tokens=sampling.resumed_tokens,
        structured=None if sampling.structured is None else common_pb2.StructuredOutput(
            kind=sampling.structured.kind, spec=sampling.structured.spec))


def sampling_from_pb(message: common_pb2.SamplingParams) -> SamplingParams:
    """Absent optional fields take the core defaults; values are validated later, by the
    engines and the loop, with messages naming the field."""
    return SamplingParams(
        max_new_tokens=message.max_new_tokens if message.HasField("max_new_tokens")
        else _DEFAULT_SAMPLING.max_new_tokens,
        temperature=message.temperature,
        top_p=message.top_p if message.HasField("top_p") else _DEFAULT_SAMPLING.top_p,
        top_k=message.top_k,
        seed=message.seed if message.HasField("seed") else None,
        stop=tuple(message.stop),
        ignore_eos=message.ignore_eos,
        logprobs=message.logprobs if message.HasField("logprobs") else None,
        prompt_logprobs=message.prompt_logprobs if message.HasField("prompt_logprobs") else None,
        stop_token_ids=tuple(message.stop_token_ids),
        min_tokens=message.min_tokens,
        include_stop_str_in_output=message.include_stop_str_in_output,
        repetition_penalty=message.repetition_penalty if message.HasField("repetition_penalty")
        else _DEFAULT_SAMPLING.repetition_penalty,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        logit_bias=tuple(sorted(message.logit_bias.items())),
        min_p=message.min_p,
        bad_words=tuple(message.bad_words),
        bad_words_token_ids=tuple(tuple(sequence.token_ids) for sequence in message.bad_words_token_ids),
        eos_token_ids=tuple(message.eos_token_ids),
        resumed_tokens=message.resumed_tokens,
        structured=StructuredOutput(kind=message.structured.kind, spec=message.structured.spec)
        if message.HasField("structured") else None,
    )


def distribution_to_pb(probs: torch.Tensor) -> common_pb2.Distribution:  # probs: [vocab]
    """Encode exactly (float32), sparse when fewer than half the entries are nonzero."""
    values = probs.detach().to("cpu", torch.float32).contiguous().numpy()
    ids = np.flatnonzero(values)
    if 2 * len(ids) < len(values):
        sparse = common_pb2.SparseDistribution(ids_u32=ids.astype("<u4").tobytes(),
                                               probs_f32=values[ids].astype("<f4").tobytes())
        return common_pb2.Distribution(vocab_size=len(values), sparse=sparse)
    return common_pb2.Distribution(vocab_size=len(values), dense_f32=values.astype("<f4").tobytes())


def distribution_from_pb(message: common_pb2.Distribution, field: str = "draft_probs") -> torch.Tensor:
    """Decode one distribution to a float32 tensor ``[vocab_size]``.

    Raises:
        InvalidRequest: malformed encoding, out-of-range ids, negative or non-finite values.
    """
    vocab = message.vocab_size
    if not 0 < vocab <= MAX_VOCAB_SIZE:
        raise InvalidRequest(f"{field}: vocab_size must be in [1, {MAX_VOCAB_SIZE}], got {vocab}")
    encoding = message.WhichOneof("encoding")
    if encoding == "dense_f32":
        if len(message.dense_f32) != 4 * vocab:
            raise InvalidRequest(f"{field}: dense_f32 has {len(message.dense_f32)} bytes, expected 4 * {vocab}")
        values = np.frombuffer(message.dense_f32, dtype="<f4").astype(np.float32)
    elif encoding == "sparse":
        ids_bytes, probs_bytes = message.sparse.ids_u32, message.sparse.probs_f32
        if len(ids_bytes) != len(probs_bytes) or len(ids_bytes) % 4:
            raise InvalidRequest(f"{field}: sparse ids_u32 and probs_f32 must hold as many 4-byte values")
        ids = np.frombuffer(ids_bytes, dtype="<u4")
        if len(ids) and int(ids.max()) >= vocab:
            raise InvalidRequest(f"{field}: sparse token id {int(ids.max())} is outside [0, {vocab})")
        values = np.zeros(vocab, dtype=np.float32)
        values[ids] = np.frombuffer(probs_bytes, dtype="<f4")
    else:
        raise InvalidRequest(f"{field}: no values (set dense_f32 or sparse)")
    if not np.isfinite(values).all() or (values < 0).any():
        raise InvalidRequest(f"{field}: probabilities must be finite and >= 0")
    return torch.from_numpy(values)


def distributions_from_pb(messages: Sequence[common_pb2.Distribution], device: torch.device | str = "cpu", *,
                          num_tokens: int | None = None, vocab_size: int | None = None,
                          max_rows: int = MAX_LOOKAHEAD_LIMIT) -> torch.Tensor | None:
    """Decode a block's distributions to ``[k, vocab]`` on ``device`` (``None`` if empty).

    Every budget is checked before anything is allocated: the count (``num_tokens``, one per
    draft token, and at most ``max_rows``, the lookahead cap) and each ``vocab_size`` (the
    model's, when given), so a small message cannot make the server expand large tensors.

    Raises:
        InvalidRequest: a count or a vocab_size that does not match, or a malformed distribution.
    """
    if not messages:
        return None
    if len(messages) > max_rows:
        raise InvalidRequest(f"draft_probs: {len(messages)} distributions, at most {max_rows} (the lookahead cap)")
    if num_tokens is not None and len(messages) != num_tokens:
        raise InvalidRequest(f"draft_probs: {len(messages)} distributions for {num_tokens} draft tokens "
                             "(one per draft token, or none under greedy decoding)")
    expected = vocab_size if vocab_size is not None else messages[0].vocab_size
    for i, message in enumerate(messages):
        if message.vocab_size != expected:
            raise InvalidRequest(f"draft_probs[{i}]: vocab_size {message.vocab_size}, expected {expected}"
                                 + (" (the model's)" if vocab_size is not None else " (as draft_probs[0])"))
    rows = [distribution_from_pb(message, f"draft_probs[{i}]") for i, message in enumerate(messages)]
    return torch.stack(rows).to(device)


def expected_length(request: draft_pb2.DraftRequest | target_pb2.VerifyRequest) -> int:
    """The required ``expected_length`` of a Draft or Verify request.

    Raises:
        InvalidRequest: it is absent or negative.
    """
    if not request.HasField("expected_length"):
        raise InvalidRequest("expected_length is required (the session's committed length: prompt + every "
                             "accepted and bonus token)")
    if request.expected_length < 0:
        raise InvalidRequest(f"expected_length must be >= 0, got {request.expected_length}")
    return request.expected_length


def feedback_to_pb(feedback: Feedback) -> common_pb2.Feedback:
    return common_pb2.Feedback(num_accepted=feedback.num_accepted, bonus_token_id=feedback.next_token_id)


def feedback_from_pb(message: common_pb2.Feedback) -> Feedback:
    return Feedback(num_accepted=message.num_accepted, next_token_id=message.bonus_token_id)


def prefill_to_pb(result: PrefillResult) -> common_pb2.StartSessionResponse:
    return common_pb2.StartSessionResponse(prompt_tokens=result.prompt_tokens, elapsed_ns=result.elapsed_ns,
                                           prompt_logprobs=token_logprobs_to_pb(result.prompt_logprobs))


def prefill_from_pb(message: common_pb2.StartSessionResponse) -> PrefillResult:
    return PrefillResult(prompt_tokens=message.prompt_tokens, elapsed_ns=message.elapsed_ns,
                         prompt_logprobs=token_logprobs_from_pb(message.prompt_logprobs))


def token_logprobs_to_pb(entries: Sequence[TokenLogprobs]) -> list[common_pb2.TokenLogprobs]:
    return [common_pb2.TokenLogprobs(logprob=entry.logprob, rank=entry.rank, top_token_ids=entry.top_token_ids,
                                     top_logprobs=entry.top_logprobs) for entry in entries]


def token_logprobs_from_pb(messages: Sequence[common_pb2.TokenLogprobs]) -> tuple[TokenLogprobs, ...]:
    return tuple(TokenLogprobs(logprob=message.logprob, rank=message.rank,
                               top_token_ids=tuple(message.top_token_ids), top_logprobs=tuple(message.top_logprobs))
                 for message in messages)


def verify_to_pb(verdict: VerifyResult, started_ns: int) -> target_pb2.VerifyResponse:
    """``started_ns``: when the server began handling the call (:func:`elapsed_ns`)."""
    return target_pb2.VerifyResponse(num_accepted=verdict.num_accepted, bonus_token_id=verdict.next_token_id,
                                     forward_ns=verdict.forward_ns, elapsed_ns=elapsed_ns(started_ns),
                                     logprobs=token_logprobs_to_pb(verdict.logprobs))


def verify_from_pb(message: target_pb2.VerifyResponse) -> VerifyResult:
    return VerifyResult(num_accepted=message.num_accepted, next_token_id=message.bonus_token_id,
                        forward_ns=message.forward_ns, elapsed_ns=message.elapsed_ns,
                        logprobs=token_logprobs_from_pb(message.logprobs))


def draft_event_to_pb(event: DraftEvent, elapsed: int) -> draft_pb2.DraftEvent:
    """``elapsed``: server-side ns since the Draft call began (tokens only)."""
    if isinstance(event, DraftSummary):
        return draft_pb2.DraftEvent(summary=draft_pb2.DraftSummary(
            forwards=event.forwards, elapsed_ns=event.elapsed_ns, stop_reason=event.stop_reason,
            predrafted_used=event.predrafted_used, predrafted_wasted=event.predrafted_wasted,
            overlap_hit=event.overlap_hit, overlap_miss=event.overlap_miss))
    token = draft_pb2.DraftToken(token_id=event.token_id, draft_prob=event.draft_prob, elapsed_ns=elapsed)
    if event.draft_probs is not None:
        token.draft_probs.CopyFrom(distribution_to_pb(event.draft_probs))
    return draft_pb2.DraftEvent(token=token)


def draft_event_from_pb(message: draft_pb2.DraftEvent) -> DraftEvent:
    if message.WhichOneof("event") == "summary":
        summary = message.summary
        # NOTE: a draft service older than overlapped drafting sends none of the overlap
        # fields: they read as 0 / False, which is what such a service did.
        return DraftSummary(forwards=summary.forwards, elapsed_ns=summary.elapsed_ns,
                            stop_reason=summary.stop_reason, predrafted_used=summary.predrafted_used,
                            predrafted_wasted=summary.predrafted_wasted, overlap_hit=summary.overlap_hit,
                            overlap_miss=summary.overlap_miss)
    token = message.token
    probs = distribution_from_pb(token.draft_probs) if token.HasField("draft_probs") else None
    return DraftToken(token_id=token.token_id, draft_prob=token.draft_prob, draft_probs=probs)


def service_info_pb(role: str, loaded: LoadedModel, max_context: int, active_sessions: int,
                    limits: SessionLimits, started_ns: int, forward_s: Sequence[float] = (),
                    overlap: bool = False, batching: str = "",
                    live_forward_s: Sequence[float] = (), exactness: str = "",
                    security: str = "", prefill_s_per_token: float = 0.0,
                    prefill_window: int = 0, forward: str = "") -> common_pb2.ServiceInfo:
    """What a backend serves (its ``Info`` answer); ``forward_s``: its measured forward costs;
    ``live_forward_s``: the forward seconds it observed while serving, by rows
    (:class:`disco.engines.live_costs.LiveCosts`);
    ``overlap``: the draft engine pre-drafts (overlapped drafting); ``batching``: how
    concurrent sessions' forwards run (:class:`disco.engines.packing_proof.PackingVerdict`);
    ``exactness``: whether greedy output is proven equal to target-only on its device
    (:class:`disco.engines.packing_proof.Exactness`); ``security``: how it authenticates its
    callers (:meth:`protos.runtime.backend_security.BackendSecurity.statement`);
    ``prefill_s_per_token``: its measured prefill per prompt token (0: not measured);
    ``prefill_window``: the draft's prefill window (0: the whole prompt); ``forward``: what runs its
    forwards (:func:`disco.engines.packed_forward.describe_forward`)."""
    parameter = next(loaded.model.parameters())
    return common_pb2.ServiceInfo(
        role=role, model_name=loaded.name, fingerprint=loaded.fingerprint, tokenizer_hash=loaded.tokenizer_hash,
        vocab_size=loaded.vocab_size, max_context=max_context, eos_token_ids=list(loaded.eos_token_ids),
        dtype=loaded.engine or str(parameter.dtype).removeprefix("torch."), device=str(parameter.device),
        active_sessions=active_sessions, max_sessions=limits.max_sessions, idle_ttl_s=limits.idle_ttl_s,
        version=disco.__version__, elapsed_ns=elapsed_ns(started_ns), forward_s=list(forward_s),
        overlap=overlap, batching=batching, live_forward_s=list(live_forward_s), exactness=exactness,
        kernel=loaded.kernel, security=security, prefill_s_per_token=prefill_s_per_token,
        prefill_window=prefill_window, prefill=loaded.prefill, forward=forward)
