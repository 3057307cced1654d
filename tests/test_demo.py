"""`disco demo` (the README's main job) end to end on tiny models: three real server
processes, a streamed completion, the baseline comparison, everything stopped."""

import pytest

from disco_cli.main import main


def test_demo_streams_and_compares(tiny_pair_dirs, capsys):
    code = main(["demo", "--target", str(tiny_pair_dirs["target"]), "--draft", str(tiny_pair_dirs["draft"]),
                 "--dtype", "float32", "--prompt", "def add(a, b):", "--max-new-tokens", "16"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out.startswith("def add(a, b):")
    assert "tokens identical to none: yes" in captured.err
    assert "acceptance" in captured.err


def _stats(draft_forwards: int, tokens_per_s: float):
    from disco.stats import RequestStats

    return RequestStats(generated_tokens=64, wall_s=64 / tokens_per_s, draft_forwards=draft_forwards)


def test_a_policy_that_drafted_nothing_reports_no_speedup_and_says_why():
    """``auto`` that ran target-only (the costs said no draft pays) is two target-only runs:
    the line says so, with the costs, and prints no speedup (issue: a 1.06x of noise)."""
    from disco_cli.commands.demo import comparison_line, costs_text

    models = {"target": {"forward_s": [0.0439, 0.0535, 0.0615, 0.0816, 0.0928, 0.1]},
              "draft": {"forward_s": [0.0233]}}
    costs = costs_text(models)
    assert costs == ("the costs auto decided with: target 43.9 ms for 1 new token, 92.8 ms for 5; "
                     "draft 23.3 ms per token, 0.53 of a one-token target forward")
    line = comparison_line("auto", "none", _stats(0, 18.4), _stats(0, 17.35), True, costs)
    assert "x (" not in line and "no speedup to report" in line and "auto drafted nothing: it ran target-only" in line
    assert costs in line and "18.40 vs 17.35 tok/s is the spread between two target-only runs" in line
    drafted = comparison_line("auto", "none", _stats(20, 24.0), _stats(0, 16.0), True, costs)
    assert drafted == "tokens identical to none: yes; speedup 1.50x (24.00 vs 16.00 tok/s)"
    assert costs_text({"target": None, "draft": None}) == "the services reported no measured costs"
