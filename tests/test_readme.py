"""Every runnable `legorl` example in the README runs as written."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT

from legorl.records import Trajectory, read_jsonl


def _examples() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, re.DOTALL)
    lines = [ln.strip() for block in blocks for ln in block.splitlines()]
    return [ln for ln in lines if ln.startswith(("legorl cat", "cat tests/"))]


def test_readme_cat_examples_run(tmp_path: Path) -> None:
    examples = _examples()
    assert len(examples) >= 2
    shutil.copytree(ROOT / "tests" / "data", tmp_path / "tests" / "data")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shim = bindir / "legorl"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m legorl.cli.main "$@"\n')
    shim.chmod(0o755)
    for line in examples:
        result = subprocess.run(
            line,
            shell=True,
            cwd=tmp_path,
            capture_output=True,
            timeout=60,
            env={"PATH": f"{bindir}:/usr/bin:/bin"},
        )
        assert result.returncode == 0, f"{line}: {result.stderr.decode()}"
    assert (tmp_path / "turns.jsonl").read_text().count("legorl/turn@1") == 2
    assert (tmp_path / "copy.jsonl").read_bytes() == (ROOT / "tests/data/golden.jsonl").read_bytes()


def test_readme_proxy_example_answers(tmp_path: Path) -> None:
    text = (ROOT / "README.md").read_text()
    serve = next(ln for ln in text.splitlines() if ln.startswith("legorl proxy serve"))
    curl = next(ln for ln in text.splitlines() if ln.startswith("curl -s http://127.0.0.1:8000"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve = serve.removesuffix("&").replace("8000", str(port)).split()
    args = [str(ROOT / a) if a.startswith("fixtures/") else a for a in serve[1:]]
    proc = subprocess.Popen(
        [sys.executable, "-m", "legorl.cli.main", *args], cwd=tmp_path, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        result = subprocess.run(
            curl.replace("8000", str(port)), shell=True, capture_output=True, timeout=60
        )
        answer = json.loads(result.stdout)
        assert answer["object"] == "chat.completion"
        assert answer["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        proc.wait(10)
    assert (tmp_path / "runs" / "turns" / "demo.jsonl").exists()


def test_readme_rollout_then_verify_examples_run(tmp_path: Path) -> None:
    text = (ROOT / "README.md").read_text()
    rollout = next(ln for ln in text.splitlines() if ln.startswith("legorl rollout --tasks"))
    verify = next(ln for ln in text.splitlines() if ln.startswith("legorl verify runs/"))
    (tmp_path / "fixtures").symlink_to(ROOT / "fixtures")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shim = bindir / "legorl"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m legorl.cli.main "$@"\n')
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}
    done = subprocess.run(
        rollout, shell=True, cwd=tmp_path, capture_output=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    trajs = list(read_jsonl(tmp_path / "runs" / "traj.jsonl", Trajectory))
    assert len(trajs) == 4
    assert {t.status for t in trajs} <= {"ok", "agent_error", "timeout", "truncated"}
    assert all(t.turns_ref and (tmp_path / "runs" / t.turns_ref[0]).exists() for t in trajs)
    again = subprocess.run(
        rollout, shell=True, cwd=tmp_path, capture_output=True, timeout=600, env=env
    )
    assert again.returncode == 0 and len(list(read_jsonl(tmp_path / "runs" / "traj.jsonl"))) == 4
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("the Docker daemon is not running (.ci/run starts it)")
        pytest.skip("no Docker daemon for the verify example")
    graded = subprocess.run(
        verify, shell=True, cwd=tmp_path, capture_output=True, timeout=600, env=env
    )
    assert graded.returncode == 0, graded.stderr.decode()[-2000:]
    graded_trajs = list(read_jsonl(tmp_path / "runs" / "graded.jsonl", Trajectory))
    assert len(graded_trajs) == 4
    # The untrained tiny model with two turns of 64 tokens fixes nothing: every run is graded,
    # and graded 0 with the reason (its tests failed, or its patch was refused or did not apply).
    for t in graded_trajs:
        assert t.reward == 0.0 and t.verdict is not None, t
        assert t.verdict["resolved"] is False and t.verdict["reason"], t.verdict


def test_readme_align_into_train_pipe_runs(tmp_path: Path) -> None:
    text = (ROOT / "README.md").read_text()
    line = next(
        ln
        for ln in text.splitlines()
        if ln.startswith("legorl align tests/data/align/graded.jsonl |")
    )
    (tmp_path / "fixtures").symlink_to(ROOT / "fixtures")
    (tmp_path / "tests").symlink_to(ROOT / "tests")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "legorl").write_text(f'#!/bin/sh\nexec {sys.executable} -m legorl.cli.main "$@"\n')
    (bindir / "legorl").chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}
    result = subprocess.run(
        ["bash", "-o", "pipefail", "-c", line],
        cwd=tmp_path,
        capture_output=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert (tmp_path / "ckpt" / "model.safetensors").exists()
    names = {m.name for m in read_jsonl(tmp_path / "metrics.jsonl")}
    assert "rollout_trainer_pearson" in names


def test_readme_lora_examples_run(tmp_path: Path) -> None:
    text = (ROOT / "README.md").read_text()
    lines = [
        ln
        for ln in text.splitlines()
        if ln.startswith("legorl train tests/data/train/samples.jsonl") and "lora=true" in ln
    ]
    assert len(lines) == 3
    (tmp_path / "fixtures").symlink_to(ROOT / "fixtures")
    (tmp_path / "tests").symlink_to(ROOT / "tests")
    for line in lines:
        args = line.split()[1:]
        result = subprocess.run(
            [sys.executable, "-m", "legorl.cli.main", *args],
            cwd=tmp_path,
            capture_output=True,
            timeout=600,
        )
        assert result.returncode == 0, f"{line}: {result.stderr.decode()[-2000:]}"
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    state = json.loads((tmp_path / "adapter" / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and state["lora"]["rank"] == 4
    assert (tmp_path / "merged" / "model.safetensors").exists()
