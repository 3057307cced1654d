"""The test clusters' start-up retry (tests/ray_nodes.py): a failed start's processes are
killed and the start tried again; the last failure says what the session's logs hold."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.ray_nodes import descendants, start_with_retries, startup_report


def test_a_failed_start_is_cleaned_up_and_retried(tmp_path):
    logs = tmp_path / "session_2026-01-01_00-00-00_1" / "logs"
    logs.mkdir(parents=True)
    (logs / "gcs_server.out").write_text("started\nRegisterNode request count: 0\n")
    spawned = []

    def start():
        spawned.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        if len(spawned) < 3:
            raise Exception("The current node timed out during startup")  # noqa: TRY002 - as Ray raises
        return "started"

    assert start_with_retries(start, "the head node", tmp_path) == "started"
    assert [process.wait(timeout=10) for process in spawned[:2]] == [-9, -9]  # each failed start's child killed
    assert spawned[2].poll() is None  # the start that succeeded keeps its process
    spawned[2].kill()
    spawned[2].wait()


def test_the_last_failure_reports_the_session_logs(tmp_path):
    logs = tmp_path / "session_2026-01-01_00-00-00_1" / "logs"
    logs.mkdir(parents=True)
    (logs / "gcs_server.out").write_text("RegisterNode request count: 0\n")

    def start():
        raise Exception("The current node timed out during startup")  # noqa: TRY002

    with pytest.raises(RuntimeError, match=r"(?s)start 2 of 2 failed.*gcs_server.out: RegisterNode request count: 0"):
        start_with_retries(start, "the head node", tmp_path, attempts=2)


def test_a_report_without_a_session():
    assert startup_report(None) == "no session logs"
    assert descendants(2**22 + 1) == []  # a pid that cannot exist has no children
