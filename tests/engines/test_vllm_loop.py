"""``legorl loop --engine vllm`` end to end on a REAL vLLM server that the loop launches: two
iterations of rollout (the ``mini`` agent in bubblewrap sandboxes) → verify → align → train, the
new weights pushed into the running server after each (reload, then a prefix-cache reset), and
held-out evaluations before and after. Under CI=true a missing vLLM or bubblewrap fails.

As in tests/test_loop.py, the mechanics runs keep zero-variance groups and add an entropy bonus,
so that every iteration trains and so changes the weights the next one must be served from.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_vllm_real import ROOT, legorl, vllm_python
from test_vllm_real_rollout import _need_bwrap

from legorl.records import Turn, read_jsonl

# Real vLLM servers: one at a time on the host, with the other vLLM modules (tests/conftest.py).
pytestmark = pytest.mark.xdist_group("vllm")

MODEL = ROOT / "fixtures" / "models" / "tiny-agent"
TASKS = ROOT / "fixtures" / "tasks"


def _versions(folder: Path) -> set[int]:
    return {
        t.policy_version for p in (folder / "turns").glob("*.jsonl") for t in read_jsonl(p, Turn)
    }


def _check(graded: Path, model: Path, out: Path) -> dict:
    """``legorl align --check`` of ``graded`` against ``model``: its fidelity figures."""
    done = legorl(
        "align", str(graded), "--out", str(out / "samples.jsonl"), "--check",
        "--model", str(model), "--min-corr", "0", "--summary", str(out / "align.json"),
        "--device", "cpu",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "align.json").read_text())["check"]


def test_the_loop_runs_on_real_vllm_and_syncs_the_weights_every_iteration(tmp_path: Path) -> None:
    _need_bwrap()
    run = tmp_path / "run"
    done = legorl(
        "loop", "--engine", "vllm", "--engine-opt", f"python={vllm_python()}",
        "--engine-opt", "max_model_len=4096", "--model", str(MODEL), "--tasks-dir", str(TASKS),
        "--out", str(run), "--iterations", "2", "--group-size", "2",
        "--tasks-per-iteration", "1", "--eval-samples", "1", "--eval-limit", "1",
        "--max-turns", "2", "--max-tokens", "24", "--concurrency", "2", "--timeout", "300",
        "--sandbox", "local", "drop_zero_variance_groups=false", "entropy_coef=0.01",
        timeout=1800,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert (run / "vllm-server.log").is_file()  # the loop launched its own server
    state = json.loads((run / "state.json").read_text())
    assert state["finished"] == 2 and state["policy_version"] == 2
    assert [i["trained"] for i in state["iterations"]] == [True, True]
    assert [e["policy_version"] for e in state["evals"]] == [0, 2]
    # Turns sampled between two syncs carry the version in between.
    assert _versions(run / "eval-before") == {0}
    assert _versions(run / "iter-001") == {0}
    assert _versions(run / "iter-002") == {1}
    assert _versions(run / "eval-after") == {2}
    # Iteration 2 was sampled from iteration 1's checkpoint: its trainer agrees with vLLM.
    assert state["iterations"][1]["rollout_trainer_pearson"] >= 0.999
    # The held-out prompts are the ones evaluated first, so vLLM had their prefixes cached under
    # the starting weights: after two syncs the records match the last checkpoint, not those.
    last = run / state["checkpoint"]
    with_last = _check(run / "eval-after" / "graded.jsonl", last, tmp_path / "last")
    with_start = _check(run / "eval-after" / "graded.jsonl", MODEL, tmp_path / "start")
    assert with_last["pearson"] >= 0.999 and with_last["max_abs_diff"] < 1e-3, with_last
    assert with_start["max_abs_diff"] > 10 * with_last["max_abs_diff"], with_start
