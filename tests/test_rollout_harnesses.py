"""Real harnesses in Docker sandboxes through `legorl rollout`: Claude Code, OpenCode, Codex CLI,
the OpenHands SDK, Qwen Code and mini-swe-agent each fix a toy task's bug because the `forced` engine (a fake shipping in
the package: scripted completions, log-probs from a real forward pass of the tiny model) tells
them to run a shell command that makes the gold edit. The trajectory's patch must be the gold
fix, its status `ok`, its turns captured; Codex's also runs in the local (bubblewrap) backend
and is graded (reward 1). Under CI=true a missing Docker daemon or bwrap fails the test.
"""

from __future__ import annotations

import json
import os
import shutil
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


#: Each harness's shell tool: its name, and how its arguments hold the command.
_SHELL = {
    "claude-code": ("Bash", "command", {"description": "run it"}),
    "opencode": ("bash", "command", {"description": "run it"}),
    "codex": ("exec_command", "cmd", {}),
    "qwen-code": ("run_shell_command", "command", {"description": "run it"}),
    "mini-swe-agent": ("bash", "command", {}),
    "mini": ("bash", "command", {}),
    "openhands-sdk": ("terminal", "command", {}),
}
TITLE = {"match": "Generate a title", "text": "Fix the area", "repeat": True}


def shell_call(harness: str, command: str) -> str:
    """A completion that asks ``harness`` to run ``command`` with its shell tool."""
    name, key, extra = _SHELL[harness]
    return _call(name, {key: command, **extra})


def _script(harness: str, task: Task) -> list[dict]:
    if harness == "mini-swe-agent":
        last = "Done.\n" + shell_call(harness, "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")
    elif harness == "openhands-sdk":
        last = _call("finish", {"message": "The bug is fixed."})
    else:
        last = "The bug is fixed."
    return [
        TITLE,
        {"match": "rectangle_area", "text": shell_call(harness, _fix_command(task))},
        {"match": "legorl-fixed", "text": last, "repeat": True},
    ]


def _legorl(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "legorl.cli.main", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _rollout(
    tmp_path: Path, harness: str, sandbox: str = "docker"
) -> tuple[Task, Trajectory, list[Turn]]:
    task = _task()
    traj = rollout_with(tmp_path, harness, _script(harness, task), sandbox)
    assert traj.status == "ok", traj.evidence
    assert traj.patch == task.patch
    assert traj.turns_ref
    return task, traj, list(read_jsonl(tmp_path / traj.turns_ref[0], Turn))


def rollout_with(
    tmp_path: Path, harness: str, script: list[dict], sandbox: str = "docker"
) -> Trajectory:
    """`legorl rollout` of ``harness`` on the toy task, the forced engine playing ``script``."""
    if sandbox == "local" and shutil.which("bwrap") is None:
        missing = "bubblewrap (bwrap) is not installed (.ci/run installs it)"
    elif sandbox == "docker" and subprocess.run(["docker", "info"], capture_output=True).returncode:
        missing = "the Docker daemon is not running (.ci/run starts it)"
    else:
        missing = ""
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(missing)
        pytest.skip(missing)
    (tmp_path / "script.json").write_text(json.dumps(script))
    (tmp_path / "tasks.jsonl").write_text(
        next(ln for ln in (TASKS / "train.jsonl").read_text().splitlines() if TASK_ID in ln) + "\n"
    )
    (tmp_path / "repos").symlink_to(TASKS / "repos")
    result = _legorl(
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
        sandbox,
        "--served-model",
        "claude-sonnet-4-5",
        "--timeout",
        "400",
        "--out",
        "traj.jsonl",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (traj,) = read_jsonl(tmp_path / "traj.jsonl", Trajectory)
    return traj


@pytest.mark.parametrize(
    "harness", ["claude-code", "opencode", "openhands-sdk", "qwen-code", "mini-swe-agent"]
)
def test_real_harness_fixes_a_toy_task_in_docker(tmp_path: Path, harness: str) -> None:
    task, _, turns = _rollout(tmp_path, harness)
    main = [t for t in turns if not t.flags.aux]
    assert len(main) >= 2 and main[0].output.tool_calls
    assert all(len(t.completion_logprobs) == len(t.completion_ids) for t in turns)
    if harness in ("qwen-code", "mini-swe-agent"):
        _assert_exact_turns(main, _script(harness, task))


@pytest.mark.parametrize("sandbox", ["docker", "local"])
def test_codex_fixes_a_toy_task_and_verify_rewards_it(tmp_path: Path, sandbox: str) -> None:
    """Codex CLI on the Responses API, in either sandbox backend: the gold fix earns reward 1,
    and every Turn holds the engine's exact ids, the second prompt extending the first with its
    raw completion."""
    from legorl.proxy.tokens import ChatTokenizer
    from legorl.records import segment_prompts

    task, traj, turns = _rollout(tmp_path, "codex", sandbox)
    assert traj.harness == "codex"
    tok = ChatTokenizer(MODEL)
    script = _script("codex", task)
    main = [t for t in turns if not t.flags.aux]
    assert len(main) == 2 and not [t for t in turns if t.flags.aux]
    for turn, entry in zip(main, script[1:], strict=True):
        assert turn.api == "responses"
        assert turn.completion_ids == tok.encode(entry["text"]) + [tok.eos_id]
        assert len(turn.completion_logprobs) == len(turn.completion_ids)
    (_, p0), (_, p1) = segment_prompts(main)
    raw = p0 + main[0].completion_ids
    assert main[1].segment == 0 and p1[: len(raw)] == raw
    graded = _legorl(
        "verify", "traj.jsonl", "--tasks", "tasks.jsonl", "--out", "graded.jsonl", cwd=tmp_path
    )
    assert graded.returncode == 0, graded.stderr[-3000:]
    (result,) = read_jsonl(tmp_path / "graded.jsonl", Trajectory)
    assert result.reward == 1.0, result.verdict


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
