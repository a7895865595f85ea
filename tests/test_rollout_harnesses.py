"""Real harnesses in Docker sandboxes through `legorl rollout`: Claude Code, OpenCode, the
OpenHands SDK, Qwen Code and mini-swe-agent each fix a toy task's bug because the `forced` engine (a fake shipping in the
package: scripted completions, log-probs from a real forward pass of the tiny model) tells them
to run a shell command that makes the gold edit. The trajectory's patch must be the gold fix,
its status `ok`, its turns captured. Under CI=true a missing Docker daemon fails the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from legorl.records import Task, Trajectory, Turn, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "fixtures" / "tasks"
MODEL = ROOT / "fixtures" / "models" / "tiny-qwen3"
TASK_ID = "legorl-toy__geometry-1"


def _task() -> Task:
    return next(t for t in read_jsonl(TASKS / "train.jsonl", Task) if t.instance_id == TASK_ID)


def _fix_command(task: Task) -> str:
    lines = task.patch.splitlines()
    path = next(ln[6:] for ln in lines if ln.startswith("+++ b/"))
    old = next(ln[1:] for ln in lines if ln.startswith("-") and not ln.startswith("---"))
    new = next(ln[1:] for ln in lines if ln.startswith("+") and not ln.startswith("+++"))
    program = f"p={path!r}; s=open(p).read(); open(p, 'w').write(s.replace({old!r}, {new!r}, 1))"
    return f"python3 -c {json.dumps(program)} && echo legorl-fixed"


def _call(name: str, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def _script(harness: str, task: Task) -> list[dict]:
    command = _fix_command(task)
    title = {"match": "Generate a title", "text": "Fix the area", "repeat": True}
    if harness == "claude-code":
        first = _call("Bash", {"command": command, "description": "apply the fix"})
        last = "The bug is fixed."
    elif harness == "opencode":
        first = _call("bash", {"command": command, "description": "apply the fix"})
        last = "The bug is fixed."
    elif harness == "qwen-code":
        first = _call("run_shell_command", {"command": command, "description": "apply the fix"})
        last = "The bug is fixed."
    elif harness == "mini-swe-agent":
        first = _call("bash", {"command": command})
        last = "Done.\n" + _call("bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"})
    else:
        first = _call("terminal", {"command": command})
        last = _call("finish", {"message": "The bug is fixed."})
    return [
        title,
        {"match": "rectangle_area", "text": first},
        {"match": "legorl-fixed", "text": last, "repeat": True},
    ]


@pytest.mark.parametrize(
    "harness", ["claude-code", "opencode", "openhands-sdk", "qwen-code", "mini-swe-agent"]
)
def test_real_harness_fixes_a_toy_task_in_docker(tmp_path: Path, harness: str) -> None:
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("the Docker daemon is not running (.ci/run starts it)")
        pytest.skip("no Docker daemon")
    task = _task()
    (tmp_path / "script.json").write_text(json.dumps(_script(harness, task)))
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
            harness,
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
            "claude-sonnet-4-5",
            "--timeout",
            "400",
            "--out",
            "traj.jsonl",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (traj,) = read_jsonl(tmp_path / "traj.jsonl", Trajectory)
    assert traj.status == "ok", traj.evidence
    assert traj.patch == task.patch
    assert traj.turns_ref
    turns = list(read_jsonl(tmp_path / traj.turns_ref[0], Turn))
    main = [t for t in turns if not t.flags.aux]
    assert len(main) >= 2 and main[0].output.tool_calls
    assert all(len(t.completion_logprobs) == len(t.completion_ids) for t in turns)
    if harness in ("qwen-code", "mini-swe-agent"):
        _assert_exact_turns(main, _script(harness, task))


def _assert_exact_turns(main: list[Turn], script: list[dict]) -> None:
    """The Turns hold the engine's exact ids, and the second call's prompt holds the first
    completion's raw tokens (not a re-tokenisation of the harness's re-serialised history)."""
    from legorl.proxy.tokens import ChatTokenizer
    from legorl.records import segment_prompts

    tok = ChatTokenizer(MODEL)
    assert len(main) == 2, [t.output.text for t in main]
    for turn, entry in zip(main, script[1:], strict=True):
        assert turn.completion_ids == tok.encode(entry["text"]) + [tok.eos_id]
    assert [t.segment for t in main] == [0, 0]
    (_, p0), (_, p1) = segment_prompts(main)
    raw = p0 + main[0].completion_ids
    assert p1[: len(raw)] == raw, "the second prompt does not hold the first completion's tokens"
