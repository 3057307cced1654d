"""The speculation loop and its policies — the serving path's model-free half.

:mod:`~disco.speculation.loop` is the one speculation loop (draft, verify, accept) over
the ``Drafter`` / ``Verifier`` interfaces; :mod:`~disco.speculation.sampling` the
verification math (greedy acceptance, drafter-invariant seeded sampling); :mod:`~disco.speculation.policies`
the stop policies that run in the draft's loop, with their per-token
:mod:`~disco.speculation.signals` and :mod:`~disco.speculation.features`;
:mod:`~disco.speculation.cost_model` the deployment's costs the ``auto`` rule weighs;
:mod:`~disco.speculation.detokenize` incremental text.

May import: the modules directly in :mod:`disco`. Never :mod:`disco.models`,
:mod:`disco.engines` or :mod:`disco.offline`.
"""
