"""`legorl verify` on real Docker: gold → 1, empty → 0, a patch that does not apply → 0 with
the reason, environment failures pass through with reward null, bad lines name file:line; and
the whole shell pipeline `rollout | verify | align | train` on the toy set.

Agents are the built-in `mini` harness driven by the `forced` engine (a fake shipping in the
package: scripted completions, log-probs from a real forward pass of the tiny model).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from legorl.records import Metric, Task, Trajectory, read_jsonl, write_jsonl
from legorl.verify.redteam import honest

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "fixtures" / "tasks"
MODEL = ROOT / "fixtures" / "models" / "tiny-qwen3"


def _need_docker() -> None:
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("the Docker daemon is not running (.ci/run starts it)")
        pytest.skip("no Docker daemon")


def _legorl(*args: str, cwd: Path, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "legorl.cli.main", *args],
        cwd=cwd,
        input=stdin,
        capture_output=True,
        timeout=600,
    )


def _traj(task: Task, tid: str, patch: str, status: str = "ok") -> Trajectory:
    return Trajectory(
        trajectory_id=tid,
        task_id=task.instance_id,
        group_id=task.instance_id,
        sample_index=0,
        harness="scripted",
        status=status,
        patch=patch,
    )


def test_gold_empty_broken_and_environment_failures(tmp_path: Path) -> None:
    _need_docker()
    task = next(iter(read_jsonl(TASKS / "train.jsonl", Task)))
    broken = (
        "diff --git a/geometry.py b/geometry.py\n--- a/geometry.py\n+++ b/geometry.py\n"
        "@@ -1,1 +1,1 @@\n-this line is not in the file\n+neither is this\n"
    )
    write_jsonl(
        tmp_path / "in.jsonl",
        [
            _traj(task, "gold", task.patch),
            _traj(task, "empty", ""),
            _traj(task, "broken", broken),
            _traj(task, "crashed", "", status="sandbox_error"),
        ],
    )
    result = _legorl(
        "verify",
        "in.jsonl",
        "--tasks",
        str(TASKS / "train.jsonl"),
        "--out",
        "graded.jsonl",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr.decode()
    graded = {t.trajectory_id: t for t in read_jsonl(tmp_path / "graded.jsonl", Trajectory)}
    assert graded["gold"].reward == 1.0 and graded["gold"].verdict["patch_apply"] == "git_apply"
    assert set(graded["gold"].verdict["tests"].values()) == {"passed"}
    assert graded["empty"].reward == 0.0
    assert graded["empty"].verdict["tests"][task.FAIL_TO_PASS[0]] == "failed"
    assert graded["broken"].reward == 0.0
    assert graded["broken"].verdict["reason"].startswith("the patch does not apply")
    assert graded["crashed"].reward is None and graded["crashed"].status == "sandbox_error"
    assert "1 resolved" in result.stderr.decode()


def test_bad_input_lines_name_file_and_line(tmp_path: Path) -> None:
    task = next(iter(read_jsonl(TASKS / "train.jsonl", Task)))
    write_jsonl(tmp_path / "in.jsonl", [_traj(task, "a", "")])
    with open(tmp_path / "in.jsonl", "ab") as fh:
        fh.write(b'{"schema": "legorl/trajectory@1", "trajectory_id": 3}\n')
    bad = _legorl("verify", "in.jsonl", "--tasks", str(TASKS / "train.jsonl"), cwd=tmp_path)
    assert bad.returncode == 1
    line = bad.stderr.decode().strip()
    assert line.startswith("legorl verify: error: in.jsonl:2: ") and "\n" not in line
    unknown = (
        json.dumps(
            {
                "schema": "legorl/trajectory@1",
                "trajectory_id": "x",
                "task_id": "nope",
                "group_id": "g",
                "sample_index": 0,
                "harness": "h",
                "status": "ok",
            }
        ).encode()
        + b"\n"
    )
    missing = _legorl("verify", "--tasks", str(TASKS / "train.jsonl"), cwd=tmp_path, stdin=unknown)
    assert missing.returncode == 1 and b"not in" in missing.stderr


def test_rollout_verify_align_train_pipe_in_the_shell(tmp_path: Path) -> None:
    _need_docker()
    tasks = list(read_jsonl(TASKS / "train.jsonl", Task))[:2]
    # Two samples per task: the first fixes its bug, the second submits without a change.
    submit = honest(tasks[0])[-1]
    script = []
    for task in tasks:
        script += honest(task) + [submit]
    (tmp_path / "script.json").write_text(json.dumps(script))
    legorl = f"{sys.executable} -m legorl.cli.main"
    pipe = (
        f"{legorl} rollout --tasks {TASKS}/train.jsonl --harness mini --group-size 2 --limit 2 "
        f"--engine forced --script script.json --model {MODEL} --sandbox local"
        f" | {legorl} verify --tasks {TASKS}/train.jsonl"
        f" | {legorl} align --model {MODEL}"
        f" | {legorl} train --model {MODEL} --out ckpt --metrics metrics.jsonl"
    )
    result = subprocess.run(
        ["bash", "-o", "pipefail", "-c", pipe], cwd=tmp_path, capture_output=True, timeout=900
    )
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    assert (tmp_path / "ckpt" / "model.safetensors").exists()
    metrics = {m.name: m.value for m in read_jsonl(tmp_path / "metrics.jsonl", Metric)}
    assert metrics["reward_mean"] == pytest.approx(0.5)
    assert metrics["rollout_trainer_pearson"] > 0.99
