"""LoRA through peft in `legorl train`: only the adapter trains, π_old is recomputed through it,
the checkpoint is a PEFT adapter folder that peft itself loads, resume and merge work, and bad
requests are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from train_helpers import MODEL, legorl, load_weights, make_samples

from legorl.protocols import ConfigError
from legorl.records import write_jsonl
from legorl.train.config import TrainConfig, build_config
from legorl.train.lora import LoraError, linear_targets
from legorl.train.trainer import TrainResult, train

LORA = {"lora": True, "lr": 3e-2, "lora_rank": 4}


@pytest.fixture(scope="module")
def samples() -> list:
    return make_samples(groups=2, group_size=4, segments=2, n_new=6)


def run(samples, model: Path, out: Path | None, **config) -> TrainResult:
    return train(samples, model=model, out=out, config=TrainConfig(**config), dry_run=out is None)


def peft_logprobs(adapter: Path, samples) -> list[list[float]]:
    """The loss tokens' log-probs under ``adapter`` on its base, loaded by peft alone."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from legorl.engines.models import token_logprobs

    base = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    out = []
    for s in samples:
        start = s.loss_mask.index(1)
        out.append(token_logprobs(model, s.input_ids, start=start, temperature=1.0))
    return out


def test_config_keys_and_bad_values(tmp_path: Path) -> None:
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("lora: true\nlora_targets: [q_proj, down_proj]\nlora_rank: 2\n")
    c = build_config(run_yaml, ["lora_alpha=4", "lora_dropout=0.1"])
    assert (c.lora, c.lora_rank, c.lora_alpha, c.lora_dropout) == (True, 2, 4.0, 0.1)
    assert c.lora_targets == ["q_proj", "down_proj"]
    assert build_config(overrides=["lora_targets=mlp\\."]).lora_targets == "mlp\\."
    bad = {
        "lora_rank=0": "lora_rank: must be >= 1, got 0",
        "lora_rank=-2": "lora_rank: must be >= 1, got -2",
        "lora_alpha=0": "lora_alpha: must be > 0",
        "lora_dropout=1": r"lora_dropout: must be in \[0, 1\)",
        "lora_targets=proj(": "lora_targets: not a regular expression",
        "lora_targets=3": "lora_targets: expected a regular expression or a list",
        "lora_rnak=4": "unknown config key 'lora_rnak' \\(did you mean 'lora_rank'\\?\\)",
        "merge=true": "merge: merges a LoRA adapter; set lora=true",
    }
    for override, message in bad.items():
        with pytest.raises(ConfigError, match=message):
            build_config(overrides=[override])
    with pytest.raises(ConfigError, match="train_params: chooses base parameters"):
        build_config(overrides=["lora=true", "train_params=norm"])


def test_default_targets_are_every_linear_layer_but_the_head() -> None:
    from legorl.engines.models import load_model

    lm = load_model(MODEL)
    names = linear_targets(lm, "")
    kinds = {n.rsplit(".", 1)[-1] for n in names}
    assert kinds == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert len(names) == 7 * lm.config.num_hidden_layers and "lm_head" not in names
    assert linear_targets(lm, ["up_proj"]) == [n for n in names if n.endswith(".up_proj")]
    assert linear_targets(lm, r"layers\.0\..*proj") == [n for n in names if ".0." in n]
    with pytest.raises(LoraError, match="lora_targets: 'qkv' matches none of the model's linear"):
        linear_targets(lm, "qkv")


