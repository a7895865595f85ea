"""LoRA against full weights, side by side in one run (`python -m legorl.bench --only lora`), on
``fixtures/models/tiny-agent`` (fp32):

* trainer: steady-state step time (``step_s`` of steps 2-3 of one call) and peak memory
  (``peak_memory_mb``: the process's peak RSS during a step on CPU, allocated bytes on CUDA) of a
  LoRA step (rank 8, every linear layer) against a full-parameter step, on the same packed
  toy-shaped samples, each call in a fresh process;
* sync, embedded engine: bytes of the weight files a push moves (the adapter against the model)
  and seconds of ``load_weights`` of each, alternated, medians;
* sync, vLLM (when it is installed): seconds of a runtime adapter load (``/v1/load_lora_adapter``
  under a new name) against a full reload (``collective_rpc reload_weights`` + prefix-cache
  reset), alternated on one ``lora=true`` server; and output tokens/s of 8 concurrent requests
  (300 random prompt tokens, 64 sampled) through an adapter against the base weights.

The ratios are the figures; the absolute numbers move with the machine's load.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RANK = 8


def _train_figures(model: Path, work: Path, samples: Path, *, lora: bool) -> dict[str, Any]:
    """One 3-step call in a fresh process (so neither run's peak memory holds the other's)."""
    out = work / ("adapter" if lora else "full")
    code = "from legorl.bench.lora import _train_main; _train_main()"
    done = subprocess.run(
        [sys.executable, "-c", code, str(model), str(samples), str(out), str(int(lora))],
        capture_output=True,
        check=False,
        timeout=1800,
    )
    if done.returncode != 0:
        raise RuntimeError(f"bench lora: the train run failed: {done.stderr.decode()[-2000:]}")
    figures: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return {**figures, "out": out}


def _train_main() -> None:
    from legorl.records import Sample, read_jsonl
    from legorl.train.config import TrainConfig
    from legorl.train.trainer import train

    model, samples, out, lora = sys.argv[1:5]
    extra: dict[str, Any] = {"lora": True, "lora_rank": RANK, "lr": 1e-3}
    config = TrainConfig(
        steps=3, drop_zero_variance_groups=False, **(extra if lora == "1" else {"lr": 1e-4})
    )
    result = train(list(read_jsonl(Path(samples), Sample)), model=model, out=out, config=config)
    step = [float(m.value or 0) for m in result.metrics if m.name == "step_s"]
    peak = [float(m.value or 0) for m in result.metrics if m.name == "peak_memory_mb"]
    print(json.dumps({"step_s": statistics.median(step[1:]), "peak_memory_mb": max(peak)}))


def _weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


async def _alternate(engine: Any, paths: dict[str, Path], rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(rounds):
        for name, path in paths.items():
            t0 = time.perf_counter()
            await engine.load_weights(str(path))
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


async def _tokens_per_s(engine: Any, adapter: str | None, prompts: list[list[int]]) -> float:
    from legorl.protocols import GenerationRequest

    async def one(prompt: list[int]) -> int:
        request = GenerationRequest(prompt_ids=prompt, max_tokens=64, adapter=adapter)
        n = 0
        async for chunk in engine.generate(request):
            n += len(chunk)
        return n

    t0 = time.perf_counter()
    done = await asyncio.gather(*(one(p) for p in prompts))
    return sum(done) / (time.perf_counter() - t0)


def _embedded(model: Path, full: Path, adapter: Path, rounds: int) -> dict[str, Any]:
    from legorl.engines.embedded import EmbeddedConfig, EmbeddedEngine

    async def run() -> dict[str, float]:
        engine = EmbeddedEngine(EmbeddedConfig(model_path=str(model)))
        try:
            return await _alternate(engine, {"adapter": adapter, "full": full}, rounds)
        finally:
            await engine.close()

    sync = asyncio.run(run())
    return {
        "adapter_bytes": _weight_bytes(adapter),
        "full_bytes": _weight_bytes(full),
        "bytes_ratio": round(_weight_bytes(adapter) / _weight_bytes(full), 5),
        "adapter_sync_s": round(sync["adapter"], 4),
        "full_sync_s": round(sync["full"], 4),
        "sync_s_ratio": round(sync["adapter"] / sync["full"], 4),
    }


def _vllm(model: Path, full: Path, adapter: Path, rounds: int, work: Path) -> dict[str, Any]:
    from legorl.bench.vllm import _vllm_python
    from legorl.engines.vllm_client import VllmConfig, VllmEngine

    python = _vllm_python()
    if python is None:
        return {"skipped": "no vLLM installed (set LEGORL_VLLM_PYTHON or make .venv-vllm)"}
    config = VllmConfig(
        model_path=str(model),
        python=python,
        max_model_len=2048,
        kv_cache_memory="512M",
        lora=True,
        max_loras=2,
        max_lora_rank=RANK,
        log_path=str(work / "vllm-lora.log"),
    )
    engine = VllmEngine(config)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 3000) for _ in range(300)] for _ in range(8)]

    async def run() -> dict[str, Any]:
        try:
            sync = await _alternate(engine, {"adapter": adapter, "full": full}, rounds)
            await engine.load_weights(str(model))  # the base is the policy again
            await engine.load_adapter("bench", str(adapter))
            await _tokens_per_s(engine, None, prompts)  # warm-up
            base, lora = [], []
            for _ in range(rounds):
                base.append(await _tokens_per_s(engine, None, prompts))
                lora.append(await _tokens_per_s(engine, "bench", prompts))
            return {
                "adapter_sync_s": round(sync["adapter"], 4),
                "full_sync_s": round(sync["full"], 4),
                "sync_s_ratio": round(sync["adapter"] / sync["full"], 4),
                "base_tokens_per_s": round(statistics.median(base), 1),
                "adapter_tokens_per_s": round(statistics.median(lora), 1),
                "tokens_per_s_ratio": round(statistics.median(lora) / statistics.median(base), 4),
                "cpu_lora_ops": _cpu_lora_ops(python, model, 5 if rounds == 1 else 30),
            }
        finally:
            await engine.close()

    return asyncio.run(run())


#: vLLM's CPU LoRA kernels (``vllm.lora.ops.torch_ops``: shrink and expand) on one projection
#: of the bench model, against the same adapter as two plain matmuls and against the base
#: layer's matmul, in vLLM's own interpreter. Prints a JSON object.
_CPU_LORA_OPS = """
import json, sys, time, torch
from vllm.lora.ops.torch_ops import bgmv_expand, bgmv_shrink
torch.manual_seed(0)
hidden, out_dim, rank, slots, reps = (int(x) for x in sys.argv[1:6])
result = {}
for name, tokens in (("prefill_2400_tokens", 2400), ("decode_8_tokens", 8)):
    x = torch.randn(tokens, hidden)
    a, b = torch.randn(slots, rank, hidden), torch.randn(slots, out_dim, rank)
    w = torch.randn(out_dim, hidden)
    which = torch.zeros(tokens, dtype=torch.long)
    mid, y = torch.zeros(tokens, rank), torch.zeros(tokens, out_dim)

    def vllm_ops():
        bgmv_shrink(x, a, mid, which, 1.0)
        bgmv_expand(mid, b, y, which, True)

    def two_matmuls():
        y.add_((x @ a[0].T) @ b[0].T)

    def base():
        return x @ w.T

    times = {}
    for label, fn in (("vllm_ops", vllm_ops), ("two_matmuls", two_matmuls), ("base", base)):
        fn()
        samples = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        times[label] = sorted(samples)[len(samples) // 2]
    result[name] = {
        "vllm_ops_ms": round(times["vllm_ops"] * 1e3, 4),
        "two_matmuls_ms": round(times["two_matmuls"] * 1e3, 4),
        "base_matmul_ms": round(times["base"] * 1e3, 4),
        "vllm_ops_over_two_matmuls": round(times["vllm_ops"] / times["two_matmuls"], 2),
        "vllm_ops_over_base": round(times["vllm_ops"] / times["base"], 2),
        "gathered_mb": round(tokens * (rank * hidden + out_dim * rank) * 4 / 1e6, 2),
    }
print(json.dumps(result))
"""


def _cpu_lora_ops(python: str, model: Path, reps: int) -> dict[str, Any]:
    """Why vLLM-CPU samples slower through an adapter: its CPU LoRA kernels gather a copy of
    the adapter's matrices for every token (``lora_b_weights[indices]``, then a batched
    ``einsum``), instead of one matmul per adapter. Timed on the model's MLP up projection."""
    import json
    import subprocess

    cfg = json.loads((model / "config.json").read_text())
    args = [cfg["hidden_size"], cfg["intermediate_size"], RANK, 2, reps]
    done = subprocess.run(
        [python, "-c", _CPU_LORA_OPS, *map(str, args)], capture_output=True, text=True
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip()[-400:]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def bench_lora(quick: bool = False) -> dict[str, Any]:
    from legorl.bench.train import toy_like_samples
    from legorl.bench.vllm import _model
    from legorl.records import write_jsonl
    from legorl.train.model import load_policy

    model = _model()
    samples = toy_like_samples(load_policy(model), 1 if quick else 4, max_len=2048)
    rounds = 1 if quick else 3
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = work / "samples.jsonl"
        write_jsonl(data, samples)
        full = _train_figures(model, work, data, lora=False)
        lora = _train_figures(model, work, data, lora=True)
        trainer = {
            "tokens": sum(len(s.input_ids) for s in samples),
            "full_step_s": round(full["step_s"], 4),
            "lora_step_s": round(lora["step_s"], 4),
            "step_s_ratio": round(lora["step_s"] / full["step_s"], 4),
            "full_peak_memory_mb": round(full["peak_memory_mb"], 1),
            "lora_peak_memory_mb": round(lora["peak_memory_mb"], 1),
        }
        embedded = _embedded(model, full["out"], lora["out"], rounds)
        vllm = _vllm(model, full["out"], lora["out"], rounds, work)
    return {
        "model": model.name,
        "rank": RANK,
        "trainer": trainer,
        "embedded": embedded,
        "vllm": vllm,
    }
