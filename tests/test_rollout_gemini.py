"""Gemini CLI in a Docker sandbox through `legorl rollout --harness gemini-cli`: the `forced`
engine (a fake shipping in the package: scripted completions, log-probs from a real forward
pass of the tiny model) tells it to run the shell command that makes a toy task's gold edit.
The trajectory's patch must be the gold fix with reward 1, and its main Turns must hold the
engine's exact token ids, the second prompt beginning with the first prompt and completion.
The binary comes from the sandbox's harness-runtime layer. Under CI=true a missing Docker
daemon fails the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_rollout_harnesses import MODEL, TASK_ID, TASKS, _call, _fix_command, _task

from legorl.proxy.tokens import ChatTokenizer
from legorl.records import Trajectory, Turn, read_jsonl, segment_prompts


def test_gemini_cli_fixes_a_toy_task_in_docker(tmp_path: Path) -> None:
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("the Docker daemon is not running (.ci/run starts it)")
        pytest.skip("no Docker daemon")
    task = _task()
    script: list[dict[str, Any]] = [
        {
            "match": "rectangle_area",
            "text": _call("run_shell_command", {"command": _fix_command(task)}),
        },
        {"match": "legorl-fixed", "text": "The bug is fixed.", "repeat": True},
    ]
    (tmp_path / "script.json").write_text(json.dumps(script))
    (tmp_path / "tasks.jsonl").write_text(
        next(ln for ln in (TASKS / "train.jsonl").read_text().splitlines() if TASK_ID in ln) + "\n"
    )
    (tmp_path / "repos").symlink_to(TASKS / "repos")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "legorl.cli.main",
            "rollout",
            "--tasks",
            "tasks.jsonl",
            "--harness",
            "gemini-cli",
            "--engine",
            "forced",
            "--script",
            "script.json",
            "--engine-opt",
            "max_context=200000",
            "--model",
            str(MODEL),
            "--sandbox",
            "docker",
            "--served-model",
            "gemini-2.5-pro",
            "--timeout",
            "600",
            "--out",
            "traj.jsonl",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (traj,) = read_jsonl(tmp_path / "traj.jsonl", Trajectory)
    assert traj.status == "ok", traj.evidence
    assert traj.patch == task.patch
    graded = subprocess.run(
        [
            *(sys.executable, "-m", "legorl.cli.main", "verify", "traj.jsonl"),
            *("--tasks", "tasks.jsonl", "--out", "graded.jsonl"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert graded.returncode == 0, graded.stderr[-3000:]
    (verified,) = read_jsonl(tmp_path / "graded.jsonl", Trajectory)
    assert verified.reward == 1.0, verified.verdict
    assert traj.turns_ref
    turns = list(read_jsonl(tmp_path / traj.turns_ref[0], Turn))
    main = [t for t in turns if not t.flags.aux]
    assert len(main) == 2 and all(t.api == "gemini" for t in main)
    tok = ChatTokenizer(MODEL)
    for turn, entry in zip(main, script, strict=True):
        assert turn.completion_ids == tok.encode(str(entry["text"])) + [tok.eos_id]
        assert len(turn.completion_logprobs) == len(turn.completion_ids)
    (_, p0), (_, p1) = segment_prompts(main)
    assert p1[: len(p0) + len(main[0].completion_ids)] == p0 + main[0].completion_ids
