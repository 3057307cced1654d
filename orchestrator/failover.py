"""A session that survives the death of its replica: the Drafter/Verifier the servicer
hands to the speculation loop.

Each request's draft and target sessions stick to one replica each
(:class:`~orchestrator.routing.ReplicaSet` picks the least-loaded). When a call fails
because the replica is down (``UNAVAILABLE``) or has forgotten the session
(``NOT_FOUND``: restarted, or the session expired), the session is **re-prefilled** on
another replica, or on the same one once it is back, with everything the request has
committed so far — the prompt plus every token the loop accepted (:class:`SessionTrack`,
kept by the verifier from the verdicts it returned) — and the call is repeated. The
orchestrator's token list is the source of truth; service KV caches are only caches.

A target session waits for a replica to come back when none is healthy (there is no
going on without the target). A draft session does not: when no draft replica is
healthy its error reaches the loop, which serves the rest of the request target-only
(:mod:`orchestrator.degrade`); the next requests use the draft again once Ray has
restarted it. Only when every placement of a call failed does the loop see the error
(and handle a lost session itself, by calling ``start_session`` again).

Why the output stays identical (greedy): a re-created session holds exactly the state
the old one had after the last verdict (prompt + accepted + bonus tokens, the last one
pending), so the next block is drafted and verified against the same prefix. A draft
stream is read whole before the loop sees any of it, so a stream cut off halfway is
simply drafted again. A verification repeated after a failure verifies the same block
against the same prefix. With sampling the same holds: the noise of every position is
keyed by (request seed, absolute position) (:mod:`disco.speculation.sampling`), so a
re-created session draws exactly the samples an undisturbed run would have drawn.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Iterator, Sequence

import torch

from disco.config import SamplingParams
from disco.errors import SessionNotFound, Unavailable
from disco.interfaces import DraftEvent, DraftSummary, Feedback, PrefillResult, VerifyResult
from orchestrator.remote import CallScope, RemoteDrafter, RemoteVerifier
from orchestrator.routing import Replica, ReplicaSet

logger = logging.getLogger(__name__)

#: Placements of one call (the first one included) before its failure is returned.
MAX_ATTEMPTS = 3
#: Errors that mean "this replica lost the session": move it.
RETRYABLE = (Unavailable, SessionNotFound)


@dataclasses.dataclass
class SessionTrack:
    """What a request has committed: its prompt and the tokens accepted so far (accepted
    draft tokens and bonus tokens, in order), as returned by the verifier."""

    prompt_ids: list[int] = dataclasses.field(default_factory=list)
    generated: list[int] = dataclasses.field(default_factory=list)

    def committed(self) -> list[int]:
        return self.prompt_ids + self.generated


class _StickySession:
    """One session of one role, placed on a replica and moved when that replica fails."""

    #: Wait for a recovering replica when none is healthy (see the module docstring).
    wait_for_recovery = True

    def __init__(self, replicas: ReplicaSet, scope: CallScope, track: SessionTrack) -> None:
        self.replicas = replicas
        self.scope = scope
        self.track = track
        self.session_id = ""
        self.moves = 0  # placements so far (the first one included)
        self.failovers = 0  # re-placements after a failed call (re-prefills the loop never saw)
        self._replica: Replica | None = None
        self._generation = 0
        self._backend_id = ""
        self._client: Any = None
        self._fresh = False  # (re)created since the last successful call
        self.prefill: PrefillResult | None = None  # of the latest placement

    def _make_client(self, replica: Replica) -> Any:
        raise NotImplementedError

    def _start(self, client: Any, backend_id: str) -> PrefillResult:
        """Create the session on the replica with everything committed so far."""
        raise NotImplementedError

    def _call(self, invoke: Callable[[Any, str, bool], Any]) -> Any:
        """``invoke(client, backend session id, fresh)`` on the session's replica,
        placing (or re-placing) the session first when needed."""
        error: Exception | None = None
        for attempt in range(MAX_ATTEMPTS):
            try:
                if self._replica is None:
                    self._place()
                    self.failovers += attempt > 0  # re-created after this call failed on a replica
                result = invoke(self._client, self._backend_id, self._fresh)
                self._fresh = False
                return result
            except RETRYABLE as failure:
                error = failure
                deadline_passed = self.scope.deadline is not None and time.monotonic() >= self.scope.deadline
                if self.scope.cancelled or deadline_passed or self._replica is None:
                    # Cancelled or out of time (not a replica failure), or no replica to place
                    # on: keep the placement so the loop's end_session frees the backend session.
                    raise
                logger.warning("%s session %s lost on %s (%s); re-prefilling it", self.replicas.role,
                               self.session_id, self._replica.name, failure)
                # A lost session on a live replica (it restarted in place, or the session
                # expired) is no reason to take the replica out of rotation.
                self._abandon(failed=isinstance(failure, Unavailable))
        assert error is not None
        raise error

    def _place(self) -> None:
        deadline = self.scope.deadline
        replica, generation = self.replicas.acquire(
            None if deadline is None else min(deadline, time.monotonic() + self.replicas.recovery_timeout_s),
            wait=self.wait_for_recovery)
        self._replica, self._generation = replica, generation
        self._client = self._make_client(replica)
        self._backend_id = self.session_id if not self.moves else f"{self.session_id}~{self.moves}"
        self.moves += 1
        self._fresh = True
        try:
            self.prefill = self._start(self._client, self._backend_id)
        except RETRYABLE:
            raise  # _call moves the session
        except BaseException:
            self._abandon(failed=False)  # e.g. a bad request: the loop will not end this session
            raise

    def _abandon(self, failed: bool) -> None:
        if self._replica is None:
            return
        if failed:
            self.replicas.report_failure(self._replica, self._generation)
        self.replicas.release(self._replica)
        self._replica = None

    def _restart(self, session_id: str) -> None:
        """``start_session`` from the loop: a new session, or the loop re-creating one
        it lost (then the old placement is dropped)."""
        self._abandon(failed=False)
        self.session_id = session_id

    def end_session(self, session_id: str) -> None:
        if self._replica is None:
            return
        try:
            self._client.end_session(self._backend_id)
        finally:
            self._abandon(failed=False)


class FailoverDrafter(_StickySession):
    """:class:`~disco.interfaces.Drafter` over a set of draft replicas."""

    wait_for_recovery = False
    _sampling: SamplingParams
    _policy_spec: str
    _reference_ids: list[int] | None
    _overlap: bool | None
    _started_with: int  # length of the prompt the loop started the session with

    def _make_client(self, replica: Replica) -> RemoteDrafter:
        return RemoteDrafter(replica.channel, replica.address, self.scope)

    def _start(self, client: RemoteDrafter, backend_id: str) -> PrefillResult:
        # The tokens committed since the loop's start_session (whose sampling already counts the
        # ones before): a draft session the loop re-starts may follow a track it did not reset.
        done = len(self.track.committed()) - self._started_with
        sampling = self._sampling.resumed_after(done)
        return client.start_session(backend_id, self.track.committed(), sampling, self._policy_spec,
                                    self._reference_ids if not done else None, overlap=self._overlap)

    def start_session(self, session_id: str, prompt_ids: Sequence[int], sampling: SamplingParams,
                      policy_spec: str, reference_ids: Sequence[int] | None = None,
                      overlap: bool | None = None) -> PrefillResult:
        # NOTE: the session is created from the verifier's SessionTrack, which holds these
        # prompt ids (a first start follows the target's; a re-start passes the committed ones).
        self._restart(session_id)
        self._sampling, self._policy_spec, self._overlap = sampling, policy_spec, overlap
        self._started_with = len(prompt_ids)
        self._reference_ids = list(reference_ids) if reference_ids is not None else None
        if self.track.committed() != list(prompt_ids):
            self.track.prompt_ids, self.track.generated = list(prompt_ids), []
        self._call(lambda client, backend_id, fresh: None)  # placing the session starts it
        return self.prefill

    def draft(self, session_id: str, feedback: Feedback | None, max_lookahead: int) -> Iterator[DraftEvent]:
        # NOTE: the block is read whole before the loop sees it, so a stream cut off by a
        # failure is drafted again from the start; the loop only ever collects the whole
        # block before verifying it, so this costs no latency.
        def invoke(client: RemoteDrafter, backend_id: str, fresh: bool) -> list[DraftEvent]:
            # A re-created session already holds the previous verdict's tokens.
            return list(client.draft(backend_id, None if fresh else feedback, max_lookahead,
                                     expected_length=len(self.track.committed())))

        events = self._call(invoke)
        assert isinstance(events[-1], DraftSummary)
        return iter(events)


class FailoverVerifier(_StickySession):
    """:class:`~disco.interfaces.Verifier` over a set of target replicas; it also keeps
    the request's :class:`SessionTrack` up to date from its verdicts."""

    _sampling: SamplingParams

    def _make_client(self, replica: Replica) -> RemoteVerifier:
        return RemoteVerifier(replica.channel, replica.address, self.scope)

    def _start(self, client: RemoteVerifier, backend_id: str) -> PrefillResult:
        done = len(self.track.generated)
        sampling = self._sampling.resumed_after(done)
        return client.start_session(backend_id, self.track.committed(), sampling)

    def start_session(self, session_id: str, prompt_ids: Sequence[int], sampling: SamplingParams) -> PrefillResult:
        self._restart(session_id)
        self._sampling = sampling
        self.track.prompt_ids, self.track.generated = list(prompt_ids), []  # a re-start passes all committed ids
        self._call(lambda client, backend_id, fresh: None)  # placing the session starts it
        return self.prefill

    def verify(
        self,
        session_id: str,
        draft_token_ids: Sequence[int],
        draft_probs: torch.Tensor | None,  # [k, vocab]; legacy, not read by the target (token ids are verified)
    ) -> VerifyResult:
        verdict = self._call(lambda client, backend_id, fresh: client.verify(
            backend_id, draft_token_ids, draft_probs, expected_length=len(self.track.committed())))
        self.track.generated.extend(list(draft_token_ids[:verdict.num_accepted]) + [verdict.next_token_id])
        return verdict
