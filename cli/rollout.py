"""`legorl rollout`: run a harness on tasks in sandboxes through the proxy.

    legorl rollout --tasks fixtures/tasks/train.jsonl --harness mini --group-size 2 --limit 4 \\
        --engine embedded --model fixtures/models/tiny-qwen3 --sandbox local --out runs/traj.jsonl
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from pathlib import Path
from typing import Annotated, Any

import typer

from ._common import (
    MaxCallTokens,
    MaxEpisodeS,
    MaxEpisodeTokens,
    MaxEpisodeTurns,
    TaskFormat,
    budget,
    choices,
    console,
    fail,
    key_values,
    on_ray,
    require_images,
)

HELP = "Run a harness on tasks in sandboxes through the proxy; writes trajectories."


def rollout(
    tasks: Annotated[
        Path,
        typer.Option(
            "--tasks", "-t", help="Task file (.jsonl, .json, .parquet) or datasets folder."
        ),
    ],
    task_format: TaskFormat = None,
    harness: Annotated[str, typer.Option(help=choices("harness"))] = "mini",
    group_size: Annotated[int, typer.Option("--group-size", "-g", help="Samples per task.")] = 1,
    concurrency: Annotated[int, typer.Option("--concurrency", "-c", help="Runs at once.")] = 1,
    limit: Annotated[int | None, typer.Option(help="Only the first N tasks.")] = None,
    model: Annotated[
        Path | None, typer.Option("--model", "-m", help="Model folder for the in-process proxy.")
    ] = None,
    engine: Annotated[
        str, typer.Option(help=f"{choices('engine')} (in-process proxy).")
    ] = "embedded",
    engine_opt: Annotated[
        list[str] | None, typer.Option("--engine-opt", help="Engine KEY=VALUE.")
    ] = None,
    script: Annotated[
        Path | None, typer.Option(help="forced engine: scripted completions file.")
    ] = None,
    proxy: Annotated[
        str | None, typer.Option(help="Use a running proxy at this URL instead.")
    ] = None,
    proxy_turns: Annotated[
        Path | None, typer.Option(help="With --proxy: the folder it writes Turns to.")
    ] = None,
    proxy_token: Annotated[
        str | None,
        typer.Option(help="With --proxy: its admin token (default: $LEGORL_ADMIN_TOKEN)."),
    ] = None,
    sandbox: Annotated[str, typer.Option(help=choices("sandbox"))] = "local",
    harness_opt: Annotated[
        list[str] | None, typer.Option("--harness-opt", help="Harness KEY=VALUE, e.g. max_turns=8.")
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds per harness run.")] = 600.0,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Trajectory file (appended; resumable).")
    ] = None,
    turns_dir: Annotated[
        Path | None, typer.Option(help="Where Turn files go (default: OUT.turns/).")
    ] = None,
    served_model: Annotated[str, typer.Option(help="Model name the harness asks for.")] = "",
    strict: Annotated[bool, typer.Option(help="Stop at the first monitor alert.")] = False,
    max_call_tokens: MaxCallTokens = None,
    max_episode_turns: MaxEpisodeTurns = None,
    max_episode_tokens: MaxEpisodeTokens = None,
    max_episode_s: MaxEpisodeS = None,
    ray: Annotated[
        str | None,
        typer.Option(
            "--ray",
            metavar="ADDRESS",
            help="Run on the Ray cluster at ADDRESS (auto: the one running here), one worker "
            "per node with its own sandboxes and proxy.",
        ),
    ] = None,
) -> None:
    """Run HARNESS on each task GROUP_SIZE times; one Trajectory per run, resumable."""
    from rich.progress import Progress as RichProgress

    from legorl.harnesses import make_harness
    from legorl.monitors import Monitor, MonitorStop
    from legorl.protocols import EngineError, SandboxError
    from legorl.rollout import (
        EngineSpec,
        Progress,
        ProxyEndpoint,
        RunContext,
        SessionOpenError,
        finished_ids,
        plan_runs,
        remote_proxy,
        rollout_into,
        serve_engine,
    )
    from legorl.sandbox import make_backend
    from legorl.sandbox.runtime import PreflightError, harness_preflight
    from legorl.tasks import TaskError, load_tasks

    try:
        task_list = load_tasks(tasks, task_format=task_format)
    except TaskError as exc:
        fail("rollout", str(exc), 2)
    if (proxy is None) == (model is None):
        fail("rollout", "give --model (in-process proxy) or --proxy URL with --proxy-turns", 2)
    if proxy is not None and proxy_turns is None:
        fail("rollout", "--proxy needs --proxy-turns: the folder that proxy writes Turns to", 2)
    caps = budget("rollout", max_call_tokens, max_episode_turns, max_episode_tokens, max_episode_s)
    if proxy is not None and caps != type(caps)():
        fail("rollout", "with --proxy, budgets are that proxy's: give them to proxy serve", 2)
    proxy_token = proxy_token or os.environ.get("LEGORL_ADMIN_TOKEN")
    if proxy is not None and not proxy_token:
        fail(
            "rollout",
            "--proxy needs --proxy-token (or $LEGORL_ADMIN_TOKEN): each run's session is opened "
            "through the proxy's admin API, reachable by that run's sandbox alone",
            2,
        )
    try:
        agent = make_harness(harness, **key_values("rollout", "--harness-opt", harness_opt))
        backend = make_backend(sandbox)
    except (ValueError, TypeError, SandboxError) as exc:
        fail("rollout", str(exc), 2)
    if ray is not None and proxy is not None:
        fail("rollout", "--ray runs a proxy on each node: give --model, not --proxy", 2)
    try:  # before any engine or sandbox starts: a missing harness fails every run alike
        if ray is None:  # on a cluster each node's worker checks its own
            harness_preflight(agent, backend.name)
    except PreflightError as exc:
        fail("rollout", str(exc))
    turns = (
        proxy_turns or turns_dir or (out.with_name(out.name + ".turns") if out else Path("turns"))
    )
    turns.mkdir(parents=True, exist_ok=True)
    runs = plan_runs(task_list, group_size, limit, finished_ids(out))
    if ray is None:  # on a cluster, each node's backend builds or pulls its own
        require_images("rollout", backend, [r.task for r in runs])
    skipped = (min(limit or len(task_list), len(task_list)) * group_size) - len(runs)
    if skipped:
        console.print(f"legorl rollout: {skipped} run(s) already in {out}, skipped", markup=False)
    refs_base = out.parent if out else Path.cwd()
    run_id = f"legorl-{uuid.uuid4().hex[:10]}"
    progress = Progress(total=len(runs))
    # Crash rate, hack flags and engine-error bursts, to stderr and alerts.jsonl beside --out.
    monitor = Monitor(alerts_path=refs_base / "alerts.jsonl", strict=strict)

    remote = None
    if proxy is not None:
        assert proxy_turns is not None and proxy_token
        try:
            remote = remote_proxy(proxy, proxy_turns, proxy_token)
        except SessionOpenError as exc:
            fail("rollout", f"--proxy: {exc}")

    async def main() -> None:
        with RichProgress(console=console, transient=True) as bar:
            task_id = bar.add_task("rollout", total=len(runs))

            def show(_traj: Any) -> None:
                statuses = " ".join(f"{k} {v}" for k, v in sorted(progress.by_status.items()))
                bar.update(
                    task_id,
                    completed=progress.done,
                    description=(
                        f"done {progress.done}/{progress.total} · running {progress.running} · "
                        f"{statuses} · {progress.tokens_per_s:.0f} tok/s"
                    ),
                )

            async def consume(endpoint: ProxyEndpoint, name: str) -> None:
                ctx = RunContext(
                    harness=agent,
                    backend=backend,
                    proxy=endpoint,
                    model=name,
                    tasks_dir=tasks.parent,
                    timeout=timeout,
                    run_id=run_id,
                    refs_relative_to=refs_base,
                )
                await rollout_into(
                    out,
                    runs,
                    ctx,
                    concurrency=concurrency,
                    progress=progress,
                    monitor=monitor,
                    each=show,
                )

            if remote is not None:
                await consume(remote, served_model or "legorl")
                return
            assert model is not None
            opts = key_values("rollout", "--engine-opt", engine_opt)
            if script is not None:
                opts["script"] = str(script.resolve())
            spec = EngineSpec(name=engine, weights=model, options=opts, log_dir=refs_base)
            if ray is not None:
                await on_cluster(ray, spec, show)
                return
            async with contextlib.AsyncExitStack() as stack:
                try:
                    endpoint, core = await stack.enter_async_context(
                        serve_engine(model, spec, turns, caps)
                    )
                except (ValueError, TypeError, FileNotFoundError) as exc:
                    fail("rollout", f"--engine {engine}: {exc}", 2)
                except EngineError as exc:  # e.g. a vLLM server that legorl could not start
                    fail("rollout", f"--engine {engine}: {exc}")
                await consume(endpoint, served_model or core.served_name)

    async def on_cluster(address: str, spec: EngineSpec, show: Any) -> None:
        from legorl import __version__
        from legorl.executors.ray import WorkerSetup
        from legorl.records import JsonlWriter

        assert model is not None
        where = refs_base.resolve()
        setup = WorkerSetup(
            version=__version__,
            sandbox=sandbox,
            harness=harness,
            harness_options=key_values("rollout", "--harness-opt", harness_opt),
            engine=EngineSpec(
                name=spec.name,
                weights=model.resolve(),
                options=spec.options,
                log_dir=where,
            ),
            model=str(model.resolve()),
            served_model=served_model,
            budget=caps,
            tasks_dir=str(tasks.parent.resolve()),
            timeout=timeout,
            run_id=run_id,
        )
        async with on_ray("rollout", address, setup) as executor:
            with JsonlWriter(out) as writer:
                async for traj in executor.rollout_runs(
                    runs,
                    turns_dir=turns.resolve(),
                    refs_relative_to=where,
                    concurrency=concurrency if concurrency > 1 else None,
                ):
                    writer.write(traj)
                    progress.done += 1
                    progress.by_status[traj.status] += 1
                    progress.completion_tokens += traj.tokens.completion
                    monitor.observe_trajectory(traj)
                    show(traj)

    try:
        asyncio.run(main())
    except MonitorStop as stop:
        fail("rollout", str(stop))
    summary = ", ".join(f"{k} {v}" for k, v in sorted(progress.by_status.items())) or "nothing"
    console.print(
        f"legorl rollout: {progress.done} trajectories ({summary}); "
        f"{progress.completion_tokens} completion tokens",
        markup=False,
    )
