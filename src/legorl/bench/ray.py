"""Rollouts on a local Ray cluster of 1, 2 and 3 nodes against in-process, Ray's overhead per
run, and recovery after a killed node (`python -m legorl.bench --only ray`).

The workload: the `scripted` harness (a fake shipping in the package) makes three calls to its
proxy session, each after a 50 ms pause standing for the engine's latency (the `forced` engine
itself answers in a few ms from a real forward pass of the tiny model); sandboxes are `local`
(bubblewrap). Every node has two run slots, and the in-process baseline runs two at once. All
the nodes share this machine's cores: each node's share is the cores over the nodes, so more
nodes add slots, not CPU, and the scaling says how well the driver keeps the slots busy.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

SLOTS = 2
_ASK = (
    "python3 -c 'import json, sys, time, urllib.request as u\n"
    'for word in ("a", "b", "c"):\n'
    "    time.sleep(0.05)\n"
    '    msgs = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": word}]\n'
    '    tools = [{"type": "function", "function": {"name": "bash", "parameters": {}}}]\n'
    '    body = json.dumps({"model": "m", "messages": msgs, "tools": tools})\n'
    '    req = u.Request(sys.argv[1], body.encode(), {"content-type": "application/json"})\n'
    "    u.urlopen(req, timeout=60).read()\n"
    '\' "$LEGORL_PROXY_URL/v1/chat/completions"'
)


def _paths(work: Path) -> tuple[Path, Path, Path]:
    root = Path(__file__).resolve().parents[3]
    script = work / "script.json"
    script.write_text(json.dumps([{"text": "ok", "repeat": True}]))
    return (
        root / "fixtures" / "tasks" / "train.jsonl",
        root / "fixtures" / "models" / "tiny-qwen3",
        script,
    )


def _runs(tasks_file: Path, n: int) -> list[Any]:
    from legorl.records import Task, read_jsonl
    from legorl.rollout import plan_runs

    tasks = list(read_jsonl(tasks_file, Task))
    return plan_runs(tasks, max(1, n // len(tasks) + 1), None, set())[:n]


async def _inprocess(
    runs: list[Any], tasks_file: Path, model: Path, script: Path, work: Path
) -> float:
    from legorl.harnesses.testing import ScriptedHarness
    from legorl.rollout import EngineSpec, RunContext, rollout, serve_engine
    from legorl.sandbox import make_backend

    spec = EngineSpec(name="forced", weights=model, options={"script": str(script)}, log_dir=work)
    async with serve_engine(model, spec, work / "turns-inprocess") as (endpoint, core):
        ctx = RunContext(
            harness=ScriptedHarness(command=_ASK),
            backend=make_backend("local"),
            proxy=endpoint,
            model=core.served_name,
            tasks_dir=tasks_file.parent,
            timeout=120,
            run_id="legorl-bench-inprocess",
            refs_relative_to=work,
        )
        start = time.perf_counter()
        statuses = [t.status async for t in rollout(runs, ctx, concurrency=SLOTS)]
    assert set(statuses) == {"ok"}, statuses
    return time.perf_counter() - start


def _cluster(n: int, tmp: Path) -> Any:
    from ray.cluster_utils import Cluster

    args: dict[str, Any] = {
        "num_cpus": 1,
        "resources": {"legorl_runs": SLOTS},
        "env_vars": {"OMP_NUM_THREADS": "1"},
    }
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            **args,
            "include_dashboard": False,
            "gcs_server_port": 0,
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3},
        },
    )
    nodes = [cluster.add_node(**args) for _ in range(n - 1)]
    return cluster, nodes


async def _on_ray(
    address: str,
    runs: list[Any],
    tasks_file: Path,
    model: Path,
    script: Path,
    work: Path,
    kill: Any = None,
) -> tuple[float, Any]:
    from legorl import __version__
    from legorl.executors.ray import RayExecutor, WorkerSetup
    from legorl.rollout import EngineSpec

    setup = WorkerSetup(
        version=__version__,
        harness="legorl.harnesses.testing:ScriptedHarness",
        harness_options={"command": _ASK},
        engine=EngineSpec(
            name="forced", weights=model, options={"script": str(script)}, log_dir=work
        ),
        model=str(model),
        tasks_dir=str(tasks_file.parent),
        timeout=120,
        run_id="legorl-bench-ray",
    )
    executor = RayExecutor(address, setup)
    await executor.start()
    turns = work / f"turns-{time.monotonic_ns()}"
    turns.mkdir()
    try:
        # warm: each worker starts its engine and proxy on its first run, outside the clock
        warm = [r for r in runs[: len(executor.stats.nodes) * SLOTS]]
        async for _ in executor.rollout_runs(warm, turns_dir=turns, refs_relative_to=work):
            pass
        executor.stats.runs.clear()
        start = time.perf_counter()
        done = 0
        async for traj in executor.rollout_runs(runs, turns_dir=turns, refs_relative_to=work):
            assert traj.status == "ok", traj.evidence
            done += 1
            if kill is not None and done == 1:
                kill()
        return time.perf_counter() - start, executor.stats
    finally:
        await executor.close()


def bench_ray(quick: bool = False) -> dict[str, Any]:
    import ray

    n_runs = 8 if quick else 24
    cores = os.cpu_count() or 1
    out: dict[str, Any] = {"runs": n_runs, "slots_per_node": SLOTS, "cores": cores}
    with tempfile.TemporaryDirectory(prefix="/tmp/lrb-") as tmp:
        work = Path(tmp)
        os.environ["RAY_TMPDIR"] = tmp
        tasks_file, model, script = _paths(work)
        runs = _runs(tasks_file, n_runs)
        base = asyncio.run(_inprocess(runs, tasks_file, model, script, work))
        out["inprocess"] = {"seconds": round(base, 2), "runs_per_s": round(n_runs / base, 2)}
        for n in (1, 2, 3):
            cluster, nodes = _cluster(n, work)
            try:
                secs, _stats = asyncio.run(
                    _on_ray(cluster.address, runs, tasks_file, model, script, work)
                )
            finally:
                ray.shutdown()
                cluster.shutdown()
            out[f"ray_{n}_nodes"] = {
                "seconds": round(secs, 2),
                "runs_per_s": round(n_runs / secs, 2),
                "cpu_share_per_node": round(cores / n, 2),
                "over_inprocess": round((n_runs / secs) / (n_runs / base), 3),
            }
        # Ray's overhead per run: one node (two slots) against in-process (two at once)
        out["overhead_per_run_1_node"] = round(out["ray_1_nodes"]["seconds"] / base, 3)
        cluster, nodes = _cluster(3, work)
        try:
            secs, stats = asyncio.run(
                _on_ray(
                    cluster.address, runs, tasks_file, model, script, work,
                    kill=lambda: cluster.remove_node(nodes[-1], allow_graceful=False),
                )
            )  # fmt: skip
        finally:
            ray.shutdown()
            cluster.shutdown()
        out["recovery"] = {
            "seconds": round(secs, 2),
            "extra_runs": sum(stats.lost.values()),
            "rescheduling_s_max": round(max(stats.rescheduled_s, default=0.0), 3),
        }
        os.environ.pop("RAY_TMPDIR", None)
    out["target_overhead_at_most"] = 1.10
    return out
