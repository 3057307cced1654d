"""Several outputs per request: ``n``, completions' ``best_of`` and a list of prompts.

Each output is its own gRPC ``Generate`` (streamed) or ``GenerateUnary`` call, so its own
session in every service; the calls of one request run concurrently and fail together.

* :func:`plan` checks the fields against the server's limits and lists the calls: for each
  prompt (in order) its candidates, ``best_of`` of them (``n`` without ``best_of``), candidate
  ``i`` sampled with :func:`choice_seed` of the request's seed.
* :meth:`Plan.outputs` picks what is returned: every candidate, or with ``best_of > n`` the ``n``
  of each prompt with the highest cumulative logprob (the target's raw log-softmax of each chosen
  token, :func:`cumulative_logprob`), and counts the usage (every candidate's tokens; each
  prompt's once). Choice ``k`` of the answer is output ``k % n`` of prompt ``k // n``, as OpenAI
  orders them.
* :func:`all_or_none` awaits the unary calls, :class:`ChoiceStreams` reads the streams together
  (their chunks interleaved as they come); the first failure cancels the other calls.

NOTE: the prompt's prefill is not shared between the outputs of one prompt (no session fork
exists yet): ``n`` outputs cost ``n`` prefills (docs/http.md, "Several outputs").
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Sequence, TypeVar

from orchestrator.client import AsyncGenerationStream, Chunk, Completion
from orchestrator.http.errors import invalid
from orchestrator.http.schemas import GenerationRequest

#: Seeds are int64 on the wire and must be below 2**63 (``disco.config.SamplingParams``).
SEED_MODULUS = 2**63
T = TypeVar("T")


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of candidate ``index`` of a request seeded with ``seed``: ``(seed + index) mod 2**63``,
    vLLM's rule for the children of an ``n > 1`` request (``None``: each call draws its own random
    seed, which its stats report). Candidate 0 keeps the request's seed, so ``n: 1`` is unchanged,
    and a single request with this seed reproduces the candidate's text."""
    return None if seed is None else (seed + index) % SEED_MODULUS


def cumulative_logprob(result: Completion) -> float:
    """What ``best_of`` ranks by: the sum of the generated tokens' raw target logprobs."""
    return sum(entry.logprob for entry in result.logprobs if entry.logprob is not None)


@dataclass(frozen=True)
class Outputs:
    """The results a request answers with.

    Args:
        choices: the returned outputs, in the order of the answer's ``choices``.
        generated: every call's result (with ``best_of``, the candidates not returned too):
            ``usage.completion_tokens`` and ``speculation`` count them all.
        prompt_tokens: ``usage.prompt_tokens``: each prompt's tokens once, however many outputs it has.
        seed: the answer's top-level ``seed``: the one that reproduces it (the request's own, or a
            lone output's random one); ``None`` when the outputs were sampled with random seeds
            of their own (each choice names its own) or greedily.
    """

    choices: list[Completion]
    generated: list[Completion]
    prompt_tokens: int
    seed: int | None

    @property
    def several(self) -> bool:
        """More than one generation: each choice then reports its own ``seed`` and ``speculation``."""
        return len(self.generated) > 1


@dataclass(frozen=True)
class Plan:
    """The gRPC calls of one request: ``calls[p * best_of + i]`` is candidate ``i`` of prompt ``p``."""

    calls: list[dict[str, Any]]
    n: int
    best_of: int
    prompts: int
    seeded: bool

    @property
    def ranked(self) -> bool:
        """Whether more candidates are generated than returned (the best ``n`` of each prompt)."""
        return self.best_of > self.n

    def outputs(self, results: Sequence[Completion]) -> Outputs:
        """What to answer with, given the calls' results (in the order of :attr:`calls`)."""
        per_prompt = [list(results[p * self.best_of:(p + 1) * self.best_of]) for p in range(self.prompts)]
        chosen = [result for candidates in per_prompt for result in self._best(candidates)]
        seed = results[0].stats.get("seed") if len(results) == 1 or self.seeded else None
        return Outputs(chosen, list(results), sum(int(c[0].stats.get("prompt_tokens", 0)) for c in per_prompt), seed)

    def _best(self, candidates: list[Completion]) -> list[Completion]:
        """The ``n`` candidates with the highest cumulative logprob, best first (ties: the first
        generated), as vLLM orders them; all of them, in order, when none is left out."""
        if not self.ranked:
            return candidates
        order = sorted(range(len(candidates)), key=lambda i: -cumulative_logprob(candidates[i]))
        return [candidates[i] for i in order[:self.n]]


