"""DISCO's offline tooling: teacher-forced oracle records, classifier training, replay
of any stop policy on the records, reports, the prompt datasets and overlap estimates
(``disco records/train/replay/report``; docs/disco.md).

May import everything else in :mod:`disco`; nothing in :mod:`disco` but this package
imports it (the serving path never does).
"""
