"""`legorl loop --lora`: each iteration trains the LoRA adapter on from the last one, the
proxy's engine swaps it in, and the Turns of every phase record which adapter version sampled
them. The same real mechanics as tests/test_loop.py (embedded engine, `mini` agent in `local`
sandboxes, grading, the trainer), with its mechanics overrides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import ROOT

from legorl.loop import LoopConfig, LoopConfigError, run_loop
from legorl.loop_config import LOOP_LR_LORA
from legorl.protocols import BASE_ADAPTER
from legorl.records import Turn, read_jsonl

TASKS = ROOT / "fixtures" / "tasks"
MODEL = ROOT / "fixtures" / "models" / "tiny-qwen3"
MECHANICS = ["drop_zero_variance_groups=false", "entropy_coef=0.01", "lora_rank=4"]


def _mean_gap_to(model: Path, turn: Turn) -> float:
    """Mean |served − recomputed| log-prob of ``turn``'s completion under ``model`` (T = 1)."""
    import torch
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    prompt, ids = list(turn.prompt_delta), list(turn.completion_ids)
    with torch.no_grad():
        logits = lm(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
    lps = logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None])[:, 0]
    served = torch.tensor(turn.completion_logprobs)
    return float((lps - served).abs().mean())


def _adapters(folder: Path) -> set[tuple[int, str | None, int | None]]:
    return {
        (t.policy_version, t.adapter, t.adapter_version)
        for p in (folder / "turns").glob("*.jsonl")
        for t in read_jsonl(p, Turn)
    }


def test_the_loop_options_give_a_lora_train_config() -> None:
    c = LoopConfig(lora=True, train_overrides=["lora_rank=2"]).train_config()
    assert (c.lora, c.lora_rank, c.train_params, c.scale_only) == (True, 2, "", "")
    assert c.lr == LOOP_LR_LORA
    assert LoopConfig(lora=True, lr=3e-3).train_config().lr == 3e-3
    assert LoopConfig(lora=True, engine="vllm").engine_options == {"lora": True}
    with pytest.raises(LoopConfigError, match="the loop sets lora; use --lora"):
        LoopConfig(train_overrides=["lora=true"]).train_config()
    with pytest.raises(LoopConfigError, match="scale_only: --lora trains an adapter"):
        LoopConfig(lora=True, scale_only="norm").train_config()


def test_an_async_lora_loop_on_vllm_holds_k_plus_one_adapter_versions() -> None:
    """K steps off-policy: an episode may finish K versions after it started, so vLLM keeps the
    last K + 1 adapter versions loaded (``keep_versions``) and ``max_loras`` must cover them."""
    c = LoopConfig(lora=True, engine="vllm", use_async=True, max_staleness=2)
    assert c.engine_options == {"lora": True, "keep_versions": 3, "max_loras": 3}
    sync = LoopConfig(lora=True, engine="vllm", max_staleness=2)
    assert sync.engine_options == {"lora": True}  # each swap drains: one version at a time
    bigger = LoopConfig(lora=True, engine="vllm", use_async=True, engine_options={"max_loras": 5})
    assert bigger.engine_options["max_loras"] == 5 and bigger.engine_options["keep_versions"] == 2
    small = LoopConfig(
        lora=True, engine="vllm", use_async=True, max_staleness=2, engine_options={"max_loras": 2}
    )
    with pytest.raises(LoopConfigError, match=r"max_loras=2 cannot hold the 3 adapter versions"):
        small.validate()


def test_a_lora_loop_chains_adapters_and_turns_record_them(tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = LoopConfig(
        model=MODEL, tasks_dir=TASKS, out=out, iterations=2, group_size=2,
        tasks_per_iteration=2, eval_samples=1, eval_limit=2, max_turns=2, max_tokens=24,
        concurrency=2, timeout=120.0, lora=True, train_overrides=list(MECHANICS), device="cpu",
    )  # fmt: skip
    result = run_loop(config, log=lambda _line: None)
    first, second = out / "iter-001" / "checkpoint", out / "iter-002" / "checkpoint"
    for ckpt in (first, second):
        assert (ckpt / "adapter_model.safetensors").is_file()
        assert not (ckpt / "model.safetensors").exists()  # the adapter is what ships
    state = json.loads((second / "trainer_state.json").read_text())
    assert state["global_step"] == 2  # the second iteration resumed the first's adapter
    assert result.state.policy_version == 2
    assert _adapters(out / "eval-before") == {(0, None, None)}
    assert _adapters(out / "iter-002") == {(1, "policy", 1)}
    assert _adapters(out / "eval-after") == {(2, "policy", 2)}

    # Continued: the engine starts on the base model with the last adapter loaded as the
    # policy (its version kept), and takes the next adapter as it took the first. With
    # --eval-base the last evaluation also runs on the base model in that engine.
    more = LoopConfig(**{**config.__dict__, "iterations": 3, "eval_base": True})
    result = run_loop(more, log=lambda _line: None)
    assert result.resumed_from == 2 and result.state.policy_version == 3
    assert _adapters(out / "iter-003") == {(2, "policy", 2)}
    assert _adapters(out / "eval-after") == {(3, "policy", 3)}
    third = json.loads((out / "iter-003" / "checkpoint" / "trainer_state.json").read_text())
    assert third["global_step"] == 3
    assert _adapters(out / "eval-base") == {(0, BASE_ADAPTER, 0)}
    base = result.state.eval_at(3, BASE_ADAPTER)
    assert base is not None and base.runs == result.state.eval_at(3).runs == 2
    # the base sessions' tokens were sampled by the base model: its own forward scores them
    for path in sorted((out / "eval-base" / "turns").glob("*.jsonl"))[:1]:
        first = next(iter(read_jsonl(path, Turn)))
        assert first.prompt_offset == 0
        assert _mean_gap_to(MODEL, first) < 1e-3
    with pytest.raises(LoopConfigError, match="eval_base: compares the base model"):
        LoopConfig(eval_base=True).validate()
    with pytest.raises(LoopConfigError, match="lora_targets: 'nothing' matches none"):
        run_loop(
            LoopConfig(**{**config.__dict__, "out": tmp_path / "bad",
                          "train_overrides": [*MECHANICS, "lora_targets=nothing"]}),
            log=lambda _line: None,
        )  # fmt: skip
