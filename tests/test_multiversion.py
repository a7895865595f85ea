"""Episodes that span a weight sync: the Turns before it carry version v, those after v+1; the
Sample keeps each completion span's version; each span's recorded log-probs are those of the
weights that sampled it (a recompute under that span's checkpoint agrees, under the other one
it does not); the trainer, training on the episode, corrects each token against its own
sampling log-prob; and GSPO's sequence ratio does not depend on which version sampled a token.

Real parts: the embedded engine serving the random tiny model behind the in-process proxy, a
real chat session over HTTP, a real weight sync in the middle of it, the trainer.
"""

from __future__ import annotations

import asyncio
import math
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from conftest import ROOT

from legorl.align import align
from legorl.loop_config import LoopConfig
from legorl.records import Sample, Trajectory, Turn, read_jsonl
from legorl.rollout import EngineSpec, core_endpoint, serve_engine
from legorl.train.correction import correction_weights
from legorl.train.losses import sequence_log_ratio

MODEL = ROOT / "fixtures" / "models" / "tiny-qwen3"
# a call with tools is the main agent's (one without is an aux call, not trained)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]
TASKS = ROOT / "fixtures" / "tasks"


def _perturbed(folder: Path) -> Path:
    """A checkpoint of the tiny model with its final norm's gains doubled: other log-probs."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(MODEL, folder)
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 2.0
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _episode(tmp_path: Path, ckpt: Path) -> list[Turn]:
    """Two calls of one session, the weights synced from MODEL to ``ckpt`` between them."""

    async def main() -> None:
        engine = EngineSpec(
            name="embedded", weights=MODEL, options={"device": "cpu"}, log_dir=tmp_path
        )
        async with serve_engine(MODEL, engine, tmp_path / "turns") as (endpoint, core):
            ep = core_endpoint(core, endpoint.url, tmp_path / "turns")
            access = await ep.open_session("ep-1", None)
            messages: list[dict] = [
                {"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "Say something."},
            ]
            async with httpx.AsyncClient(timeout=120) as client:

                async def call(seed: int) -> str:
                    body = {
                        "model": core.served_name,
                        "messages": messages,
                        "tools": TOOLS,
                        "max_tokens": 12,
                        "temperature": 1.0,
                        "seed": seed,
                    }
                    resp = await client.post(f"{access.url}/v1/chat/completions", json=body)
                    assert resp.status_code == 200, resp.text
                    return str(resp.json()["choices"][0]["message"]["content"] or "")

                first = await call(1)
                assert await core.load_weights(str(ckpt)) == 1  # the sync, mid-episode
                messages += [
                    {"role": "assistant", "content": first},
                    {"role": "user", "content": "Go on."},
                ]
                await call(2)
            await ep.close_session("ep-1")

    asyncio.run(main())
    return list(read_jsonl(tmp_path / "turns" / "ep-1.jsonl", Turn))


def _recompute(model: Path, sample: Sample) -> list[float]:
    """log π(token) at T = 1 of each loss token under the weights in ``model``."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(str(model), torch_dtype=torch.float32).eval()
    ids = torch.tensor([sample.input_ids])
    with torch.no_grad():
        logp = torch.log_softmax(lm(ids).logits[0].double(), dim=-1)
    return [
        float(logp[t - 1, sample.input_ids[t]])
        for t in range(1, len(sample.input_ids))
        if sample.loss_mask[t]
    ]


@pytest.fixture(scope="module")
def multiversion(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Sample]:
    tmp = tmp_path_factory.mktemp("multiversion")
    ckpt = _perturbed(tmp / "ckpt")
    turns = _episode(tmp, ckpt)
    assert [t.policy_version for t in turns] == [0, 1]
    traj = Trajectory(
        trajectory_id="ep-1",
        task_id="t",
        group_id="t",
        sample_index=0,
        harness="mini",
        status="ok",
        turns=turns,
        reward=1.0,
    )
    (sample,) = list(align([traj]))
    return tmp, ckpt, sample


def test_a_sample_keeps_each_span_version(multiversion: tuple[Path, Path, Sample]) -> None:
    _, _, sample = multiversion
    assert sample.span_versions == [0, 1] and sample.policy_version == 0
    assert sum(sample.span_lengths) == len(sample.rollout_logprobs)
    assert sample.oldest_version == 0
    n0 = sample.span_lengths[0]
    assert sample.token_versions() == [0] * n0 + [1] * sample.span_lengths[1]