@pytest.mark.parametrize("algorithm", ["gspo", "grpo", "drgrpo"])
def test_only_the_adapter_trains_and_peft_reads_the_checkpoint(
    samples, tmp_path: Path, algorithm: str
) -> None:
    ckpt = tmp_path / "ckpt"
    result = run(samples, MODEL, ckpt, algorithm=algorithm, steps=2, **LORA)
    assert result.updated and result.step == 2
    files = {p.name for p in ckpt.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.pt"} <= files
    assert "model.safetensors" not in files  # the base is not copied
    config = json.loads((ckpt / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(MODEL.resolve())
    assert (config["r"], config["lora_alpha"]) == (4, 32.0)
    tensors = load_weights_of(ckpt)
    assert all(".lora_A." in k or ".lora_B." in k for k in tensors)
    assert len(tensors) == 2 * 7 * 2  # A and B on 7 linear layers × 2 decoder layers
    # B starts at zero; the steps moved it
    assert max(float(v.abs().max()) for k, v in tensors.items() if ".lora_B." in k) > 1e-3
    # π_old of a resumed call is the trainer's recompute through the saved adapter; peft alone
    # gives the same numbers, and they are not the base model's
    again = run(samples, ckpt, None, algorithm=algorithm, **LORA)
    ref = peft_logprobs(ckpt, samples)
    by_id = {lp.sample_id: lp.logprobs for lp in again.logprobs}
    pairs = [(by_id[s.sample_id], r) for s, r in zip(samples, ref, strict=True)]
    gaps = [abs(a - b) for mine, r in pairs for a, b in zip(mine, r, strict=True)]
    assert max(gaps) < 1e-4
    moved = [
        abs(a - b)
        for s in samples
        for a, b in zip(by_id[s.sample_id], s.rollout_logprobs, strict=True)
    ]
    assert max(moved) > 1e-2


def load_weights_of(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def test_resume_continues_the_adapter_and_its_optimizer(samples, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run(samples, MODEL, ckpt, steps=1, **LORA)
    first = load_weights_of(ckpt)
    said: list[str] = []
    result = train(
        samples, model=ckpt, out=ckpt, config=TrainConfig(steps=1, **LORA), log=said.append
    )
    assert result.step == 2
    assert any("resumed optimizer state" in line for line in said), said
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and state["lora"]["rank"] == 4
    assert state["base_model"] == str(MODEL.resolve())
    second = load_weights_of(ckpt)
    assert max(float((first[k] - second[k]).abs().max()) for k in first) > 1e-4


def test_merge_writes_full_weights_that_score_like_the_adapter(samples, tmp_path: Path) -> None:
    ckpt, adapter, merged = tmp_path / "ckpt", tmp_path / "adapter", tmp_path / "merged"
    run(samples, MODEL, ckpt, steps=2, **LORA)
    # the same step from the same adapter, saved once as an adapter and once merged
    run(samples, ckpt, adapter, steps=1, **LORA)
    run(samples, ckpt, merged, steps=1, merge=True, **LORA)
    files = {p.name for p in merged.iterdir()}
    assert "model.safetensors" in files and "adapter_config.json" not in files
    assert "optimizer.pt" not in files  # the adapter's moments belong to no full tensor
    weights, base = load_weights(merged), load_weights(MODEL)
    assert set(weights) == set(base)  # plain names: no base_layer, no lora_ tensors
    from legorl.engines.models import load_model, token_logprobs

    full = load_model(merged)
    ref = peft_logprobs(adapter, samples)
    for s, r in zip(samples, ref, strict=True):
        mine = token_logprobs(full, s.input_ids, start=s.loss_mask.index(1), temperature=1.0)
        assert max(abs(a - b) for a, b in zip(mine, r, strict=True)) < 1e-4
        assert max(abs(a - b) for a, b in zip(mine, s.rollout_logprobs, strict=True)) > 1e-3
    # a merged folder trains on fully (it has no moments to switch), or with a fresh adapter
    assert run(samples, merged, tmp_path / "f", steps=1, lr=1e-3).step == 4
    assert run(samples, merged, tmp_path / "g", steps=1, **LORA).step == 4


def test_switching_between_lora_and_full_training_is_refused(samples, tmp_path: Path) -> None:
    ckpt, full = tmp_path / "ckpt", tmp_path / "full"
    run(samples, MODEL, ckpt, steps=1, **LORA)
    with pytest.raises(LoraError, match="a LoRA adapter checkpoint; resume it with lora=true"):
        run(samples, ckpt, tmp_path / "x", steps=1, lr=1e-3)
    run(samples, MODEL, full, steps=1, lr=1e-3)
    with pytest.raises(LoraError, match=r"optimizer\.pt: saved for full training, not a LoRA"):
        run(samples, full, tmp_path / "y", steps=1, **LORA)
    assert run(samples, full, tmp_path / "y", steps=1, resume=False, **LORA).updated
    with pytest.raises(LoraError, match=r"--out .*full: holds a full model"):
        run(samples, ckpt, full, steps=1, **LORA)
    with pytest.raises(LoraError, match="the adapter has lora_rank 4, the config asks for 8"):
        run(samples, ckpt, None, **{**LORA, "lora_rank": 8})


def test_an_adapter_whose_base_is_gone_is_named(samples, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run(samples, MODEL, ckpt, steps=1, **LORA)
    config = json.loads((ckpt / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone")
    (ckpt / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(LoraError, match=r"its base model .*gone is not a model folder"):
        run(samples, ckpt, None, **LORA)


def test_cli_trains_an_adapter_and_refuses_a_bad_rank(samples, tmp_path: Path) -> None:
    data = tmp_path / "samples.jsonl"
    write_jsonl(data, samples)
    ok = legorl("train", str(data), "--model", str(MODEL), "--out", str(tmp_path / "c"),
                "lora=true", "lora_rank=2", "lr=1e-2")  # fmt: skip
    assert ok.returncode == 0, ok.stderr.decode()
    assert (tmp_path / "c" / "adapter_config.json").is_file()
    resumed = legorl("train", str(data), "--model", str(tmp_path / "c"), "--out",
                     str(tmp_path / "c"), "lora=true", "lora_rank=2", "lr=1e-2")  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr.decode()
    bad = legorl("train", str(data), "--model", str(MODEL), "--out", str(tmp_path / "d"),
                 "lora=true", "lora_rank=0")  # fmt: skip
    assert bad.returncode == 2
    assert "lora_rank: must be >= 1, got 0" in bad.stderr.decode()
    nothing = legorl("train", str(data), "--model", str(MODEL), "--out", str(tmp_path / "e"),
                     "lora=true", "lora_targets=[wq, wv]")  # fmt: skip
    assert nothing.returncode == 1
    assert "lora_targets: ['wq', 'wv'] matches none" in nothing.stderr.decode()


@pytest.mark.slow
def test_two_processes_train_the_same_adapter_as_one(samples, tmp_path: Path) -> None:
    import os
    import socket
    import subprocess
    import sys

    from train_helpers import ROOT

    data = tmp_path / "samples.jsonl"
    write_jsonl(data, samples)
    # SGD-like Adam and small micro-batches, so each process gets several and their gradients
    # must be averaged exactly (as tests/train/test_train_distributed.py does for full weights)
    config = ["lora=true", "lora_rank=4", "lr=5.0", "adam_eps=1000.0", "micro_batch_tokens=20",
              "mini_batch_episodes=4", "shuffle=false", "--steps", "2"]  # fmt: skip
    one = legorl("train", str(data), "--model", str(MODEL), "--out", str(tmp_path / "one"), *config)
    assert one.returncode == 0, one.stderr.decode()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port),
        "-m", "legorl.cli.main", "train", str(data), "--model", str(MODEL),
        "--out", str(tmp_path / "two"), *config,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    two = subprocess.run(cmd, capture_output=True, cwd=ROOT, env=env, timeout=600)
    assert two.returncode == 0, two.stderr.decode()[-3000:]
    assert "; 2 process(es)" in two.stderr.decode()
    a, b = load_weights_of(tmp_path / "one"), load_weights_of(tmp_path / "two")
    assert a.keys() == b.keys()
    assert max(float(v.abs().max()) for k, v in a.items() if ".lora_B." in k) > 1e-3
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6


def test_push_ships_the_adapter_and_turns_record_it(samples, tmp_path: Path) -> None:
    import sys

    import httpx
    from safetensors.torch import load_file
    from train_helpers import ROOT

    sys.path.insert(0, str(ROOT / "tests" / "proxy"))
    from proxy_harness import running_proxy

    from legorl.records import segment_prompts

    data = tmp_path / "samples.jsonl"
    write_jsonl(data, samples)
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    ckpt = tmp_path / "ckpt"
    with running_proxy(tmp_path / "turns", [], engine="embedded", admin_token="t0k") as proxy:
        for step in (1, 2):
            pushed = legorl("train", str(data), "--model", str(ckpt if step > 1 else MODEL),
                            "--out", str(ckpt), "--push", proxy.url, "--push-token", "t0k",
                            "lora=true", "lora_rank=4", "lr=3e-2")  # fmt: skip
            assert pushed.returncode == 0, pushed.stderr.decode()
            assert f"policy version {step}" in pushed.stderr.decode()
        engine = proxy.core.engine
        assert (engine.policy_adapter, engine.adapter_versions) == ("policy", {"policy": 2})
        resp = httpx.post(f"{proxy.url}/s/after/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        (turn,) = proxy.turns("after")
    assert (turn.policy_version, turn.adapter, turn.adapter_version) == (2, "policy", 2)
    # what moved: the adapter's megabytes, not the model's
    shipped = sum(p.stat().st_size for p in ckpt.glob("adapter_*"))
    assert shipped < (MODEL / "model.safetensors").stat().st_size
    assert all("lora_" in k for k in load_file(str(ckpt / "adapter_model.safetensors")))
    ((_, prompt),) = segment_prompts([turn])
    (scored,) = peft_logprobs_of(ckpt, prompt, turn.completion_ids)
    gaps = [abs(a - b) for a, b in zip(scored, turn.completion_logprobs, strict=True)]
    assert max(gaps) < 1e-4


def peft_logprobs_of(adapter: Path, prompt: list[int], ids: list[int]) -> list[list[float]]:
    from legorl.records import Sample

    one = Sample(sample_id="x", episode_id="x", group_id="x", segment_index=0, segment_count=1,
                 input_ids=prompt + ids, loss_mask=[0] * len(prompt) + [1] * len(ids),
                 rollout_logprobs=[0.0] * len(ids), reward=0.0)  # fmt: skip
    return peft_logprobs(adapter, [one])
