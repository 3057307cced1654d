"""The ``disco`` command line and the benchmarks: the top layer, imported by nothing.

:mod:`disco_cli.main` is the ``disco`` entry point (one parser, one error handler);
:mod:`disco_cli.commands` holds one module per group of subcommands (serving, clients,
models, DISCO's offline commands, Ray deployments, benchmarks); :mod:`disco_cli.bench`
the benchmark harnesses and their peers; :mod:`disco_cli.launcher` starts the three
services as local processes (``disco serve``, ``disco demo``, the benchmarks).
"""
