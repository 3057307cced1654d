"""The draft and target engines: sessions, KV caches and the forwards they run.

:mod:`~disco.engines.draft` (drafting loop, stop policy per token) and
:mod:`~disco.engines.target` (prefill, block verification) over per-session
:mod:`~disco.engines.kv` caches held in a :mod:`~disco.engines.sessions` store;
:mod:`~disco.engines.batching` runs concurrent sessions as one
:mod:`~disco.engines.packed_forward`, where :mod:`~disco.engines.packing_proof` shows it
exact on this machine; :mod:`~disco.engines.predraft` drafts ahead (overlap);
:mod:`~disco.engines.engine_costs` measures what a forward costs;
:mod:`~disco.engines.in_process` builds the in-process pair for the loop.

May import: :mod:`disco`'s own modules, :mod:`disco.speculation`, :mod:`disco.models`.
Never :mod:`disco.offline`.
"""
