"""The speculation loop: one implementation for every transport.

It sees only a :class:`~disco.interfaces.Drafter` and a
:class:`~disco.interfaces.Verifier`; the in-process engines and the gRPC clients plug
in behind them. Per iteration it reads as three stages — draft, verify, accept — like
vLLM's propose/score/verify and HF's assisted-generation loop. The loop's token list is
the source of truth for the request.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence, Union

from disco.config import SamplingParams, SpeculationConfig
from disco.errors import InvalidRequest, SessionNotFound, Unavailable
from disco.interfaces import Drafter, DraftSummary, Feedback, PrefillResult, TokenLogprobs, Verifier
from disco.speculation.cost_model import CostModel
from disco.speculation.detokenize import Decode, IncrementalDetokenizer
from disco.speculation.logits_processors import Encode, tokenize_bad_words
from disco.speculation.policies import parse_policy_spec
from disco.speculation.policies.auto import speculation_pays, with_costs
from disco.stats import RequestStats


@dataclass(frozen=True)
class TokenChunk:
    """Tokens accepted in one iteration (after EOS/stop/length truncation) and their text."""

    token_ids: list[int]
    text: str
    logprobs: tuple[TokenLogprobs, ...] = ()  # asked (SamplingParams.logprobs): one per token of token_ids
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # asked: the first chunk's, prompt tokens 1 .. n-1


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]  # generated ids only (EOS included if generated)
    text: str
    finish_reason: str  # "stop" (EOS, a stop token id or a stop string) or "length"
    stats: RequestStats
    logprobs: tuple[TokenLogprobs, ...] = ()  # asked: one per token of token_ids
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # asked: one per prompt token after the first


GenerationEvent = Union[TokenChunk, GenerationResult]

logger = logging.getLogger(__name__)


class SpeculativeGenerator:
    """Runs requests through a drafter/verifier pair."""

    def __init__(
        self,
        drafter: Drafter | None,
        verifier: Verifier,
        decode: Decode,
        eos_token_ids: Sequence[int],
        max_new_tokens_limit: int | None = None,
        costs: CostModel | None = None,
        parallel_prefill: bool = False,
        explore_draft: bool = False,
        costs_now: Callable[[], CostModel | None] | None = None,
        encode: Encode | None = None,
    ) -> None:
        """``costs``: the measured engine costs of this deployment; ``auto`` and ``disco:``
        policies read them (:func:`disco.speculation.policies.auto.with_costs`; without them both are
        DISCO at the artifact's tuned threshold). ``parallel_prefill``: start the draft and
        the target session at once (the orchestrator's services run on their own devices;
        in one process they would share the cores, so the in-process pipeline leaves it off).
        ``explore_draft``: ``auto`` drafts even where ``costs`` say it cannot pay (its rate rule
        still stops each block as early as the costs say), so that the draft's live costs
        get observed; the orchestrator sets it while none were (a draft calibration too high
        would otherwise never be corrected). ``costs_now``: the deployment's costs at the
        current load (the orchestrator's live cost model, :mod:`disco.speculation.live_model`),
        asked before every block of an ``auto`` request that speculates: where no lookahead
        pays at this load the block is a target-only step (the draft session is left behind),
        and when speculation pays again the draft session is started anew from the request's
        tokens (one draft prefill). ``encode``: the target's tokenizer (text -> ids, no special
        tokens), which turns a request's ``bad_words`` into token sequences; without it a request
        with bad words is refused."""
        self.drafter = drafter
        self.verifier = verifier
        self.decode = decode
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_new_tokens_limit = max_new_tokens_limit
        self.costs = costs
        self.parallel_prefill = parallel_prefill
        self.explore_draft = explore_draft
        self.costs_now = costs_now
        self.encode = encode

    def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                 speculation: SpeculationConfig) -> GenerationResult:
        result = None
        for event in self.stream(prompt_ids, sampling, speculation):
            if isinstance(event, GenerationResult):
                result = event
        assert result is not None
        return result

    def validate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                 speculation: SpeculationConfig) -> None:
        """Raise :class:`InvalidRequest` before any work is done."""
        if not prompt_ids:
            raise InvalidRequest("prompt is empty")
        sampling.validate(self.max_new_tokens_limit)
        sampling.check_logprob_entries(len(prompt_ids))
        speculation.validate()
        spec = parse_policy_spec(speculation.policy)
        if spec.uses_draft and spec.text != "auto" and self.drafter is None:
            raise InvalidRequest(f"policy {spec.text!r} needs a draft model, but none is configured")
        if spec.name == "oracle" and not sampling.is_greedy:
            raise InvalidRequest("the oracle policy is defined for greedy decoding only (temperature 0)")

    def stream(self, prompt_ids: Sequence[int], sampling: SamplingParams,
               speculation: SpeculationConfig) -> Iterator[GenerationEvent]:
        """Yields a :class:`TokenChunk` per iteration, then one :class:`GenerationResult`."""
        self.validate(prompt_ids, sampling, speculation)
        sampling = self.with_controls(sampling)
        spec = parse_policy_spec(speculation.policy)
        if spec.name == "auto" and not spec.argument:
            speculation = dataclasses.replace(speculation, policy=self.resolve_auto(speculation.max_lookahead, len(prompt_ids),
                                                                                sampling.max_new_tokens))
        else:
            speculation = dataclasses.replace(speculation, policy=with_costs(speculation.policy, self.costs))
        spec = parse_policy_spec(speculation.policy)
        reference_ids = None
        if spec.name == "oracle":  # analysis only: the target's own output first
            reference_ids = self.generate(
                prompt_ids, sampling, dataclasses.replace(speculation, policy="none")).token_ids
        load_aware = self.costs_now is not None and spec.name == "auto" and spec.uses_draft
        return self._run(list(prompt_ids), sampling, speculation, spec.uses_draft, reference_ids, load_aware)

    def with_controls(self, sampling: SamplingParams) -> SamplingParams:
        """The request's sampling controls as its sessions apply them: the bad words' token
        sequences (:func:`tokenize_bad_words`, added to any given as ids), and the EOS ids that
        ``min_tokens`` bans with ``stop_token_ids`` (this deployment's, whatever a caller set).

        Raises:
            InvalidRequest: bad words without a tokenizer, or one that does not tokenize.
        """
        bad_words_token_ids = sampling.bad_words_token_ids
        if sampling.bad_words:
            if self.encode is None:
                raise InvalidRequest("bad_words need the target's tokenizer, and this generator has none")
            words = tokenize_bad_words(sampling.bad_words, self.encode)
            bad_words_token_ids = tuple(dict.fromkeys(bad_words_token_ids + words))
        sampling = dataclasses.replace(sampling, bad_words_token_ids=bad_words_token_ids,
                                       eos_token_ids=self.eos_token_ids if sampling.min_tokens else ())
        sampling.validate(self.max_new_tokens_limit)  # the budgets of what was added
        return sampling

    def resolve_auto(self, max_lookahead: int, prompt_tokens: int = 0, new_tokens: int = 0) -> str:
        """``auto`` for one request: ``none`` where the measured costs say drafting cannot pay
        (for a request of ``prompt_tokens`` and ``new_tokens``: the draft's prefill of its prompt
        included), else ``auto`` carrying the costs to the draft side (see
        :mod:`disco.speculation.policies.auto`)."""
        if self.costs is None:
            return "auto"
        if self.drafter is None or not (self.explore_draft or speculation_pays(self.costs, max_lookahead,
                                                                               prompt_tokens, new_tokens)):
            return "none"
        return with_costs("auto", self.costs)

    def _sessions_in_flight(self) -> int:
        """Sessions the deployment serves now, this one included (from ``costs_now``'s model; 1
        when it does not say)."""
        costs = self.costs_now() if self.costs_now is not None else None
        return int(costs.extra.get("sessions", 1)) if costs is not None else 1

    def _run(self, prompt_ids: list[int], sampling: SamplingParams, speculation: SpeculationConfig,
             uses_draft: bool, reference_ids: list[int] | None, load_aware: bool = False
             ) -> Iterator[GenerationEvent]:
        started = time.perf_counter()
        stats = RequestStats(prompt_tokens=len(prompt_ids))
        detokenizer = IncrementalDetokenizer(
            self.decode, sampling.stop, () if sampling.ignore_eos else self.eos_token_ids,
            stop_token_ids=sampling.stop_token_ids, min_tokens=sampling.min_tokens,
            include_stop_str_in_output=sampling.include_stop_str_in_output)
        # Both sides draw the same noise, keyed by (seed, position): the request's seed, or (sampled
        # without one) a random seed, reported in the stats so that the output can be reproduced.
        sampling = sampling.seeded()
        stats.seed = None if sampling.is_greedy else sampling.seed
        session_id = uuid.uuid4().hex
        generated: list[int] = []
        finish_reason = ""
        sessions_started: list = []
        # Under load (other sessions in flight) an ``auto`` request starts its draft session at
        # the first block that pays, not with the prompt: a burst of requests admitted together
        # sees the load only as it arrives, and a draft prefill the first block's check throws
        # away costs the other sessions' forwards (docs/engines.md, "A margin under load").
        defer_draft = load_aware and uses_draft and self._sessions_in_flight() > 1
        if sampling.max_new_tokens == 0:  # prompt scoring (prompt_logprobs): the target's prefill only
            uses_draft = defer_draft = False
            finish_reason = "length"
        all_logprobs: list[TokenLogprobs] = []
        try:
            # 1. Prefill: one session in each service.
            if defer_draft:
                prefill = self.verifier.start_session(session_id, prompt_ids, sampling)
                sessions_started.append(self.verifier)
            elif uses_draft and self.parallel_prefill:
                uses_draft, prefill = self._prefill_at_once(session_id, prompt_ids, sampling, speculation,
                                                            reference_ids, stats, sessions_started)
            else:
                prefill = self.verifier.start_session(session_id, prompt_ids, sampling)
                sessions_started.append(self.verifier)
                if uses_draft:
                    assert self.drafter is not None
                    sessions_started.append(self.drafter)
                    uses_draft = self._start_draft(session_id, prompt_ids, sampling, speculation, reference_ids,
                                                   stats)
            stats.prefill_s = time.perf_counter() - started
            prompt_logprobs = () if sampling.prompt_logprobs is None else _asked_logprobs(
                prefill.prompt_logprobs, len(prompt_ids) - 1, "prompt_logprobs")
            pending_prompt_logprobs = prompt_logprobs  # sent with the first chunk
            feedback: Feedback | None = None
            draft_behind = defer_draft  # the draft session misses tokens (not started, or blocks skipped under load)
            while not finish_reason:
                # 2. Draft: never more than can still be used (remaining tokens - bonus).
                lookahead_cap = min(speculation.max_lookahead, sampling.max_new_tokens - len(generated) - 1)
                draft_ids: list[int] = []
                if uses_draft and lookahead_cap > 0 and load_aware:
                    # 2.0 Under load a verification row costs more: where no lookahead pays now,
                    # this block is a target-only step; the draft catches up when it pays again.
                    costs = self.costs_now()
                    if costs is not None and not speculation_pays(costs, lookahead_cap):
                        draft_behind, lookahead_cap = True, 0
                    elif draft_behind:
                        if self.drafter in sessions_started:
                            self._end_quietly(self.drafter, session_id)
                            stats.draft_reprefills += 1
                        else:  # deferred at the start: its first prefill
                            sessions_started.append(self.drafter)
                        uses_draft = self._start_draft(session_id, prompt_ids + generated,
                                                       sampling.resumed_after(len(generated)), speculation, None,
                                                       stats)
                        draft_behind, feedback = False, None
                if uses_draft and lookahead_cap > 0:
                    draft_started = time.perf_counter()
                    try:
                        self._draft_block(session_id, feedback, lookahead_cap, draft_ids, stats)
                    except SessionNotFound:
                        # 2.1 The draft service lost the session (restart, expiry): re-prefill it
                        # from the loop's token list, the source of truth, and draft again.
                        logger.warning("draft session %s lost; re-prefilling %d tokens", session_id,
                                       len(prompt_ids) + len(generated))
                        draft_ids.clear()
                        uses_draft = self._start_draft(session_id, prompt_ids + generated,
                                                       sampling.resumed_after(len(generated)), speculation, None,
                                                       stats)
                        if uses_draft:
                            self._draft_block(session_id, None, lookahead_cap, draft_ids, stats)
                    except Unavailable as error:
                        uses_draft = self._draft_failed(session_id, error, stats)
                        draft_ids.clear()
                    feedback = None
                    stats.draft_s += time.perf_counter() - draft_started
                # 3. Verify the whole block in one target forward. Sampled tokens are verified by
                # their ids (drafter-invariant sampling): no draft distribution travels.
                verify_started = time.perf_counter()
                try:
                    verdict = self.verifier.verify(session_id, draft_ids, None)
                except SessionNotFound:
                    # 3.1 The target lost the session: re-prefill the committed tokens, verify again.
                    logger.warning("target session %s lost; re-prefilling %d tokens", session_id,
                                   len(prompt_ids) + len(generated))
                    stats.target_reprefills += 1
                    self.verifier.start_session(session_id, prompt_ids + generated,
                                                sampling.resumed_after(len(generated)))
                    verdict = self.verifier.verify(session_id, draft_ids, None)
                stats.verify_s += time.perf_counter() - verify_started
                stats.backend_verify_s += verdict.elapsed_ns / 1e9
                stats.verify_forward_s += verdict.forward_ns / 1e9
                stats.record_iteration(len(draft_ids), verdict.num_accepted)
                feedback = Feedback(verdict.num_accepted, verdict.next_token_id)
                # 4. Accept: the accepted prefix plus the bonus token, then EOS/stop/length.
                new_ids = draft_ids[:verdict.num_accepted] + [verdict.next_token_id]
                new_logprobs = () if sampling.logprobs is None else _asked_logprobs(
                    verdict.logprobs, len(new_ids), "logprobs")
                chunk_ids, chunk_text = [], ""
                for token_id in new_ids:
                    generated.append(token_id)
                    chunk_ids.append(token_id)
                    delta = detokenizer.push(token_id)
                    chunk_text += delta.text
                    if delta.stopped:
                        finish_reason = "stop"
                        break
                    if len(generated) >= sampling.max_new_tokens:
                        finish_reason = "length"
                        chunk_text += detokenizer.finish().text
                        break
                # The logprobs are truncated with the tokens (EOS, a stop string, the length).
                chunk_logprobs = new_logprobs[:len(chunk_ids)]
                all_logprobs.extend(chunk_logprobs)
                yield TokenChunk(token_ids=chunk_ids, text=chunk_text, logprobs=chunk_logprobs,
                                 prompt_logprobs=pending_prompt_logprobs)
                pending_prompt_logprobs = ()
        finally:
            for service in sessions_started:
                self._end_quietly(service, session_id)
        stats.generated_tokens = len(generated)
        stats.finish_reason = finish_reason
        stats.wall_s = time.perf_counter() - started
        yield GenerationResult(token_ids=generated, text=detokenizer.text, finish_reason=finish_reason,
                               stats=stats, logprobs=tuple(all_logprobs), prompt_logprobs=prompt_logprobs)

    @staticmethod
    def _end_quietly(service, session_id: str) -> None:
        try:
            service.end_session(session_id)
        except Exception:  # noqa: BLE001 - freeing is best effort; the result stands
            pass

    # -- draft side helpers: a failing draft service never fails the request ------------

    def _prefill_at_once(self, session_id: str, prompt_ids: list[int], sampling: SamplingParams,
                         speculation: SpeculationConfig, reference_ids: list[int] | None, stats: RequestStats,
                         sessions_started: list) -> tuple[bool, PrefillResult]:
        """Both prefills at once: the draft session starts in a worker thread while this
        one starts the target's. Returns whether the draft session runs (as
        :meth:`_start_draft`) and the target's prefill. Either service's error propagates once
        both calls are over, with every started session in ``sessions_started`` for the caller
        to end."""
        assert self.drafter is not None
        sessions_started.append(self.drafter)  # ended by the caller whatever happens (ending is idempotent)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-prefill") as pool:
            draft = pool.submit(contextvars.copy_context().run, self.drafter.start_session, session_id, prompt_ids,
                                sampling, speculation.policy, reference_ids, overlap=speculation.overlap)
            prefill = self.verifier.start_session(session_id, prompt_ids, sampling)  # on error: waits for the draft
            sessions_started.append(self.verifier)
        try:  # the outcome is handled here, in the request's thread (its stats, its log context)
            draft.result()
            return True, prefill
        except Unavailable as error:
            return self._draft_failed(session_id, error, stats), prefill

    def _start_draft(self, session_id: str, token_ids: list[int], sampling: SamplingParams,
                     speculation: SpeculationConfig, reference_ids: list[int] | None, stats: RequestStats) -> bool:
        """Start (or re-start) the draft session; False means: go on target-only."""
        try:
            self.drafter.start_session(session_id, token_ids, sampling, speculation.policy, reference_ids,
                                       overlap=speculation.overlap)
            return True
        except Unavailable as error:
            return self._draft_failed(session_id, error, stats)

    def _draft_block(self, session_id: str, feedback: Feedback | None, lookahead_cap: int,
                     draft_ids: list[int], stats: RequestStats) -> None:
        for event in self.drafter.draft(session_id, feedback, lookahead_cap):
            if isinstance(event, DraftSummary):
                stats.draft_calls += 1
                stats.draft_forwards += event.forwards
                stats.backend_draft_s += event.elapsed_ns / 1e9
                stats.overlap_hits += event.overlap_hit
                stats.overlap_misses += event.overlap_miss
                stats.predrafted_used += event.predrafted_used
                stats.predrafted_wasted += event.predrafted_wasted
            else:
                draft_ids.append(event.token_id)  # a distribution an older draft service sends is not needed

    @staticmethod
    def _draft_failed(session_id: str, error: Exception, stats: RequestStats) -> bool:
        """NOTE: the output stays exact without the draft — the target decides every token."""
        logger.warning("draft service unavailable for session %s (%s); continuing target-only", session_id, error)
        stats.draft_fallbacks += 1
        return False


def _asked_logprobs(entries: Sequence[TokenLogprobs], expected: int, field: str) -> tuple[TokenLogprobs, ...]:
    """The target's entries of a request that asked for them: exactly ``expected`` of them,
    else the target cannot give them (a version older than this loop's).

    Raises:
        Unavailable: the target returned another count.
    """
    if len(entries) != expected:
        raise Unavailable(f"{field}: the target returned {len(entries)} entries for {expected} tokens (a target "
                          "service older than this orchestrator does not compute them)")
    return tuple(entries)
