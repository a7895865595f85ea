"""Test helpers for the trainer: samples made by the tiny model itself (real sampling, log-probs
scored by the engines' own `token_logprobs`), and a way to run the `legorl` command."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from legorl.records import Sample

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "fixtures" / "models" / "tiny-qwen3"
MOE = ROOT / "fixtures" / "models" / "tiny-qwen3-moe"
PROMPTS = [
    "def add(a, b):",
    "Fix the failing test in bank.py",
    "The interval merge is off by one.",
    "Return the total of the cart.",
]


@functools.cache
def prompt_ids(model_dir: Path, k: int) -> list[int]:
    from legorl.engines.models import load_tokenizer

    tok = load_tokenizer(model_dir)
    return tok(PROMPTS[k % len(PROMPTS)])["input_ids"]


def sample_completions(
    model, prompt: list[int], n: int, n_new: int, gen: torch.Generator
) -> list[list[int]]:
    """``n`` completions of ``n_new`` tokens, ancestral sampling at T = 1 from the raw
    distribution, all ``n`` advanced together as one batch."""
    ids = torch.tensor([prompt] * n)  # [n, P]
    with torch.no_grad():
        for _ in range(n_new):
            logits = model(input_ids=ids, use_cache=False).logits[:, -1]  # [n, V]
            nxt = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=gen)
            ids = torch.cat([ids, nxt], dim=1)
    return ids[:, len(prompt) :].tolist()


def make_samples(
    model_dir: Path = MODEL,
    *,
    groups: int = 2,
    group_size: int = 4,
    n_new: int = 6,
    segments: int = 1,
    seed: int = 0,
    reward: Callable[[list[int]], float] | None = None,
    model=None,
    temperature: float = 1.0,
) -> list[Sample]:
    """``groups`` × ``group_size`` episodes of ``segments`` segments each, sampled by the model.

    Each segment is a prompt plus a sampled completion; later segments start afresh (as after a
    compaction) with another prompt. The default reward varies within each group. Rollout
    log-probs are scored at ``temperature`` (≠ 1 reproduces verl #6240's mismatch).
    """
    from legorl.engines.models import load_model, token_logprobs

    model = model if model is not None else load_model(model_dir)
    gen = torch.Generator().manual_seed(seed)
    out: list[Sample] = []
    for g in range(groups):
        drawn = [
            sample_completions(model, prompt_ids(model_dir, g + s), group_size, n_new, gen)
            for s in range(segments)
        ]
        for k in range(group_size):
            episode = f"g{g}-e{k}"
            segs = []
            completions: list[int] = []
            for s in range(segments):
                prompt, completion = prompt_ids(model_dir, g + s), drawn[s][k]
                completions += completion
                ids = prompt + completion
                lps = token_logprobs(model, ids, start=len(prompt), temperature=temperature)
                segs.append((ids, [0] * len(prompt) + [1] * len(completion), lps))
            r = reward(completions) if reward is not None else float(k % 2) + 0.25 * g
            for s, (ids, mask, lps) in enumerate(segs):
                out.append(
                    Sample(
                        sample_id=f"{episode}/{s}",
                        episode_id=episode,
                        group_id=f"g{g}",
                        segment_index=s,
                        segment_count=segments,
                        input_ids=ids,
                        loss_mask=mask,
                        rollout_logprobs=lps,
                        reward=r,
                    )
                )
    return out


def legorl(*args: str, stdin: bytes = b"", env: dict | None = None, timeout: float = 600):
    return subprocess.run(
        [sys.executable, "-m", "legorl.cli.main", *args],
        input=stdin,
        capture_output=True,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1", **(env or {})},
        timeout=timeout,
        cwd=ROOT,
    )


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


GOLDEN = ROOT / "tests" / "data" / "train" / "samples.jsonl"


def write_golden() -> None:
    """Rebuild tests/data/train/samples.jsonl: 2 groups × 4 episodes × 2 segments, sampled and
    scored by tiny-qwen3 (``python tests/train/train_helpers.py``)."""
    from legorl.records import JsonlWriter

    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.unlink(missing_ok=True)
    with JsonlWriter(GOLDEN) as writer:
        writer.write_many(make_samples(groups=2, group_size=4, segments=2, n_new=6, seed=0))


if __name__ == "__main__":
    write_golden()
