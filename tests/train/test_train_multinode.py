"""Training on many machines: two "machines" on this host (two `accelerate launch`, gloo on the
CPU) give the same weights as one process, with the samples only on the first machine; and
FSDP's sharded Adam state, saved and restored, continues a run exactly as one process does."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_helpers import MODEL, ROOT, legorl, load_weights, make_samples

from legorl.records import write_jsonl
from legorl.train.distributed import by_index, by_name

WORKER = Path(__file__).with_name("fsdp_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
CONFIG = ["lr=5.0", "adam_eps=1000.0", "micro_batch_tokens=20", "mini_batch_episodes=4"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
def test_two_machines_match_one_process_with_the_samples_on_the_first_only(
    tmp_path: Path,
) -> None:
    samples = tmp_path / "head" / "samples.jsonl"
    samples.parent.mkdir()
    write_jsonl(samples, make_samples(groups=2, group_size=4, segments=2, n_new=6))
    one = legorl(
        "train", str(samples), "--model", str(MODEL), "--out", str(tmp_path / "one"),
        "--steps", "2", *CONFIG,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr.decode()

    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        # machine 1 has no sample file: its path there does not exist
        path = samples if rank == 0 else tmp_path / "other" / "samples.jsonl"
        cmd = [
            sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
            "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank),
            "--main_process_ip", "127.0.0.1", "--main_process_port", port,
            "--mixed_precision", "no", "--dynamo_backend", "no",
            "-m", "legorl.cli.main", "train", str(path), "--model", str(MODEL),
            "--out", str(tmp_path / "two"), "--steps", "2", *CONFIG,
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=ENV, stderr=subprocess.PIPE))
    errs = [p.communicate(timeout=600)[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs[0][-2000:] + errs[1][-2000:]
    assert "; 2 process(es)" in errs[0] and "checkpoint:" in errs[0]
    assert not (tmp_path / "other").exists()

    a, b = load_weights(tmp_path / "one"), load_weights(tmp_path / "two")
    assert _max_diff(a, load_weights(MODEL)) > 1e-4  # it learned
    assert _max_diff(a, b) < 1e-6


def test_the_optimizer_layout_round_trips_by_name() -> None:
    saved = {
        "state": {0: {"step": 1}, 1: {"step": 2}},
        "param_groups": [{"lr": 0.1, "params": [1]}, {"lr": 0.2, "params": [0]}],
    }
    names = ["a.weight", "b.bias"]
    named = by_name(saved, names)
    assert named["state"] == {"a.weight": {"step": 1}, "b.bias": {"step": 2}}
    assert named["param_groups"][0]["params"] == ["b.bias"]
    assert by_index(named, names) == saved


def _step(tmp: Path, name: str, n: int, weights: str, prompt: int, resume: str) -> Path:
    out = tmp / name
    script = [str(WORKER), str(MODEL), weights, str(out), str(prompt), resume]
    if n == 1:
        cmd = [sys.executable, *script]
    else:
        # --standalone: the launcher binds its own rendezvous port (a port found free, then
        # closed and passed on, can be taken by another test's server before it binds)
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(n), *script,
        ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_fsdp_resumes_adam_mid_run_as_one_process_does(tmp_path: Path) -> None:
    # step 1 on one prompt, then step 2 on another, resumed from step 1's checkpoint
    ref1 = _step(tmp_path, "ref1", 1, "-", 0, "-")
    ref2 = _step(tmp_path, "ref2", 1, str(ref1 / "weights.pt"), 1, str(ref1))
    fs1 = _step(tmp_path, "fs1", 2, "-", 0, "-")
    fs2 = _step(tmp_path, "fs2", 2, str(fs1 / "weights.pt"), 1, str(fs1))
    # the control: FSDP resumed without the saved moments (what it did before)
    cold = _step(tmp_path, "cold", 2, str(fs1 / "weights.pt"), 1, "-")

    def weights(d: Path) -> dict:
        return torch.load(d / "weights.pt", weights_only=True)

    assert _max_diff(weights(fs1), weights(ref1)) < 1e-6
    assert _max_diff(weights(fs2), weights(ref2)) < 1e-6
    assert _max_diff(weights(cold), weights(ref2)) > 1e-3  # restarting Adam shows
    # the saved state is the one-process layout, step 2 with the same moments
    ref_state = torch.load(ref2 / "optimizer.pt", weights_only=True)
    fs_state = torch.load(fs2 / "optimizer.pt", weights_only=True)
    assert ref_state["state"].keys() == fs_state["state"].keys()
    for i, s in ref_state["state"].items():
        assert int(fs_state["state"][i]["step"]) == int(s["step"]) == 2
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(fs_state["state"][i][moment], s[moment], atol=1e-7, rtol=1e-5)
    # and a one-process run resumes from what FSDP saved
    cross = _step(tmp_path, "cross", 1, str(fs1 / "weights.pt"), 1, str(fs1))
    assert _max_diff(weights(cross), weights(ref2)) < 1e-6
