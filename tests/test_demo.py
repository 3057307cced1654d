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
