"""`legorl rollout --engine vllm` on a REAL vLLM server that the rollout launches itself, with the
built-in `mini` harness in bubblewrap sandboxes; mid-run its vLLM process is killed. Under
CI=true a missing vLLM or bubblewrap fails."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_vllm_real import MODEL, ROOT, _reads, group_pids, vllm_python

from legorl.records import Trajectory, read_jsonl

# Every test here counts the host's vLLM processes: they run one after another, never beside
# another module that starts vLLM (tests/conftest.py).
pytestmark = pytest.mark.xdist_group("vllm")


def _need_bwrap() -> None:
    if shutil.which("bwrap") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("bubblewrap is missing (required under CI=true)")
        pytest.skip("bubblewrap is missing")


def test_rollout_survives_its_vllm_dying(tmp_path: Path) -> None:
    _need_bwrap()
    python = vllm_python()
    out = tmp_path / "traj.jsonl"
    err = tmp_path / "rollout.stderr"
    args = [
        "rollout",
        "--tasks", str(ROOT / "fixtures" / "tasks" / "train.jsonl"),
        "--harness", "mini",
        "--harness-opt", "max_turns=2",
        "--harness-opt", "max_tokens=48",
        "--limit", "3",
        "--engine", "vllm",
        "--model", str(MODEL),
        "--engine-opt", f"python={python}",
        "--engine-opt", "max_model_len=4096",
        "--sandbox", "local",
        "--timeout", "300",
        "--out", str(out),
    ]  # fmt: skip
    with open(err, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "legorl.cli.main", *args],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            cwd=ROOT,
            env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"},
        )
    try:
        deadline = time.monotonic() + 1200
        while not (out.exists() and out.read_text().count("\n") >= 1):
            assert proc.poll() is None, err.read_text()
            assert time.monotonic() < deadline, err.read_text()
            time.sleep(0.5)
        log = tmp_path / "vllm-server.log"  # beside --out
        port = re.search(r"--port (\d+)", log.read_text())
        assert port, log.read_text()[:2000]
        (guard,) = [
            int(p.parent.name)
            for p in Path("/proc").glob("[0-9]*/cmdline")
            if "guard_main" in _reads(p) and f"\0--port\0{port[1]}\0" in _reads(p)
        ]
        (server,) = [
            pid
            for pid in group_pids(guard)
            if pid != guard and "api_server" in _reads(Path(f"/proc/{pid}/cmdline"))
        ]
        os.kill(server, signal.SIGKILL)
        proc.wait(600)  # nothing hangs
    finally:
        if proc.poll() is None:
            proc.kill()
    trajs = list(read_jsonl(out, Trajectory))
    assert len(trajs) == 3, err.read_text()
    first, *rest = trajs
    assert first.status != "proxy_error" and first.turns_ref, first  # ran on real vLLM
    assert any(t.status == "proxy_error" for t in rest), [t.status for t in rest]
    deadline = time.monotonic() + 15
    while group_pids(guard) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert group_pids(guard) == []  # the guard ended what was left of the server