def plan(body: GenerationRequest, prompt_kwargs: list[dict[str, Any]], limit: int) -> Plan:
    """The calls of a request whose prompts have the :func:`~orchestrator.client.build_request`
    arguments ``prompt_kwargs``; at most ``limit`` calls (``HttpConfig.choices_limit``).

    Raises:
        ApiError: 400 naming the field: ``best_of`` below ``n``, ``best_of > n`` with ``stream: true``
            (the best are known only at the end, as OpenAI refuses it), or more outputs than
            ``limit`` (``best_of``, ``n``, or with one output per prompt ``prompt``).
    """
    n = body.n or 1
    best_of = body.best_of_asked() or n
    if best_of < n:
        raise invalid(f"best_of must be >= n, got best_of={best_of} and n={n}", "best_of")
    if body.stream and best_of > n:
        raise invalid("best_of > n is not available with stream=true: the best outputs are known only at the end",
                      "best_of")
    total = best_of * len(prompt_kwargs)
    if total > limit:
        param = "best_of" if best_of > n else "n" if n > 1 else "prompt"
        raise invalid(f"{param}: {best_of} output(s) for each of {len(prompt_kwargs)} prompt(s) make {total}, more "
                      f"than the limit of {limit} per request on this server", param)
    # best_of > n ranks by the generated tokens' logprobs: asked of the calls (none shown unless asked).
    ranking = {"logprobs": 0} if best_of > n else {}
    calls = [{**kwargs, **({} if kwargs.get("logprobs") is not None else ranking),
              "seed": choice_seed(kwargs.get("seed"), i)}
             for kwargs in prompt_kwargs for i in range(best_of)]
    return Plan(calls, n, best_of, len(prompt_kwargs), seeded=body.seed is not None)


async def all_or_none(calls: Sequence[Awaitable[T]]) -> list[T]:
    """The results of ``calls``, run concurrently; the first failure cancels the others and is
    raised (as is a cancellation of this task: every call is cancelled then)."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    for task in tasks:  # a second failure is not raised: mark it retrieved
        task.add_done_callback(lambda done: done.cancelled() or done.exception())
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [task for task in tasks if task.done() and (task.cancelled() or task.exception() is not None)]
        errors = [task.exception() for task in failed if not task.cancelled()]
        if errors:
            raise errors[0]
        if failed:  # a call cut by its deadline (see app.Deadline.cut)
            raise asyncio.CancelledError()
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()  # nothing for a finished one


#: What :meth:`ChoiceStreams.events` yields when a stream ended (its result: ``streams[index].result``).
ENDED = None


class ChoiceStreams:
    """The gRPC streams of one request's outputs, read together.

    :meth:`start` waits for every stream's first chunk, so that an error before any token (a bad
    policy, a full server) keeps its HTTP status; :meth:`events` then yields ``(index, chunk)`` as
    the chunks come (the first ones first), and ``(index, ENDED)`` when stream ``index`` ended.
    The first failure is raised and :meth:`cancel` stops every call still running.
    """

    def __init__(self, streams: list[AsyncGenerationStream]) -> None:
        self.streams = streams
        self._chunks = [stream.__aiter__() for stream in streams]
        self._firsts: list[Chunk | None] = []
        self._queue: asyncio.Queue[tuple[int, Chunk | BaseException | None]] = asyncio.Queue()
        self._pumps: list[asyncio.Task] = []

    async def start(self) -> None:
        try:
            self._firsts = await all_or_none([anext(chunks, None) for chunks in self._chunks])
        except BaseException:
            self.cancel()
            raise

    async def events(self) -> AsyncIterator[tuple[int, Chunk | None]]:
        for index, first in enumerate(self._firsts):
            if first is not None:
                yield index, first
        if len(self.streams) == 1:  # one stream: read it here, no task needed
            async for chunk in self._chunks[0]:
                yield 0, chunk
            yield 0, ENDED
            return
        # NOTE: unbounded, as each call's output is bounded (max_tokens); the client's pace is the slowest.
        self._pumps = [asyncio.ensure_future(self._pump(index, chunks)) for index, chunks in enumerate(self._chunks)]
        running = len(self.streams)
        while running:
            index, item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            running -= item is ENDED
            yield index, item

    async def _pump(self, index: int, chunks: AsyncIterator[Chunk]) -> None:
        try:
            async for chunk in chunks:
                self._queue.put_nowait((index, chunk))
            self._queue.put_nowait((index, ENDED))
        except asyncio.CancelledError as error:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # cancelled by cancel()
            self._queue.put_nowait((index, error))  # the call was cancelled: its deadline
        except Exception as error:  # noqa: BLE001 - handed to the reader, which raises it
            self._queue.put_nowait((index, error))

    def cancel(self) -> None:
        """Stop reading and cancel every call still running (the orchestrator frees their sessions)."""
        for pump in self._pumps:
            pump.cancel()
        for stream in self.streams:
            if stream.result is None:
                stream.cancel()
