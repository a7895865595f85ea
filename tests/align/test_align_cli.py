"""`legorl align` as a real subprocess: stdin and files, turns_ref relative to the right folder,
the JSON summary, `--check`'s exit status, and one-line errors with their exit codes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from align_sessions import MODEL, Captured, capture_once

from legorl.align import AlignStats, align
from legorl.records import Sample, Trajectory, read_jsonl, to_json, write_jsonl

ROOT = Path(__file__).resolve().parents[2]

#: The README's align example, run as written from a folder holding tests/data and fixtures.
# The align examples exactly as the README shows them.
README_EXAMPLE = [
    line.strip()
    for line in (Path(__file__).resolve().parents[2] / "README.md").read_text().splitlines()
    if line.startswith("legorl align tests/data/align") and "|" not in line
]


def legorl(*args: str, stdin: bytes = b"", cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "legorl.cli.main", "align", *args],
        input=stdin,
        capture_output=True,
        cwd=cwd,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"},
        timeout=120,
    )


@pytest.fixture
def folder(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Path:
    """A private copy of the captured sessions: trajectories.jsonl and turns/."""
    cap: Captured = capture_once(tmp_path_factory)
    shutil.copytree(cap.folder, tmp_path / "run")
    return tmp_path / "run"


def _stderr_lines(result: subprocess.CompletedProcess) -> list[str]:
    return result.stderr.decode().strip().splitlines()


def test_stdin_to_stdout_reads_turns_relative_to_the_cwd(folder: Path) -> None:
    data = (folder / "trajectories.jsonl").read_bytes()
    result = legorl(stdin=data, cwd=folder)
    assert result.returncode == 0, result.stderr.decode()
    trajs = list(read_jsonl(folder / "trajectories.jsonl", Trajectory))
    expected = b"".join(to_json(s) + b"\n" for s in align(trajs, base_dir=folder))
    assert result.stdout == expected
    (line,) = _stderr_lines(result)
    assert line.startswith("legorl align: 4 of 4 episode(s) → 5 sample(s) (0 aux)")


def test_files_out_and_summary(folder: Path, tmp_path: Path) -> None:
    extra = tmp_path / "more" / "graded.jsonl"
    extra.parent.mkdir()
    write_jsonl(
        extra,
        [
            Trajectory(
                trajectory_id="lost",
                task_id="t",
                group_id="g",
                sample_index=0,
                harness="h",
                status="proxy_error",
            )
        ],
    )
    out, summary = tmp_path / "samples.jsonl", tmp_path / "sum" / "align.json"
    result = legorl(
        str(folder / "trajectories.jsonl"),
        str(extra),
        "--include-aux",
        "--out",
        str(out),
        "--summary",
        str(summary),
        cwd=tmp_path,  # not the trajectories' folder: turns_ref resolves against the file's
    )
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout == b""
    samples = list(read_jsonl(out, Sample))
    assert len(samples) == 7 and sum(s.aux for s in samples) == 2
    report = json.loads(summary.read_text())
    stats = AlignStats()
    list(
        align(
            read_jsonl(folder / "trajectories.jsonl", Trajectory),
            include_aux=True,
            base_dir=folder,
            stats=stats,
        )
    )
    assert report["samples"] == 7 and report["episodes"] == 4 and report["episodes_in"] == 5
    assert report["dropped"] == {"proxy_error": 1}
    assert (
        report["trained_tokens"] == stats.trained_tokens == sum(sum(s.loss_mask) for s in samples)
    )
    assert report["segments_per_episode"] == {"mean": 7 / 4, "max": 3}
    assert "check" not in report


def test_check_passes_and_writes_its_figures(folder: Path, tmp_path: Path) -> None:
    summary = tmp_path / "align.json"
    result = legorl(
        str(folder / "trajectories.jsonl"),
        "--check",
        "--model",
        str(MODEL),
        "--dtype",
        "bf16",
        "--summary",
        str(summary),
    )
    assert result.returncode == 0, result.stderr.decode()
    check = json.loads(summary.read_text())["check"]
    assert check["passed"] and check["pearson"] >= 0.99 and check["dtype"] == "bfloat16"
    assert len(check["per_sample"]) == 5 and check["tokens"] == sum(
        r["tokens"] for r in check["per_sample"]
    )
    assert {"mean_abs_diff", "max_abs_diff", "k3_kl"} <= set(check)
    last = _stderr_lines(result)[-1]
    assert last.startswith("legorl align --check (bfloat16): ") and last.endswith(": ok")
    assert "Loading weights" not in result.stderr.decode()


def test_check_below_min_corr_exits_3_after_writing(folder: Path, tmp_path: Path) -> None:
    import torch

    from legorl.engines.models import load_model

    other = tmp_path / "other-model"
    model = load_model(MODEL)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    model.save_pretrained(other)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(MODEL / name, other / name)
    out, summary = tmp_path / "samples.jsonl", tmp_path / "align.json"
    result = legorl(
        str(folder / "trajectories.jsonl"),
        "--check",
        "--model",
        str(other),
        "--out",
        str(out),
        "--summary",
        str(summary),
    )
    assert result.returncode == 3, result.stderr.decode()
    last = _stderr_lines(result)[-1]
    assert last.startswith("legorl align: error: --check: rollout-vs-trainer Pearson ")
    assert last.endswith("is below 0.99")
    assert len(list(read_jsonl(out, Sample))) == 5  # the samples are written all the same
    assert json.loads(summary.read_text())["check"]["passed"] is False


def test_malformed_line_is_one_line_with_file_and_line(folder: Path) -> None:
    path = folder / "trajectories.jsonl"
    with open(path, "ab") as fh:
        fh.write(b'{"schema": "legorl/trajectory@1", "trajectory_id": "x"}\n')
    result = legorl(str(path), cwd=folder)
    assert result.returncode == 1
    (line,) = _stderr_lines(result)
    assert line.startswith(f"legorl align: error: {path}:5: ")
    assert "missing required field" in line
    assert result.stdout.count(b"legorl/sample@1") == 5  # the good episodes before it went out
    skipped = legorl(str(path), "--skip-bad", cwd=folder)
    assert skipped.returncode == 0
    assert f"skipped 1 bad line(s) in {path}" in skipped.stderr.decode()


def test_bad_turn_is_one_line_naming_trajectory_and_turn(folder: Path) -> None:
    turns = folder / "turns" / "s-compact.jsonl"
    lines = turns.read_bytes().splitlines(keepends=True)
    bad = json.loads(lines[1])
    bad["completion_logprobs"] = bad["completion_logprobs"][:-1]  # a token without its log-prob
    lines[1] = json.dumps(bad).encode() + b"\n"
    turns.write_bytes(b"".join(lines))
    result = legorl(str(folder / "trajectories.jsonl"))
    assert result.returncode == 1
    (line,) = _stderr_lines(result)
    # the turns file's reader catches it first, by file and line, inside the trajectory's error
    assert line.startswith("legorl align: error: trajectory 's-compact': turns_ref ")
    assert f"{turns}:2: completion_logprobs: has " in line
    skipped = legorl(str(folder / "trajectories.jsonl"), "--skip-bad")
    assert skipped.returncode == 0
    assert skipped.stdout.count(b"legorl/sample@1") == 3
    assert "dropped: invalid 1" in skipped.stderr.decode()
    assert "skipped 1 bad trajectory(ies); first: trajectory 's-compact'" in skipped.stderr.decode()


def test_inline_turn_error_names_the_turn(tmp_path: Path, folder: Path) -> None:
    (traj, *_) = list(read_jsonl(folder / "trajectories.jsonl", Trajectory))
    assert traj.turns is not None
    traj.turns[2].prompt_offset = 10_000
    path = tmp_path / "t.jsonl"
    write_jsonl(path, [traj])
    result = legorl(str(path))
    assert result.returncode == 1
    (line,) = _stderr_lines(result)
    assert line.startswith(
        "legorl align: error: trajectory 's-reser', session 's-reser' turn 2: prompt_offset "
    )


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--check"], 2, "--check needs --model"),
        (["--check", "--model", "/nonexistent"], 2, "--model /nonexistent: no such folder"),
        (["--dtype", "fp16"], 2, "--dtype: expected one of"),
        (["--min-corr", "2"], 2, "--min-corr: expected a value in 0..1"),
        (["nope.jsonl"], 1, "nope.jsonl: no such file"),
    ],
)
def test_usage_errors_are_one_line(args: list[str], code: int, message: str) -> None:
    result = legorl(*args)
    assert result.returncode == code
    (line,) = _stderr_lines(result)
    assert line.startswith("legorl align: error: ") and message in line
    assert result.stdout == b""


def test_readme_example_runs_as_written(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "tests" / "data" / "align", tmp_path / "tests" / "data" / "align")
    (tmp_path / "fixtures").symlink_to(ROOT / "fixtures")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shim = bindir / "legorl"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m legorl.cli.main "$@"\n')
    shim.chmod(0o755)
    assert len(README_EXAMPLE) == 2
    for line in README_EXAMPLE:
        result = subprocess.run(
            line,
            shell=True,
            cwd=tmp_path,
            capture_output=True,
            timeout=120,
            env={"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp_path)},
        )
        assert result.returncode == 0, f"{line}: {result.stderr.decode()}"
    report = json.loads((tmp_path / "align.json").read_text())
    assert report["dropped"] == {"no_reward": 1, "sandbox_error": 1}
    assert len(list(read_jsonl(tmp_path / "samples.jsonl", Sample))) == report["samples"] == 5
