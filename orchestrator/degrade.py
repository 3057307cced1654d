"""Serving on when the draft service is down or failing: the draft only speeds things up.

The target decides every token, so a request whose draft service cannot be reached (or
answers with an error that is not the request's fault) goes on target-only — the loop
(:mod:`disco.speculation.loop`) does that when its drafter raises
:class:`~disco.errors.Unavailable`, counts it in ``RequestStats.draft_fallbacks`` and
logs a warning. This module makes every draft-side failure look like that:

* :func:`draft_check` — the orchestrator's one-time vocabulary check of the draft
  service cannot run while it is down; instead of failing the request, the request is
  served by an :class:`UnreachableDrafter` (target-only), and the check runs again for
  the next request, so the draft is used again once it is healthy.
* :class:`DegradingDrafter` — wraps the request's drafter (above replica failover, which
  handles replicas that are down): errors of a draft call other than a bad request, a
  lost session or a cancellation (``INTERNAL``, ``RESOURCE_EXHAUSTED`` — the draft is
  full —, ...) become :class:`~disco.errors.Unavailable`, so the request goes on
  target-only instead of failing.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from disco.config import SamplingParams
from disco.errors import InvalidRequest, ModelError, SessionNotFound, Unavailable
from disco.interfaces import DraftEvent, Feedback, PrefillResult
from disco.speculation.policies import parse_policy_spec
from protos.runtime.server import Cancelled

#: Draft-side errors that are the request's (or the deployment's) fault, or that the
#: loop handles itself; every other failure of the draft service means "go on without it".
PROPAGATED = (InvalidRequest, ModelError, SessionNotFound, Cancelled, Unavailable)


def draft_check(backends: Any, policy: str) -> Unavailable | None:
    """Run the draft vocabulary check when ``policy`` drafts; the error if the draft
    service could not be reached (the request then goes on target-only).

    Raises:
        VocabularyMismatch: the draft serves another tokenizer.
    """
    if not parse_policy_spec(policy).uses_draft:
        return None
    try:
        backends.check_draft()
    except Unavailable as error:
        return error
    return None


class UnreachableDrafter:
    """A :class:`~disco.interfaces.Drafter` whose service is down: every call raises
    :class:`Unavailable`, so the loop serves the request target-only."""

    def __init__(self, error: Unavailable) -> None:
        self.error = error

    def start_session(self, session_id: str, prompt_ids: Sequence[int], sampling: SamplingParams,
                      policy_spec: str, reference_ids: Sequence[int] | None = None,
                      overlap: bool | None = None) -> PrefillResult:
        raise self.error

    def draft(self, session_id: str, feedback: Feedback | None, max_lookahead: int) -> Iterator[DraftEvent]:
        raise self.error

    def end_session(self, session_id: str) -> None:
        return None


class DegradingDrafter:
    """A :class:`~disco.interfaces.Drafter` whose failures, other than :data:`PROPAGATED`
    ones, are :class:`Unavailable` (the loop then serves the request target-only)."""

    def __init__(self, drafter: Any) -> None:
        self.drafter = drafter

    def start_session(self, session_id: str, prompt_ids: Sequence[int], sampling: SamplingParams,
                      policy_spec: str, reference_ids: Sequence[int] | None = None,
                      overlap: bool | None = None) -> PrefillResult:
        with as_draft_unavailable():
            return self.drafter.start_session(session_id, prompt_ids, sampling, policy_spec, reference_ids,
                                              overlap=overlap)

    def draft(self, session_id: str, feedback: Feedback | None, max_lookahead: int) -> Iterator[DraftEvent]:
        with as_draft_unavailable():
            events = self.drafter.draft(session_id, feedback, max_lookahead)
        return _degrading(events)

    def end_session(self, session_id: str) -> None:
        self.drafter.end_session(session_id)


@contextmanager
def as_draft_unavailable() -> Iterator[None]:
    """Re-raise a failure of a draft call as :class:`Unavailable` unless it is in :data:`PROPAGATED`."""
    try:
        yield
    except PROPAGATED:
        raise
    except Exception as error:  # noqa: BLE001 - RuntimeError (INTERNAL, UNKNOWN), ResourceExhausted, ...
        raise Unavailable(f"the draft service failed: {error}") from error


def _degrading(events: Iterator[DraftEvent]) -> Iterator[DraftEvent]:
    with as_draft_unavailable():
        yield from events