def test_each_span_was_sampled_by_its_own_checkpoint(
    multiversion: tuple[Path, Path, Sample],
) -> None:
    _, ckpt, sample = multiversion
    n0 = sample.span_lengths[0]
    mu = sample.rollout_logprobs
    under = {0: _recompute(MODEL, sample), 1: _recompute(ckpt, sample)}
    spans = {0: slice(0, n0), 1: slice(n0, len(mu))}
    for version, span in spans.items():
        own = max(abs(a - b) for a, b in zip(mu[span], under[version][span], strict=True))
        other = max(abs(a - b) for a, b in zip(mu[span], under[1 - version][span], strict=True))
        assert own < 1e-3, (version, own)
        # the control: the other version's weights give other log-probs on the same tokens
        assert other > 1e-2, (version, other)


def test_the_trainer_corrects_each_token_against_its_own_version(
    multiversion: tuple[Path, Path, Sample],
) -> None:
    from legorl.train.trainer import train

    tmp, ckpt, sample = multiversion
    config = LoopConfig(
        model=ckpt,
        tasks_dir=TASKS,
        lr=1e-3,
        train_overrides=["drop_zero_variance_groups=false", "entropy_coef=0.01"],
    ).train_config()
    # the trainer holds version 1: its π_old is the checkpoint's
    result = train([sample], model=ckpt, out=tmp / "trained", config=config)
    assert result.updated
    (scored,) = result.logprobs
    old = torch.tensor(scored.logprobs, dtype=torch.float64)
    mu = torch.tensor(sample.rollout_logprobs, dtype=torch.float64)
    n0 = sample.span_lengths[0]
    # span 1 was sampled by the trainer's own weights: ρ ≈ 1; span 0 by the older ones
    assert (old[n0:] - mu[n0:]).abs().max() < 1e-3
    assert (old[:n0] - mu[:n0]).abs().max() > 1e-2
    w = correction_weights(old, mu, torch.zeros(len(mu), dtype=torch.long), 1, "tis")
    expected = [min(math.exp(o - m), 2.0) for o, m in zip(old.tolist(), mu.tolist(), strict=True)]
    assert w.tolist() == pytest.approx(expected, rel=1e-9)
    assert w[n0:].sub(1).abs().max() < 1e-3


def test_gspo_sequence_ratio_over_spans_of_several_versions() -> None:
    """s_i = exp(mean over the episode's kept tokens of log π_θ − log π_old): π_old is the
    trainer's one set of weights at the step's start, whatever version sampled each token, so
    s_i does not depend on the spans' versions; those enter through the per-token correction
    weights (their own μ) only."""
    logp = torch.tensor([-1.0, -2.0, -0.5, -0.7], dtype=torch.float64)
    old = torch.tensor([-1.1, -1.9, -0.5, -0.9], dtype=torch.float64)
    episode = torch.zeros(4, dtype=torch.long)
    keep = torch.ones(4, dtype=torch.bool)
    s = sequence_log_ratio(logp, old, episode, keep, torch.tensor([4]))
    assert float(s[0]) == pytest.approx(((0.1) + (-0.1) + 0.0 + 0.2) / 4)
    # two spans sampled by versions 0 and 1 (different μ): the ratio is the same
    mu_v0 = torch.tensor([-3.0, -3.0, -0.5, -0.9], dtype=torch.float64)
    mu_v1 = torch.tensor([-1.1, -1.9, -0.5, -0.9], dtype=torch.float64)
    w0 = correction_weights(old, mu_v0, episode, 1, "tis")
    w1 = correction_weights(old, mu_v1, episode, 1, "tis")
    assert w0[:2].tolist() == [2.0, 2.0] and w1.tolist() == [1.0] * 4
    assert torch.equal(sequence_log_ratio(logp, old, episode, keep, torch.tensor([4])), s)


def test_a_sample_written_before_spans_reads_as_one_span(tmp_path: Path) -> None:
    import json

    from legorl.records import RecordError

    old = {
        "schema": "legorl/sample@1",
        "sample_id": "e/0",
        "episode_id": "e",
        "group_id": "g",
        "segment_index": 0,
        "segment_count": 1,
        "input_ids": [1, 2, 3],
        "loss_mask": [0, 1, 1],
        "rollout_logprobs": [-0.1, -0.2],
        "reward": 1.0,
        "policy_version": 4,
    }
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps(old) + "\n")
    (sample,) = list(read_jsonl(path, Sample))
    assert sample.span_versions == [] and sample.oldest_version == 4
    assert sample.token_versions() == [4, 4]
    # spans that do not cover the loss tokens are named
    path.write_text(json.dumps({**old, "span_versions": [4], "span_lengths": [3]}) + "\n")
    with pytest.raises(RecordError, match="span_lengths"):
        list(read_jsonl(path, Sample))
