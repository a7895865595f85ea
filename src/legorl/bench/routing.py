"""MoE routing replay figures (`python -m legorl.bench --only routing`), each beside its
baseline in the same run, on the ``tiny-qwen3-moe`` fixture:

* rollout/trainer mismatch: a bf16 (and, as the control, an fp32) embedded engine samples
  agent-shaped sessions through the real proxy, align makes Samples, the fp32 trainer scores
  π_old with ``router_replay`` off and ``r3``: routing mismatch, Pearson(prob), share of
  tokens with |Δ log-prob| > 0.1;
* trainer step time with replay against without, on the same packed tokens;
* sidecar bytes per token, and align time with routing against without (the same Turns with
  their ``routing`` references dropped);
* embedded engine tokens/s with capture against without.

``routed_samples`` is also what the routing tests train on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from legorl.records import Sample, Trajectory

ROOT = Path(__file__).resolve().parents[3]
MOE = ROOT / "fixtures" / "models" / "tiny-qwen3-moe"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]
_ASKS = [
    "list the files please",
    "the test in bank.py fails, fix it",
    "merge the intervals without the off-by-one",
    "return the total of the cart",
]


def routed_sessions(
    out: Path,
    *,
    model: Path = MOE,
    dtype: str = "bfloat16",
    groups: int = 2,
    group_size: int = 4,
    calls: int = 2,
    max_tokens: int = 24,
    seed: int = 0,
) -> list[Trajectory]:
    """``groups`` × ``group_size`` sessions of ``calls`` calls each, sampled at T = 1 by the
    embedded engine through the proxy (Turns and routing sidecars in ``out``); the trajectories
    refer to them (relative to ``out``), rewards alternate within each group."""
    from legorl.engines import make_engine
    from legorl.proxy.core import ProxyConfig, ProxyCore

    async def run() -> list[Trajectory]:
        engine = make_engine("embedded", model_path=str(model), dtype=dtype)
        core = ProxyCore(ProxyConfig(model=model, out=out), engine)
        trajs = []
        try:
            for g in range(groups):
                for k in range(group_size):
                    sid = f"g{g}-e{k}"
                    msgs: list[dict[str, Any]] = [
                        {"role": "user", "content": _ASKS[g % len(_ASKS)]}
                    ]
                    for c in range(calls):
                        body = orjson.dumps(
                            {
                                "model": "m",
                                "messages": msgs,
                                "tools": TOOLS,
                                "max_tokens": max_tokens,
                                "seed": seed * 1000 + g * 100 + k * 10 + c,
                            }
                        )
                        res = await core.handle(
                            "POST", f"/s/{sid}/v1/chat/completions", "", {}, body
                        )
                        assert isinstance(res.body, bytes) and res.status == 200, res.body
                        reply = orjson.loads(res.body)["choices"][0]["message"]
                        msgs.append({"role": "assistant", "content": reply.get("content") or ""})
                        msgs.append({"role": "user", "content": f"result {c}: ok"})
                    trajs.append(
                        Trajectory(
                            trajectory_id=sid,
                            task_id=f"t{g}",
                            group_id=f"t{g}",
                            sample_index=k,
                            harness="bench",
                            status="ok",
                            turns_ref=[f"{sid}.jsonl"],
                            reward=float(k % 2),
                        )
                    )
        finally:
            core.close()
            await engine.close()
        return trajs

    return asyncio.run(run())


def routed_samples(out: Path, **kwargs: Any) -> list[Sample]:
    """``routed_sessions`` aligned into Samples carrying routing."""
    from legorl.align import align

    return list(align(routed_sessions(out, **kwargs), base_dir=out))


def _pi_old_figures(samples: list[Sample], mode: str) -> dict[str, Any]:
    from legorl.train.config import TrainConfig
    from legorl.train.trainer import train

    config = TrainConfig(router_replay=mode, steps=1)  # type: ignore[arg-type]
    result = train(samples, model=MOE, out=None, config=config, dry_run=True)
    got = {m.name: m.value for m in result.metrics}
    return {
        "routing_mismatch": got.get("routing_mismatch"),
        "router_disagreement": got.get("router_disagreement"),
        "pearson": got.get("rollout_trainer_pearson"),
        "logprob_diff_over_0.1": got.get("logprob_diff_over_0.1"),
        "step_s": got.get("step_s"),
        "loss_tokens": got.get("loss_tokens"),
    }


def _median_step_s(samples: list[Sample], mode: str, passes: int) -> float:
    return statistics.median(
        float(_pi_old_figures(samples, mode)["step_s"] or 0.0) for _ in range(passes)
    )


def _align_s(trajs: list[Trajectory], base: Path, passes: int) -> float:
    from legorl.align import align

    times = []
    for _ in range(passes):
        t0 = time.perf_counter()
        for _ in align(trajs, base_dir=base):
            pass
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _without_routing(src: Path, dst: Path, trajs: list[Trajectory]) -> None:
    from legorl.records import Turn, read_jsonl, write_jsonl

    for t in trajs:
        for ref in t.turns_ref or ():
            turns = [dataclasses.replace(x, routing=None) for x in read_jsonl(src / ref, Turn)]
            write_jsonl(dst / ref, turns)


def _engine_rate(capture: bool, tokens: int, batch: int) -> float:
    from legorl.engines import make_engine
    from legorl.protocols import GenerationRequest
    from legorl.routing import RoutingCapture

    async def run() -> float:
        engine = make_engine("embedded", model_path=str(MOE))

        async def one(i: int) -> int:
            req = GenerationRequest(
                prompt_ids=list(range(10 + i, 60 + i)),
                max_tokens=tokens,
                seed=i,
                stop_token_ids=[],
                routing=RoutingCapture() if capture else None,
            )
            n = 0
            async for chunk in engine.generate(req):
                n += len(chunk)
            return n

        try:
            await one(0)  # warm-up
            t0 = time.perf_counter()
            n = sum(await asyncio.gather(*(one(i) for i in range(batch))))
            return n / (time.perf_counter() - t0)
        finally:
            await engine.close()

    return asyncio.run(run())


def bench_routing(quick: bool = False) -> dict[str, Any]:
    passes = 1 if quick else 3
    size = dict(groups=2, group_size=2, calls=2) if quick else dict(groups=4, group_size=4, calls=3)
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        for dtype in ("bfloat16", "float32"):
            folder = base / dtype
            folder.mkdir()
            trajs = routed_sessions(folder, dtype=dtype, **size)  # type: ignore[arg-type]
            from legorl.align import align

            samples = list(align(trajs, base_dir=folder))
            report[f"engine_{dtype}"] = {
                mode: _pi_old_figures(samples, mode) for mode in ("off", "r3")
            }
            if dtype != "bfloat16":
                continue
            off, r3 = _median_step_s(samples, "off", passes), _median_step_s(samples, "r3", passes)
            report["step_s"] = {"off": off, "r3": r3, "r3_over_off": r3 / off if off else None}
            routed_bytes = sum(p.stat().st_size for p in folder.glob("*.routing"))
            tokens = sum(len(s.input_ids) for s in samples)
            plain = base / "plain"
            plain.mkdir()
            _without_routing(folder, plain, trajs)
            with_r, without = _align_s(trajs, folder, passes), _align_s(trajs, plain, passes)
            report["sidecar"] = {
                "bytes": routed_bytes,
                "tokens": tokens,
                "bytes_per_token": routed_bytes / tokens,
            }
            report["align_s"] = {
                "with_routing": with_r,
                "without": without,
                "with_over_without": with_r / without if without else None,
            }
    n_tok, batch = (16, 4) if quick else (64, 8)
    on = statistics.median(_engine_rate(True, n_tok, batch) for _ in range(passes))
    off_rate = statistics.median(_engine_rate(False, n_tok, batch) for _ in range(passes))
    report["engine_tokens_per_s"] = {
        "capture": on,
        "no_capture": off_rate,
        "capture_over_no_capture": on / off_rate,
    }
    return report
