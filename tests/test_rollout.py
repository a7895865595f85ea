"""`legorl rollout`: tasks × G runs through the proxy in sandboxes, statuses, resume after kill.

Agents here are the built-in `mini` harness driven by the `forced` engine (a fake shipping in
the package: scripted completions, log-probs from a real forward pass of the tiny model) and
the `scripted` harness (a fake shipping in the package: one shell command as the agent).
Sandboxes are the real `local` (bubblewrap) backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_task, sandbox_backend

from legorl.engines import make_engine
from legorl.harnesses.testing import ScriptedHarness
from legorl.records import Task, Trajectory, Turn, read_jsonl
from legorl.rollout import inprocess_proxy, plan_runs
from legorl.sandbox import make_backend
from legorl.verify.redteam import honest

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "fixtures" / "tasks"
MODEL = ROOT / "fixtures" / "models" / "tiny-qwen3"


def _tasks() -> list[Task]:
    return list(read_jsonl(TASKS / "train.jsonl", Task))


def _cli(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "legorl.cli.main", "rollout", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_groups_of_runs_write_trajectories_with_turns_and_patches(tmp_path: Path) -> None:
    # One run at a time, in plan order: each run takes its own task's scripted gold fix.
    script = [entry for task in _tasks()[:4] for _ in range(2) for entry in honest(task)]
    (tmp_path / "script.json").write_text(json.dumps(script))
    args = [
        "--tasks",
        str(TASKS / "train.jsonl"),
        "--harness",
        "mini",
        "--group-size",
        "2",
        "--limit",
        "4",
        "--engine",
        "forced",
        "--script",
        str(tmp_path / "script.json"),
        "--model",
        str(MODEL),
        "--sandbox",
        "local",
        "--out",
        "traj.jsonl",
    ]
    first = _cli(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    trajs = list(read_jsonl(tmp_path / "traj.jsonl", Trajectory))
    assert len(trajs) == 8
    assert sorted(t.trajectory_id for t in trajs) == sorted(
        f"{t.instance_id}.{k}" for t in _tasks()[:4] for k in range(2)
    )
    for traj in trajs:
        assert traj.status == "ok" and traj.group_id == traj.task_id
        turns = list(read_jsonl(tmp_path / traj.turns_ref[0], Turn))
        assert [t.output.tool_calls[0].name for t in turns] == ["edit", "submit"]
        assert traj.tokens.completion == sum(len(t.completion_ids) for t in turns)
    by_id = {t.instance_id: t for t in _tasks()}
    for traj in trajs:
        assert traj.patch == by_id[traj.task_id].patch, traj.trajectory_id
    again = _cli(*args, cwd=tmp_path)
    assert again.returncode == 0
    assert "8 run(s) already in traj.jsonl, skipped" in again.stderr
    assert len(list(read_jsonl(tmp_path / "traj.jsonl", Trajectory))) == 8


async def _one(
    tmp: Path, harness, task: Task, timeout: float = 60, script: list[dict] | None = None
) -> Trajectory:
    engine = make_engine("forced", model_path=str(MODEL), script=script or [])
    try:
        async with inprocess_proxy(MODEL, engine, tmp / "turns") as (endpoint, _):
            return await run_task(
                task,
                harness,
                make_backend("local"),
                endpoint,
                refs=tmp,
                timeout=timeout,
                wall_s=120,
                run_id="legorl-test-status",
            )
    finally:
        await engine.close()


@pytest.mark.parametrize(
    ("command", "status"),
    [
        ("kill -SEGV $$", "harness_crash"),
        ("echo boom >&2; exit 1", "harness_crash"),
        ("sleep 600", "timeout"),
    ],
)
def test_harness_crashes_and_hangs_get_their_status(
    tmp_path: Path, command: str, status: str
) -> None:
    traj = asyncio.run(_one(tmp_path, ScriptedHarness(command=command), _tasks()[0], timeout=5))
    assert traj.status == status
    assert traj.reward is None
    assert "exit_code" in traj.evidence


def test_a_sandbox_that_cannot_start_is_an_environment_failure(tmp_path: Path) -> None:
    ghost = dataclasses.replace(
        _tasks()[0], instance_id="legorl-toy__ghost-1", source="repos/missing.bundle"
    )
    traj = asyncio.run(_one(tmp_path, ScriptedHarness(), ghost))
    assert traj.status == "sandbox_error"
    assert "missing.bundle" in traj.evidence["error"]


def test_a_harness_that_never_calls_the_model_is_a_proxy_error(tmp_path: Path) -> None:
    traj = asyncio.run(_one(tmp_path, ScriptedHarness(command="true"), _tasks()[0]))
    assert traj.status == "proxy_error"


# The scripted agent calls its session once per word, as a harness would, then exits 1: a
# crash it claims. The forced engine answers "first" and fails any other call (503).
_ASK = (
    "python3 -c 'import json, sys, urllib.request as u\n"
    "for word in sys.argv[2:]:\n"
    '    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": word}]})\n'
    '    req = u.Request(sys.argv[1], body.encode(), {"content-type": "application/json"})\n'
    "    try:\n"
    "        print(word, u.urlopen(req, timeout=60).status)\n"
    "    except u.HTTPError as err:\n"
    "        print(word, err.code)\n"
    '\' "$LEGORL_PROXY_URL/v1/chat/completions" {words}; exit 1'
)


@pytest.mark.parametrize(
    ("words", "status"),
    [
        ("first", "harness_error"),  # the policy answered, then the harness "crashed"
        ("second first", "harness_error"),  # the engine failed, but the policy answered since
        ("first second", "harness_crash"),  # control: the engine failed the last call
        ("second", "harness_crash"),  # control: the policy never answered
    ],
)
def test_a_claimed_crash_stands_only_where_the_proxy_backs_it(
    tmp_path: Path, words: str, status: str
) -> None:
    harness = ScriptedHarness(command=_ASK.replace("{words}", words))
    script = [{"match": "first", "text": "ok", "repeat": True}]
    traj = asyncio.run(_one(tmp_path, harness, _tasks()[0], script=script))
    assert traj.status == status, traj.evidence
    assert traj.evidence["exit_code"] == 1
    assert traj.evidence["log_tail"].split() == [
        w for word in words.split() for w in (word, "200" if word == "first" else "503")
    ]
    if status == "harness_error":
        why = traj.evidence["uncorroborated"]
        assert "reported harness_crash after 1 completion(s)" in why, why
    else:
        assert "corroborated" in traj.evidence and "uncorroborated" not in traj.evidence


def test_plan_skips_done_runs_and_respects_limit() -> None:
    tasks = _tasks()[:3]
    runs = plan_runs(tasks, 2, 2, {f"{tasks[0].instance_id}.1"})
    assert [r.trajectory_id for r in runs] == [
        f"{tasks[0].instance_id}.0",
        f"{tasks[1].instance_id}.0",
        f"{tasks[1].instance_id}.1",
    ]


def _docker_boxes_of(pid: int) -> list[str]:
    """Containers (any state) labelled as started by process ``pid`` of this host."""
    listed = subprocess.run(
        ["docker", "ps", "-a", "--filter", "label=legorl.owner",
         "--format", '{{.ID}} {{.Label "legorl.owner"}}'],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    host = socket.gethostname()
    found = []
    for line in listed.stdout.splitlines():
        cid, _, owner = line.partition(" ")
        if owner.split(":")[:2] == [host, str(pid)]:
            found.append(cid)
    return found


@pytest.mark.parametrize("sandbox", ["local", "docker"])
def test_kill_9_mid_run_then_resume_loses_nothing(tmp_path: Path, sandbox: str) -> None:
    if sandbox == "docker":
        sandbox_backend("docker")  # skips, or fails under CI, without a daemon
    # Slow agents (a scripted sleep) so the kill lands while runs are in flight.
    args = [
        "--tasks",
        str(TASKS / "train.jsonl"),
        "--harness",
        "legorl.harnesses.testing:ScriptedHarness",
        "--harness-opt",
        "command=sleep 2; exit 1",
        "--group-size",
        "1",
        "--limit",
        "6",
        "--concurrency",
        "2",
        "--engine",
        "forced",
        "--model",
        str(MODEL),
        "--sandbox",
        sandbox,
        "--out",
        "traj.jsonl",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "legorl.cli.main", "rollout", *args],
        cwd=tmp_path,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    out = tmp_path / "traj.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (
        not out.exists() or len(out.read_bytes().splitlines()) < 2
    ):
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = [t.trajectory_id for t in read_jsonl(out, Trajectory, skip_bad=True)]
    assert 2 <= len(before) < 6
    # The killed process's own sandboxes (their folders name it as owner), none of anyone else's
    from legorl.sandbox.common import state_root

    def owned_by_killed() -> list[str]:
        if sandbox == "docker":
            return _docker_boxes_of(proc.pid)
        found = []
        for owner in state_root().glob("legorl-*/owner.json"):
            with contextlib.suppress(OSError, ValueError):
                if json.loads(owner.read_text())["owner"].split(":")[1] == str(proc.pid):
                    found.append(owner.parent.name)
        return found

    killed_boxes = owned_by_killed()
    assert killed_boxes, "the kill landed while no sandbox was running"
    resumed = _cli(*args, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    after = [t.trajectory_id for t in read_jsonl(out, Trajectory, skip_bad=True)]
    assert after[: len(before)] == before and sorted(set(after)) == sorted(after)
    assert len(after) == 6
    # Sandboxes of the killed process were cleaned up by the next start: folders and processes.
    assert owned_by_killed() == []
    for name in killed_boxes if sandbox == "local" else ():
        left = subprocess.run(["pgrep", "-f", name], capture_output=True, text=True)
        assert left.stdout.strip() == "", f"{name} still runs"
    # Resuming a finished run runs nothing and writes nothing.
    finished = out.read_bytes()
    again = _cli(*args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert out.read_bytes() == finished


def test_strict_stops_the_stage_at_the_first_alert_and_keeps_what_was_written(
    tmp_path: Path,
) -> None:
    # Every run crashes (the scripted agent exits 1): past the monitor's minimum of 10 runs the
    # crash rate is 100% > 20%. With --strict the stage stops there; without, it runs to the end.
    args = [
        "--tasks", str(TASKS / "train.jsonl"),
        "--harness", "legorl.harnesses.testing:ScriptedHarness",
        "--harness-opt", "command=exit 1",
        "--group-size", "2", "--limit", "7",
        "--engine", "forced", "--model", str(MODEL), "--sandbox", "local",
    ]  # fmt: skip
    strict = _cli(*args, "--out", "strict/traj.jsonl", "--strict", cwd=tmp_path)
    assert strict.returncode == 1
    last = strict.stderr.strip().splitlines()[-1]
    assert last.startswith("legorl rollout: error: ") and "[crash_rate]" in last, last
    kept = list(read_jsonl(tmp_path / "strict" / "traj.jsonl", Trajectory))
    assert 10 <= len(kept) < 14 and {t.status for t in kept} == {"harness_crash"}
    alerts = [
        json.loads(x) for x in (tmp_path / "strict" / "alerts.jsonl").read_text().splitlines()
    ]
    assert [a["kind"] for a in alerts] == ["crash_rate"]
    lenient = _cli(*args, "--out", "lenient/traj.jsonl", cwd=tmp_path)
    assert lenient.returncode == 0, lenient.stderr[-2000:]
    assert len(list(read_jsonl(tmp_path / "lenient" / "traj.jsonl", Trajectory))) == 14
    assert "crash_rate" in (tmp_path / "lenient" / "alerts.jsonl").read_text()
