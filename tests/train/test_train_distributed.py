"""`accelerate launch` with 2 CPU processes (gloo) gives the same updated weights as 1 process on
the same data: each process runs its share of the micro-batches, gradients are averaged, and the
loss scaling makes that average the one-process gradient."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from train_helpers import MODEL, ROOT, legorl, load_weights, make_samples

from legorl.records import Metric, read_jsonl, write_jsonl

# SGD-like Adam (huge eps) so weight differences are gradient differences, not amplified noise;
# small micro-batches so each process gets several, and episodes split across processes; two
# mini-batches, so the second step's π_old comes from the no-grad pass before the first update
CONFIG = [
    "lr=5.0",
    "adam_eps=1000.0",
    "micro_batch_tokens=20",
    "mini_batch_episodes=4",
    "shuffle=false",
    "gspo_clip_low=0.05",
    "gspo_clip_high=0.05",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(n: int, samples: Path, out: Path, metrics: Path, extra: list[str]) -> str:
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--multi_gpu", "--num_processes", str(n), "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(_free_port()),
        "-m", "legorl.cli.main", "train", str(samples),
        "--model", str(MODEL), "--out", str(out), "--metrics", str(metrics),
        "--steps", "2", *CONFIG, *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(cmd, capture_output=True, cwd=ROOT, env=env, timeout=600)
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    return result.stderr.decode()


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra", [[], ["algorithm=grpo", "correction=seq_mask"]], ids=["gspo", "grpo"]
)
def test_two_processes_match_one(tmp_path: Path, extra: list[str]) -> None:
    samples = tmp_path / "samples.jsonl"
    write_jsonl(samples, make_samples(groups=2, group_size=4, segments=2, n_new=6))
    one = legorl(
        "train", str(samples), "--model", str(MODEL), "--out", str(tmp_path / "one"),
        "--metrics", str(tmp_path / "one.jsonl"), "--steps", "2", *CONFIG, *extra,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr.decode()
    err = _launch(2, samples, tmp_path / "two", tmp_path / "two.jsonl", extra)
    assert "; 2 process(es)" in err and err.count("checkpoint:") == 1  # main process speaks

    a, b = load_weights(tmp_path / "one"), load_weights(tmp_path / "two")
    base = load_weights(MODEL)
    assert max(float((a[k] - base[k]).abs().max()) for k in a) > 1e-4  # it did learn
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    m1 = {(m.step, m.name): m.value for m in read_jsonl(tmp_path / "one.jsonl", Metric)}
    m2 = {(m.step, m.name): m.value for m in read_jsonl(tmp_path / "two.jsonl", Metric)}
    assert m1.keys() == m2.keys()  # only the main process wrote metrics, once per step
    for key in m1:
        if key[1] in ("loss", "grad_norm", "clip_fraction", "rollout_trainer_pearson", "entropy"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-7), key
    assert m2[(1, "micro_batches")] == 8  # 4 episodes × 2 segments, each alone


@pytest.mark.parametrize("name", ["ddp-8gpu.yaml", "fsdp-8gpu.yaml"])
def test_gpu_accelerate_configs_parse(name: str) -> None:
    # documented, not run here (no GPU): at least accelerate reads them as intended
    from accelerate.commands.config.config_args import ClusterConfig

    config = ClusterConfig.from_yaml_file(str(ROOT / "fixtures" / "accelerate" / name))
    assert config.num_processes == 8 and not config.use_cpu
    if name.startswith("fsdp"):
        assert config.distributed_type == "FSDP"
        assert "Qwen3DecoderLayer" in config.fsdp_config["fsdp_transformer_layer_cls_to_wrap"]
