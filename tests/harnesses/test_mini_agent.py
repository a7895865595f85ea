"""The built-in `mini` agent against a real proxy: it reads, edits, submits, and compacts.

The engine is `forced` (a fake shipping in the package: scripted completions scored by the
real tiny model); the agent runs as a real subprocess in a real checkout of a toy task.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from legorl.records import Task, read_jsonl
from legorl.tasks import checkout

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "src" / "legorl" / "harnesses" / "mini_agent.py"
TASKS = ROOT / "fixtures" / "tasks"

sys.path.insert(0, str(ROOT / "tests" / "proxy"))
from proxy_harness import running_proxy  # noqa: E402


def gold_edit(task: Task) -> tuple[str, str, str]:
    """(path, old line, new line) of a one-line gold patch."""
    lines = task.patch.splitlines()
    path = next(ln[6:] for ln in lines if ln.startswith("+++ b/"))
    old = next(ln[1:] for ln in lines if ln.startswith("-") and not ln.startswith("---"))
    new = next(ln[1:] for ln in lines if ln.startswith("+") and not ln.startswith("+++"))
    return path, old, new


def call(name: str, **args: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def _agent(url: str, session: str, repo: Path, tmp: Path, task: Task, *extra: str):
    (tmp / "task.md").write_text(task.problem_statement)
    return subprocess.run(
        [
            sys.executable,
            str(AGENT),
            "--base-url",
            f"{url}/s/{session}/v1",
            "--task",
            str(tmp / "task.md"),
            "--cwd",
            str(repo),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def task_repo(tmp_path: Path) -> tuple[Task, Path]:
    task = next(
        t
        for t in read_jsonl(TASKS / "heldout.jsonl", Task)
        if t.instance_id == "legorl-toy__inventory-4"
    )
    return task, checkout(task, TASKS, tmp_path / "repo")


def test_mini_reads_edits_and_submits(tmp_path: Path, task_repo) -> None:
    task, repo = task_repo
    path, old, new = gold_edit(task)
    script = [
        {"match": "low_stock", "text": call("bash", command=f"cat {path}")},
        {"match": old.strip(), "text": call("edit", path=path, old=old.strip(), new=new.strip())},
        {"match": f"edited {path}", "text": call("submit")},
    ]
    with running_proxy(tmp_path / "turns", script) as proxy:
        result = _agent(proxy.url, "m1", repo, tmp_path, task)
        turns = proxy.turns("m1")
    assert result.returncode == 0, result.stderr
    assert new.strip() in (repo / path).read_text()
    assert [t.segment for t in turns] == [0, 0, 0]
    assert [t.output.tool_calls[0].name for t in turns] == ["bash", "edit", "submit"]


def test_mini_gives_up_and_reports_api_failures(tmp_path: Path, task_repo) -> None:
    task, repo = task_repo
    with running_proxy(tmp_path / "turns", [{"text": "I am not sure.", "repeat": True}]) as proxy:
        gave_up = _agent(proxy.url, "m2", repo, tmp_path, task, "--max-turns", "2")
    assert gave_up.returncode == 3 and "no submit within 2 turns" in gave_up.stderr
    failed = _agent("http://127.0.0.1:9", "m3", repo, tmp_path, task, "--max-turns", "2")
    assert failed.returncode == 4 and "the API failed" in failed.stderr


def test_mini_compaction_opens_a_new_segment(tmp_path: Path, task_repo) -> None:
    task, repo = task_repo
    script = [
        {"match": "Summarise what you found", "text": "I listed the files.", "repeat": True},
        {"match": "Progress so far", "text": call("submit")},
        {"text": call("bash", command="ls"), "repeat": True},
    ]
    with running_proxy(tmp_path / "turns", script) as proxy:
        result = _agent(proxy.url, "m4", repo, tmp_path, task, "--compact-tokens", "50")
        turns = proxy.turns("m4")
    assert result.returncode == 0, result.stderr
    # bash call, summary request (same segment, extends history), then the restarted history.
    assert [(t.session, t.segment) for t in turns] == [("m4", 0), ("m4", 0), ("m4", 1)]
    assert turns[1].output.text == "I listed the files."
    assert turns[2].segment_reason == "history rewritten at message 1"
