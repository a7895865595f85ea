"""Grading's pure parts: which file diffs of a patch are dropped, and the signed report."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import subprocess
import sys
from pathlib import Path

from legorl.records import Task, read_jsonl
from legorl.verify import flags_from_turns
from legorl.verify.parsers import PytestReportParser
from legorl.verify.patches import sanitize, split_diff

ROOT = Path(__file__).resolve().parents[2]


def _diff(path: str, body: str = "+x = 1\n", new: bool = False) -> str:
    head = f"diff --git a/{path} b/{path}\n"
    if new:
        return head + f"new file mode 100644\n--- /dev/null\n+++ b/{path}\n@@ -0,0 +1 @@\n{body}"
    return head + f"--- a/{path}\n+++ b/{path}\n@@ -1 +1 @@\n-x = 0\n{body}"


TEST_PATCH = _diff("tests/test_geo.py", "+def test_new(): pass\n")


def test_code_changes_are_kept_everything_else_dropped_and_named() -> None:
    patch = "".join(
        [
            _diff("geo.py"),
            _diff("tests/test_geo.py"),
            _diff("conftest.py", new=True),
            _diff("pytest.ini"),
            _diff("sitecustomize.py", new=True),
            _diff("lib/evil.pth", new=True),
            _diff("pyproject.toml", "+addopts = '-k not test_area'\n"),
            _diff("setup.cfg", "+name = geo2\n"),
            _diff("test_helpers.py", new=True),
        ]
    )
    clean, dropped = sanitize(patch, TEST_PATCH)
    assert [d.path for d in split_diff(clean)] == ["geo.py", "setup.cfg"]
    assert dropped == [
        ("tests/test_geo.py", "tests_touched"),
        ("conftest.py", "runner_config_touched"),
        ("pytest.ini", "runner_config_touched"),
        ("sitecustomize.py", "runner_config_touched"),
        ("lib/evil.pth", "runner_config_touched"),
        ("pyproject.toml", "runner_config_touched"),
        ("test_helpers.py", "tests_touched"),
    ]


def test_a_file_at_a_hidden_test_path_is_dropped() -> None:
    patch = _diff("tests/test_geo.py", "+def test_new(): assert True\n", new=True)
    assert sanitize(patch, TEST_PATCH) == ("", [("tests/test_geo.py", "test_patch_path_created")])


def test_gold_patches_of_the_toy_set_are_kept_whole() -> None:
    for name in ("train.jsonl", "heldout.jsonl"):
        for task in read_jsonl(ROOT / "fixtures" / "tasks" / name, Task):
            assert sanitize(task.patch, task.test_patch) == (task.patch, []), task.instance_id


def _report(
    tmp_path: Path, test_src: str, key: str = "k3y"
) -> tuple[bytes, subprocess.CompletedProcess]:
    (tmp_path / "test_x.py").write_text(test_src)
    report = tmp_path / "report.jsonl"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src" / "legorl" / "verify"),
        "LEGORL_REPORT": str(report),
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "pytest_report",
            "-p",
            "no:cacheprovider",
            "-q",
            "test_x.py",
        ],
        cwd=tmp_path,
        env=env,
        input=key + "\n",
        text=True,
        capture_output=True,
        timeout=60,
    )
    return (report.read_bytes() if report.exists() else b""), proc


def test_the_report_is_signed_and_forged_lines_are_counted(tmp_path: Path) -> None:
    raw, _ = _report(
        tmp_path,
        "def test_ok():\n    pass\n\ndef test_bad():\n    assert 0\n"
        "def test_err(nope):\n    pass\n",
    )
    forged = json.dumps(
        {
            "r": {
                "event": "test",
                "nodeid": "test_x.py::test_bad",
                "when": "call",
                "outcome": "passed",
            },
            "mac": "0" * 64,
        }
    ).encode()
    results = PytestReportParser().parse(raw + forged + b"\nnot json\n", b"k3y")
    assert results.outcomes == {
        "test_x.py::test_ok": "passed",
        "test_x.py::test_bad": "failed",
        "test_x.py::test_err": "error",
    }
    assert results.forged_lines == 2 and results.finished
    # With another key nothing is trusted.
    assert PytestReportParser().parse(raw, b"other").outcomes == {}
    # The scheme the parser checks: HMAC-SHA256 of the record's sorted-key JSON. A line signed
    # so with the key is trusted; the same line under another key, or edited, is forged.
    record = {"event": "finish", "exitstatus": 3}
    body = json.dumps(record, sort_keys=True).encode()
    signed = {"r": record, "mac": hmac.new(b"k3y", body, hashlib.sha256).hexdigest()}
    trusted = PytestReportParser().parse(json.dumps(signed).encode() + b"\n", b"k3y")
    assert trusted.finished and trusted.exitstatus == 3 and trusted.forged_lines == 0
    other = PytestReportParser().parse(json.dumps(signed).encode() + b"\n", b"other")
    assert not other.finished and other.forged_lines == 1
    edited = {**signed, "r": {"event": "finish", "exitstatus": 0}}
    assert PytestReportParser().parse(json.dumps(edited).encode(), b"k3y").forged_lines == 1


def test_os_exit_in_code_under_test_leaves_tests_missing(tmp_path: Path) -> None:
    raw, proc = _report(
        tmp_path,
        "import os\n\ndef test_a():\n    pass\n\n"
        "def test_b():\n    os._exit(0)\n\ndef test_c():\n    pass\n",
    )
    results = PytestReportParser().parse(raw, b"k3y")
    assert proc.returncode == 0  # the exit code alone would say "all good"
    assert results.outcomes == {"test_x.py::test_a": "passed"} and not results.finished


def test_history_and_network_probing_is_flagged() -> None:
    from legorl.records import ToolCall, Turn, TurnOutput

    def turn(args: str) -> Turn:
        return Turn(
            session="s",
            turn=0,
            segment=0,
            api="openai_chat",
            model="m",
            prompt_offset=0,
            prompt_delta=[1],
            completion_ids=[2],
            completion_logprobs=[-1.0],
            finish_reason="tool_calls",
            output=TurnOutput(tool_calls=[ToolCall(id="c", name="bash", arguments=args)]),
        )

    assert flags_from_turns(
        [
            turn('{"command": "git log --all -p"}'),
            turn('{"command": "curl http://example.com/fix.patch"}'),
            turn('{"command": "cat geo.py"}'),
        ]
    ) == ["history_probing", "network_attempt"]
    assert flags_from_turns([turn('{"command": "grep -r area .git/objects"}')]) == [
        "history_probing"
    ]
    assert flags_from_turns([turn('{"command": "python -m pytest -q"}')]) == []
