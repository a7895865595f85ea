"""`legorl loop --task-format`: the loop loads its train and held-out rows as that set publishes
them, and a prebuilt image that cannot be had stops it before any run, in one line.

SWE-Gym rows have SWE-bench's columns: only ``--task-format swegym`` tells them apart, and the
image each row runs on (``xingyaoww/…`` instead of ``swebench/…``) shows which adapter read
them. Real Docker daemon; no registry is reachable here, so the pull fails as it would for a
user offline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, docker_backend

from legorl.loop import LoopConfig, LoopConfigError
from legorl.records import Task, read_jsonl

MODEL = ROOT / "fixtures" / "models" / "tiny-qwen3"
COLUMNS = [
    "instance_id",
    "repo",
    "base_commit",
    "problem_statement",
    "test_patch",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
    "version",
    "environment_setup_commit",
]


def _swebench_rows(folder: Path) -> Path:
    """train.jsonl and heldout.jsonl of SWE-bench-shaped rows (no image column), as HF has
    them: the test lists as JSON text."""
    folder.mkdir()
    tasks = list(read_jsonl(ROOT / "fixtures" / "tasks" / "train.jsonl", Task))[:2]
    for split, task in zip(("train", "heldout"), tasks, strict=True):
        row = {k: getattr(task, k) for k in COLUMNS}
        row["FAIL_TO_PASS"] = json.dumps(row["FAIL_TO_PASS"])
        row["PASS_TO_PASS"] = json.dumps(row["PASS_TO_PASS"])
        (folder / f"{split}.jsonl").write_text(json.dumps(row) + "\n")
    return folder


def _loop(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "legorl.cli.main", "loop", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "COLUMNS": "300"},
    )


def test_an_unknown_task_format_is_refused_naming_the_flag(tmp_path: Path) -> None:
    tasks = _swebench_rows(tmp_path / "rows")
    done = _loop(
        "--model", str(MODEL), "--tasks-dir", str(tasks), "--task-format", "nope", cwd=tmp_path
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("legorl loop: error: --task-format"), lines
    assert "swegym" in lines[0]
    try:
        LoopConfig(model=MODEL, tasks_dir=tasks, task_format="nope").validate()
    except LoopConfigError as exc:
        assert exc.field == "task_format"
    else:
        raise AssertionError("an unknown task_format passed validation")


def test_the_rows_load_as_the_named_set_and_a_missing_image_stops_the_loop(
    tmp_path: Path,
) -> None:
    docker_backend()  # a daemon to ask for the image (skips without one, fails under CI)
    tasks = _swebench_rows(tmp_path / "rows")
    first = next(iter(read_jsonl(ROOT / "fixtures" / "tasks" / "train.jsonl", Task))).instance_id
    seen = {}
    for fmt, owner in [(None, "swebench/"), ("swegym", "xingyaoww/")]:
        args = ["--model", str(MODEL), "--tasks-dir", str(tasks), "--sandbox", "docker"]
        args += ["--iterations", "1", "--tasks-per-iteration", "1", "--eval-samples", "1"]
        args += ["--out", f"run-{fmt}"] + (["--task-format", fmt] if fmt else [])
        done = _loop(*args, cwd=tmp_path)
        assert done.returncode == 1, done.stderr[-2000:]
        errors = [ln for ln in done.stderr.splitlines() if "error:" in ln]
        assert len(errors) == 1, done.stderr[-2000:]
        assert "is not present and cannot be pulled" in errors[0]
        assert f"{owner}sweb.eval.x86_64." in errors[0], errors[0]
        seen[fmt] = errors[0]
        assert not list((tmp_path / f"run-{fmt}").glob("**/*.jsonl")), "a run started"
    assert first.split("__")[0] in seen[None].replace("_1776_", "__")
