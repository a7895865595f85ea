"""Trainer cost, measured side by side in one run (`python -m legorl.bench --only train`).

Samples are shaped like toy agent episodes — a 1-2k-token system prompt and task, then turns of
tool output (prompt) and completion (loss tokens), one to three segments — with random token ids,
and rollout log-probs scored by a real forward pass of the tiny model (``token_logprobs``).

* step / plain: the trainer's steady-state step time (``step_s`` of steps 2-3 of a call: log-probs,
  loss with π_old and corrections, backward, clip, AdamW step, metrics' bookkeeping) against a
  plain forward + backward of the same packed micro-batches through the same scorer (mean
  log-likelihood of the loss tokens, no optimizer) — target <= 1.3, on wall-clock and on CPU
  time. Beside it: step 1 of a call (π_old fused into its forward, plus the allocator warm-up of a
  freshly loaded model), and a transformers-native baseline (``model(input_ids, position_ids,
  labels)``: full-vocabulary logits everywhere, block-diagonal SDPA mask).
* padding waste of the packed micro-batches (target < 10%) at several ``pad_to_multiple_of``,
  beside padding every sample of a batch to its longest (a ``[B, T]`` tensor).
* peak memory per token at 4k and 16k tokens per micro-batch: the peak during one train step
  (CUDA: allocated bytes; CPU: the process's peak RSS, reset before the step), each budget in a
  fresh process; the per-token figure is the slope between the two budgets, so the model,
  optimizer and libraries (the same in both) cancel out.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from legorl.records import Sample


def _model_dir() -> Path:
    env = os.environ.get("LEGORL_BENCH_MODEL")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for base in (Path.cwd(), *here.parents):
        cand = base / "fixtures" / "models" / "tiny-qwen3"
        if (cand / "config.json").is_file():
            return cand
    raise FileNotFoundError("fixtures/models/tiny-qwen3 not found; set LEGORL_BENCH_MODEL")


def _toy_episode(rng: random.Random, max_len: int) -> list[tuple[int, list[int]]]:
    """Segments as (length, loss positions): a long first prompt, then prompt/completion turns."""
    segments = []
    for _ in range(rng.choice([1, 1, 1, 2, 2, 3])):
        pos, mask_spans = rng.randint(1000, 2000), []
        for _ in range(rng.randint(1, 10)):  # turns, until the episode ends or the context is full
            completion = rng.randint(40, 300)
            tool = rng.randint(60, 700)
            if pos + completion > max_len:
                break
            mask_spans.append((pos, pos + completion))
            pos += completion + tool
        length = min(pos, max_len)
        loss = [t for a, b in mask_spans for t in range(a, min(b, length))]
        segments.append((length, loss))
    return segments


def toy_like_lengths(n_episodes: int, seed: int = 0, max_len: int = 4096) -> list[list[int]]:
    rng = random.Random(seed)
    return [[n for n, _ in _toy_episode(rng, max_len)] for _ in range(n_episodes)]


def toy_like_samples(
    model: Any, n_episodes: int, *, seed: int = 0, max_len: int = 4096
) -> list[Sample]:
    """Toy-shaped samples in groups of 4, with log-probs scored by ``model`` (real forwards)."""
    from legorl.engines.models import token_logprobs

    rng = random.Random(seed)
    out = []
    for e in range(n_episodes):
        segs = _toy_episode(rng, max_len)
        reward = float(rng.random() < 0.5)
        for s, (length, loss) in enumerate(segs):
            ids = [rng.randrange(3, 3000) for _ in range(length)]
            mask = [0] * length
            for t in loss:
                mask[t] = 1
            lps = token_logprobs(model, ids, start=1, temperature=1.0)
            out.append(
                Sample(
                    sample_id=f"b{e}/{s}",
                    episode_id=f"b{e}",
                    group_id=f"g{e // 4}",
                    segment_index=s,
                    segment_count=len(segs),
                    input_ids=ids,
                    loss_mask=mask,
                    rollout_logprobs=[lps[t - 1] for t in range(1, length) if mask[t]],
                    reward=reward,
                )
            )
    return out


# --------------------------------------------------------------------------------------------
# Step time against a plain forward + backward
# --------------------------------------------------------------------------------------------


def _micro_batches(samples: list[Sample], budget: int) -> list[Any]:
    from legorl.train.packing import build_micro_batch, pack_lengths

    episodes: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        episodes.setdefault(s.episode_id, []).append(i)
    bins = pack_lengths([len(s.input_ids) for s in samples], list(episodes.values()), budget)
    return [
        build_micro_batch(
            [samples[i].input_ids for i in b], [samples[i].loss_mask for i in b], [0] * len(b)
        )
        for b in bins
    ]


def _plain_pass(scorer: Any, batches: list[Any]) -> tuple[float, float]:
    """(wall, CPU) seconds of a forward + backward over ``batches``."""
    t0, c0 = time.perf_counter(), time.process_time()
    for mb in batches:
        logp, _ = scorer(
            mb.input_ids,
            mb.position_ids,
            mb.logit_index,
            mb.targets,
            **mb.attention_kwargs("varlen_sdpa"),
        )
        (-logp.mean()).backward()
    return time.perf_counter() - t0, time.process_time() - c0


def _native_pass(lm: Any, batches: list[Any]) -> tuple[float, float]:
    import torch

    t0, c0 = time.perf_counter(), time.process_time()
    for mb in batches:
        labels = torch.full_like(mb.input_ids, -100)
        labels[0, mb.logit_index + 1] = mb.targets
        lm(input_ids=mb.input_ids, position_ids=mb.position_ids, labels=labels).loss.backward()
    return time.perf_counter() - t0, time.process_time() - c0


def _step_ratio(model_dir: Path, samples: list[Sample], rounds: int) -> dict[str, Any]:
    import torch

    from legorl.train.config import TrainConfig
    from legorl.train.model import TokenScorer, load_policy
    from legorl.train.trainer import train

    # every toy episode (up to 3 × 4k tokens) fits one micro-batch: none is split, so no step
    # needs the extra no-grad pass that GSPO takes for split episodes after the first update
    budget = 16384

    def steps_of(steps: int, out: Path) -> list[tuple[float, float]]:
        config = TrainConfig(steps=steps, lr=1e-6, micro_batch_tokens=budget)
        result = train(samples, model=model_dir, out=out, config=config)
        got = {(m.step, m.name): float(m.value or 0) for m in result.metrics}
        return [(got[(k, "step_s")], got[(k, "step_cpu_s")]) for k in range(1, steps + 1)]

    batches = _micro_batches(samples, budget)
    lm = load_policy(model_dir)
    scorer = TokenScorer(lm)
    native_lm = load_policy(model_dir, attention="sdpa")
    first_s, steady_s, plain_s, native_s = [], [], [], []
    # One CPU thread: on a shared machine every OpenMP parallel region waits at its barrier for
    # a thread the scheduler parked, so the run with more small ops (the train step) is slowed
    # more; one thread measures the work. GPUs are unaffected.
    threads = torch.get_num_threads()
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    with contextlib.ExitStack() as stack:
        stack.callback(torch.set_num_threads, threads)
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        _plain_pass(scorer, batches)  # warm-up
        for _ in range(rounds):  # interleaved, so drifting machine load hits all alike
            # step 1 of a call takes π_old from its own forward and pays the allocator's
            # warm-up of a freshly loaded model; steps 2 and 3 are the steady state
            got = steps_of(3, Path(tmp) / "ckpt")
            first_s.append(got[0])
            steady_s += got[1:]
            plain_s.append(_plain_pass(scorer, batches))
            native_s.append(_native_pass(native_lm, batches))
            lm.zero_grad(set_to_none=True)
            native_lm.zero_grad(set_to_none=True)

    def med(xs: list[tuple[float, float]], k: int) -> float:
        return statistics.median(x[k] for x in xs)

    tokens = sum(len(s.input_ids) for s in samples)
    return {
        "samples": len(samples),
        "tokens": tokens,
        "loss_tokens": sum(len(s.rollout_logprobs) for s in samples),
        "micro_batch_tokens": budget,
        "micro_batches": len(batches),
        "torch_threads": 1 if not torch.cuda.is_available() else threads,
        "train_step_s": med(steady_s, 0),
        "first_step_of_call_s": med(first_s, 0),
        "plain_fwd_bwd_s": med(plain_s, 0),
        "native_hf_fwd_bwd_s": med(native_s, 0),
        # wall-clock ratios, and the same on this process's CPU time (steadier when other jobs
        # share the machine)
        "step_over_plain": med(steady_s, 0) / med(plain_s, 0),
        "step_over_plain_cpu": med(steady_s, 1) / med(plain_s, 1),
        "first_step_over_plain": med(first_s, 0) / med(plain_s, 0),
        "first_step_over_plain_cpu": med(first_s, 1) / med(plain_s, 1),
        "step_over_native_hf": med(steady_s, 0) / med(native_s, 0),
        "target_step_over_plain": 1.3,
    }


# --------------------------------------------------------------------------------------------
# Padding waste
# --------------------------------------------------------------------------------------------


def _padding(n_episodes: int) -> dict[str, Any]:
    from legorl.train.packing import pack_lengths, padded_length

    episodes = toy_like_lengths(n_episodes, seed=1)
    lengths = [n for ep in episodes for n in ep]
    members, i = [], 0
    for ep in episodes:
        members.append(list(range(i, i + len(ep))))
        i += len(ep)
    out: dict[str, Any] = {"samples": len(lengths), "mean_tokens": statistics.mean(lengths)}
    for budget in (8192, 16384):
        bins = pack_lengths(lengths, members, budget)
        real = sum(lengths)
        out[f"budget_{budget}_fill"] = real / (len(bins) * budget)
        for multiple in (1, 64, 128):
            total = sum(padded_length(sum(lengths[j] for j in b), multiple) for b in bins)
            out[f"budget_{budget}_pad{multiple}_waste"] = 1 - real / total
    # baseline: batches of 4 samples padded to their longest, in input order
    padded = sum(
        max(lengths[k : k + 4]) * len(lengths[k : k + 4]) for k in range(0, len(lengths), 4)
    )
    out["baseline_pad_to_longest_of_4_waste"] = 1 - sum(lengths) / padded
    out["target_waste"] = 0.10
    return out


# --------------------------------------------------------------------------------------------
# Peak memory per token
# --------------------------------------------------------------------------------------------


def _peak_for_budget(budget: int, attention: str) -> dict[str, Any]:
    """One train step whose single micro-batch holds ``budget`` tokens (run in a fresh process)."""
    from legorl.engines.models import load_model
    from legorl.train.config import build_config
    from legorl.train.trainer import train

    model_dir = _model_dir()
    model = load_model(model_dir)
    per = min(4096, budget)
    rng = random.Random(budget)
    samples = []
    from legorl.engines.models import token_logprobs

    for k in range(budget // per):
        ids = [rng.randrange(3, 3000) for _ in range(per)]
        mask = (
            [0] * 1024 + [1] * (per - 1024)
            if per > 2048
            else [0] * (per // 4) + [1] * (per - per // 4)
        )
        lps = token_logprobs(model, ids, start=1, temperature=1.0)
        samples.append(
            Sample(
                sample_id=f"m{k}",
                episode_id=f"m{k}",
                group_id="g",
                segment_index=0,
                segment_count=1,
                input_ids=ids,
                loss_mask=mask,
                rollout_logprobs=[lps[t - 1] for t in range(1, per) if mask[t]],
                reward=float(k % 2),
            )
        )
    del model
    config = build_config(overrides=[f"micro_batch_tokens={budget}", f"attention={attention}"])
    result = train(samples, model=model_dir, out=None, config=config, dry_run=True)
    got = {m.name: m.value for m in result.metrics}
    return {
        "tokens": sum(len(s.input_ids) for s in samples),
        "micro_batches": got["micro_batches"],
        "peak_mb": got["peak_memory_mb"],
        "step_s": got["step_s"],
    }


def _peak_memory(budgets: tuple[int, ...], attention: str) -> dict[str, Any]:
    out: dict[str, Any] = {"attention": attention}
    for budget in budgets:
        proc = subprocess.run(
            [sys.executable, "-m", "legorl.bench.train", "--peak", str(budget), attention],
            capture_output=True,
            timeout=1800,
            # glibc then returns every freed block over 64 KiB at once, so the peak RSS tracks
            # the tensors alive at the peak rather than what the allocator kept from earlier
            env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"},
        )
        if proc.returncode != 0:
            out[f"{budget}"] = {"error": proc.stderr.decode()[-500:]}
            continue
        got = json.loads(proc.stdout.decode().strip().splitlines()[-1])
        got["peak_bytes_per_token"] = got["peak_mb"] * 2**20 / got["tokens"]  # all of it
        out[f"{budget}"] = got
    lo, hi = (out.get(str(b), {}) for b in (budgets[0], budgets[-1]))
    if "peak_mb" in lo and "peak_mb" in hi and hi["tokens"] > lo["tokens"]:
        slope = (hi["peak_mb"] - lo["peak_mb"]) * 2**20 / (hi["tokens"] - lo["tokens"])
        out["bytes_per_token"] = slope
        import torch

        out["measure"] = "cuda allocated" if torch.cuda.is_available() else "cpu peak rss"
    return out


def bench_train(quick: bool = False) -> dict[str, Any]:
    from transformers.utils import logging as hf_logging

    from legorl.engines.models import load_model

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model_dir = _model_dir()
    # --quick (the CI smoke test) proves each part runs and reports: one group of episodes, one
    # round, and the memory slope between two smaller budgets.
    samples = toy_like_samples(load_model(model_dir), 4 if quick else 16, seed=0)
    report: dict[str, Any] = {
        "step": _step_ratio(model_dir, samples, rounds=1 if quick else 4),
        "padding": _padding(64 if quick else 512),
        "peak_memory": _peak_memory((2048, 8192) if quick else (4096, 16384), "varlen_sdpa"),
    }
    if not quick:
        report["peak_memory_block_mask_sdpa"] = _peak_memory((4096, 16384), "sdpa")
    return report


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--peak":
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        print(json.dumps(_peak_for_budget(int(sys.argv[2]), sys.argv[3])))
    else:
        print(json.dumps(bench_train(quick="--quick" in sys.argv), indent=2))
