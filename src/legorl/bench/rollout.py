"""Rollouts per minute with the `mini` harness and the `embedded` engine on the toy set, at
concurrency 1, 4 and 8, in one run (`python -m legorl.bench --only rollout`).

The engine batches decoding across sessions, so more concurrent rollouts should finish more
per minute; the report gives the scaling ratio 8 vs 1. Sandboxes are `local` (bubblewrap).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from legorl.bench.proxy import _model_dir


async def _measure(concurrency: int, n_runs: int, tasks_file: Path, work: Path) -> dict[str, Any]:
    from legorl.harnesses import MiniHarness
    from legorl.protocols import Limits
    from legorl.records import Task, read_jsonl
    from legorl.rollout import EngineSpec, Progress, RunContext, plan_runs, rollout, serve_engine
    from legorl.sandbox import make_backend

    tasks = list(read_jsonl(tasks_file, Task))
    runs = plan_runs(tasks, 1, n_runs, set())
    engine = EngineSpec(weights=_model_dir(), log_dir=work)
    progress = Progress(total=len(runs))
    turns = work / f"turns-{concurrency}"
    async with serve_engine(_model_dir(), engine, turns) as (endpoint, core):
        ctx = RunContext(
            harness=MiniHarness(max_turns=3, max_tokens=96),
            backend=make_backend("local"),
            proxy=endpoint,
            model=core.served_name,
            tasks_dir=tasks_file.parent,
            timeout=600,
            run_id=f"legorl-bench-{concurrency}",
            refs_relative_to=work,
            limits=Limits(wall_s=900),
        )
        start = time.perf_counter()  # the engine is loaded: the figure is rollouts alone
        async for _ in rollout(runs, ctx, concurrency=concurrency, progress=progress):
            pass
    elapsed = time.perf_counter() - start
    return {
        "runs": len(runs),
        "seconds": round(elapsed, 2),
        "rollouts_per_min": round(len(runs) / elapsed * 60, 2),
        "completion_tokens": progress.completion_tokens,
        "by_status": dict(progress.by_status),
    }


async def _warm(tasks_file: Path, n_runs: int) -> None:
    """Build each task's sandbox layers first: the figure is rollouts, not image building."""
    from legorl.records import Task, read_jsonl
    from legorl.sandbox import make_backend

    backend = make_backend("local")
    for task in list(read_jsonl(tasks_file, Task))[:n_runs]:
        box = await backend.start(task, str(tasks_file.parent), run_id="legorl-bench-warm")
        await box.close()


def bench_rollout(quick: bool = False) -> dict[str, Any]:
    root = Path(__file__).resolve().parents[3]
    tasks_file = root / "fixtures" / "tasks" / "train.jsonl"
    n = 8 if quick else 16
    report: dict[str, Any] = {"harness": "mini", "engine": "embedded", "sandbox": "local"}
    asyncio.run(_warm(tasks_file, n))
    with tempfile.TemporaryDirectory(prefix="legorl-bench-rollout-") as tmp:
        for c in (1, 4, 8):
            report[f"concurrency_{c}"] = asyncio.run(_measure(c, n, tasks_file, Path(tmp)))
    report["scaling_8_vs_1"] = round(
        report["concurrency_8"]["rollouts_per_min"] / report["concurrency_1"]["rollouts_per_min"],
        2,
    )
    return report
