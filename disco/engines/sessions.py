"""Bounded, thread-safe session registry shared by both engines, with admission by count
and by KV-cache bytes.

KV admission: a session's KV cache holds ``tokens x bytes_per_token`` bytes, where
``bytes_per_token = 2 (keys, values) x layers x kv_heads x head_dim x element size`` of
the cache dtype (:func:`kv_bytes_per_token`, from the model's config). An engine reserves,
at admission, the tokens the session can reach (prompt + ``max_new_tokens``, at most the
context) before it pays for the prefill, and grows the reservation when a forward would take
the cache past it (a draft block or a verification block beyond ``max_new_tokens``, a
re-prefill). Whatever would take the reserved total past the budget is refused with
:class:`ResourceExhausted` naming the bytes asked, the bytes in use and the budget; a refused
admission leaves nothing behind.

The budget is :attr:`SessionLimits.max_kv_bytes`, or when that is 0 derived at engine start
(:func:`derive_kv_budget`): on CUDA :data:`CUDA_FREE_FRACTION` of the device's free memory
(read after the model is loaded; the rest is left to activations, the allocator's slack and
other processes), on a CPU :data:`HOST_AVAILABLE_FRACTION` of the available RAM (``disco
serve`` runs both services on one machine: the first to start takes its fraction of what
is available, the second its fraction of the rest). NOTE: the estimate counts the cache
only, not the transient copies a forward makes; ``--max-kv-bytes`` sets it by hand.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Generic, Iterator, TypeVar

import torch

from disco.engines.decoder_shape import DecoderShape
from disco.errors import InvalidRequest, ResourceExhausted, SessionNotFound

SessionT = TypeVar("SessionT")

logger = logging.getLogger(__name__)

#: Share of a CUDA device's free memory (after the model is loaded) the derived KV budget takes.
CUDA_FREE_FRACTION = 0.8
#: Share of the host's available RAM (``MemAvailable``) the derived KV budget takes on a CPU.
HOST_AVAILABLE_FRACTION = 0.5


@dataclass(frozen=True)
class SessionLimits:
    """Per-service limits (see the README's "Limits" section and docs/operations.md)."""

    max_sessions: int = 64
    idle_ttl_s: float = 600.0  # a session unused this long is freed
    max_kv_bytes: int = 0  # KV-cache bytes all sessions together may hold; 0: derived from memory
    # The static path (disco.engines.static_runner): sessions with a slot of its static caches
    # step through bucketed fixed-shape forwards (CUDA graphs on a GPU); 0 slots: off.
    static_slots: int = 0
    static_capacity: int = 4096  # positions per slot (a session's prompt + max_new_tokens + 24 must fit)

    def __post_init__(self) -> None:
        if self.max_kv_bytes < 0:
            raise InvalidRequest(f"max_kv_bytes must be >= 0 (0: derived), got {self.max_kv_bytes}")
        if self.static_slots < 0 or self.static_capacity < 64:
            raise InvalidRequest(f"static_slots must be >= 0 and static_capacity >= 64, got {self.static_slots} "
                                 f"and {self.static_capacity}")


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes one token adds to a session's KV cache: ``2 x layers x kv_heads x head_dim x
    element size``. The cache holds the attention's keys/values in the dtype of the
    model's activations, which is the input embedding's dtype (a quantized model computes
    in its dense dtype)."""
    shape = DecoderShape.of(model)
    element = model.get_input_embeddings().weight.element_size()
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * element


def derive_kv_budget(max_kv_bytes: int, device: torch.device | str) -> tuple[int, str]:
    """The KV budget in bytes and how it was set (for the start-up log line)."""
    if max_kv_bytes > 0:
        return max_kv_bytes, "--max-kv-bytes"
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * CUDA_FREE_FRACTION), f"{CUDA_FREE_FRACTION:.0%} of {free} free bytes on {device}"
    available = _host_available_bytes()
    return int(available * HOST_AVAILABLE_FRACTION), f"{HOST_AVAILABLE_FRACTION:.0%} of {available} available RAM bytes"


def _host_available_bytes() -> int:
    """``MemAvailable`` (free + reclaimable page cache) where /proc/meminfo has it, else the free pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class KvBudget:
    """The KV admission of one engine: its budget and what one token costs."""

    budget_bytes: int
    bytes_per_token: int

    @staticmethod
    def for_model(model: torch.nn.Module, limits: SessionLimits, role: str) -> "KvBudget":
        """Derive (and log) the budget of an engine serving ``model`` (call after loading it)."""
        device = next(model.parameters()).device
        budget, source = derive_kv_budget(limits.max_kv_bytes, device)
        per_token = kv_bytes_per_token(model)
        logger.info("%s KV budget: %d bytes (%s), %d bytes per token: %d tokens in all sessions", role, budget,
                    source, per_token, budget // max(1, per_token))
        return KvBudget(budget, per_token)


class SessionStore(Generic[SessionT]):
    """Sessions by id, at most ``max_sessions``, idle ones expired, KV bytes reserved
    against ``kv`` (no byte accounting without it).

    Admission in two steps: :meth:`reserve` (count and bytes, before the prefill is paid
    for; the reservation counts against both limits at once) then :meth:`add`, or
    :meth:`release` when the session is not created after all.
    """

    def __init__(self, limits: SessionLimits, clock=time.monotonic, kv: KvBudget | None = None) -> None:
        self._limits = limits
        self._clock = clock
        self.kv = kv
        self._sessions: dict[str, tuple[SessionT, float]] = {}
        self._pending: set[str] = set()  # reserved, not yet added
        self._kv_tokens: dict[str, int] = {}  # tokens reserved, by session (pending ones included)
        self._lock = threading.Lock()

    def reserve(self, session_id: str, tokens: int) -> None:
        """Admit a session about to be created: a place and the KV bytes of ``tokens``.

        Raises:
            InvalidRequest: empty or taken session id.
            ResourceExhausted: too many sessions, or the bytes would exceed the budget.
        """
        if not session_id:
            raise InvalidRequest("session id is empty")
        with self._lock:
            self._expire_locked()
            if session_id in self._sessions or session_id in self._pending:
                raise InvalidRequest(f"session {session_id!r} already exists")
            self._check_capacity_locked()
            self._check_bytes_locked(session_id, tokens)
            self._pending.add(session_id)
            self._kv_tokens[session_id] = tokens

    @contextlib.contextmanager
    def admitting(self, session_id: str, tokens: int) -> Iterator[None]:
        """:meth:`reserve` the session, then run the block that builds, prefills and
        :meth:`add` s it; if the block fails, :meth:`release` the reservation (a refused or
        failed session leaves nothing behind)."""
        self.reserve(session_id, tokens)
        try:
            yield
        except BaseException:
            self.release(session_id)
            raise

    def release(self, session_id: str) -> None:
        """Drop a reservation whose session was not added (a failed prefill)."""
        with self._lock:
            if session_id in self._pending:
                self._pending.discard(session_id)
                self._kv_tokens.pop(session_id, None)

    def add(self, session_id: str, session: SessionT, tokens: int = 0) -> None:
        """Register ``session``; without a :meth:`reserve` first, admit it here (``tokens``)."""
        if not session_id:
            raise InvalidRequest("session id is empty")
        with self._lock:
            self._expire_locked()
            if session_id in self._pending:
                self._pending.discard(session_id)
            else:
                if session_id in self._sessions:
                    raise InvalidRequest(f"session {session_id!r} already exists")
                self._check_capacity_locked()
                self._check_bytes_locked(session_id, tokens)
                self._kv_tokens[session_id] = tokens
            self._sessions[session_id] = (session, self._clock())

    def grow(self, session_id: str, tokens: int) -> None:
        """Make the session's reservation cover ``tokens`` (a no-op when it already does).

        Raises:
            ResourceExhausted: the growth would exceed the budget (the reservation is kept as it was).
        """
        if self.kv is None:
            return
        with self._lock:
            reserved = self._kv_tokens.get(session_id)
            if reserved is None or tokens <= reserved:
                return  # an unknown (ended, expired) session: its own call reports that
            self._check_bytes_locked(session_id, tokens)
            self._kv_tokens[session_id] = tokens

    def check_capacity(self, tokens: int = 0) -> None:
        """Raise :class:`ResourceExhausted` now if a session of ``tokens`` could not be
        admitted (cheap pre-check before expensive work; :meth:`reserve`/:meth:`add` check again)."""
        with self._lock:
            self._expire_locked()
            self._check_capacity_locked()
            self._check_bytes_locked(None, tokens)

    def _check_capacity_locked(self) -> None:
        if len(self._sessions) + len(self._pending) >= self._limits.max_sessions:
            raise ResourceExhausted(f"too many active sessions ({self._limits.max_sessions}); retry later")

    def _check_bytes_locked(self, session_id: str | None, tokens: int) -> None:
        if self.kv is None:
            return
        per_token = self.kv.bytes_per_token
        own = self._kv_tokens.get(session_id, 0) if session_id is not None else 0
        in_use = (sum(self._kv_tokens.values()) - own) * per_token
        asked = tokens * per_token
        if in_use + asked > self.kv.budget_bytes:
            raise ResourceExhausted(
                f"KV cache budget exceeded: the session needs {asked} bytes ({tokens} tokens x {per_token} bytes), "
                f"{in_use} bytes are in use by other sessions, the budget is {self.kv.budget_bytes} bytes; "
                "retry later or ask for fewer tokens")

    @property
    def kv_bytes_in_use(self) -> int:
        """KV bytes reserved by all sessions (pending admissions included); 0 without accounting."""
        with self._lock:
            return sum(self._kv_tokens.values()) * self.kv.bytes_per_token if self.kv is not None else 0

    def get(self, session_id: str) -> SessionT:
        with self._lock:
            self._expire_locked()
            entry = self._sessions.get(session_id)
            if entry is None:
                raise SessionNotFound(f"unknown or expired session {session_id!r}")
            self._sessions[session_id] = (entry[0], self._clock())
            return entry[0]

    def remove(self, session_id: str) -> bool:
        with self._lock:
            if session_id not in self._pending:
                self._kv_tokens.pop(session_id, None)
            return self._sessions.pop(session_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            self._expire_locked()
            return len(self._sessions)

    def _expire_locked(self) -> None:
        deadline = self._clock() - self._limits.idle_ttl_s
        for session_id in [sid for sid, (_, used) in self._sessions.items() if used < deadline]:
            del self._sessions[session_id]
            self._kv_tokens.pop(session_id, None)
