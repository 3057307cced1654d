"""disco-serve shared core: pure Python + torch + numpy + scikit-learn, no grpc, no ray.

Directly here: the vocabulary every layer shares — :mod:`disco.config` (frozen config
dataclasses), :mod:`disco.errors` (domain errors), :mod:`disco.interfaces` (the
``Drafter`` / ``Verifier`` interfaces and their messages), :mod:`disco.stats` (request
statistics) and :mod:`disco.platform` (what the CPU computes fast; no torch import).

Sub-packages, by concern, lowest first (``tests/test_layers.py`` holds the arrows):

* :mod:`disco.speculation` — the speculation loop, verification math and the stop
  policies (DISCO's classifier included). Model-free: it sees engines only through
  the interfaces.
* :mod:`disco.models` — getting models and their numerics: loading, the default pair,
  GGUF conversion, the int8/int4 weight-only linears, row-stable call plans.
* :mod:`disco.engines` — the draft and target engines: sessions, KV caches, packed
  cross-session forwards, measured engine costs, the in-process pair.
* :mod:`disco.offline` — DISCO's offline tooling: oracle records, training, replay,
  reports, datasets. Nothing on the serving path imports it.
"""

__version__ = "0.1.0"
