"""`legorl sandbox`: build, list and clean the layered sandbox image cache; run a command in one.

legorl sandbox build --tasks fixtures/tasks/train.jsonl [--runtime] [--cache-level instance]
legorl sandbox exec legorl-toy__geometry-1 --tasks fixtures/tasks/train.jsonl -- python -m pytest -q
legorl sandbox ls
legorl sandbox gc [--budget-gb 20] [--all]
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from ._common import TaskFormat, choices, console, fail

HELP = "Build, list and clean the layered sandbox image cache; run a command in a sandbox."

app = typer.Typer(help=HELP, no_args_is_help=True, add_completion=False)

Backend = Annotated[
    str, typer.Option("--backend", "-b", help=f"{choices('sandbox')} (local: bubblewrap).")
]
TasksOpt = Annotated[
    list[Path],
    typer.Option(
        "--tasks", "-t", help="Task file or datasets folder (repeatable).", show_default=False
    ),
]
Level = Annotated[
    str,
    typer.Option(
        "--cache-level",
        help="Keep layers up to none|base|env|instance: build builds those; exec removes, after "
        "the run, layers above it that it built.",
    ),
]
NoBuild = Annotated[
    bool, typer.Option("--no-build", help="Fail instead of building a missing layer.")
]
Json = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]


def _backend(cmd: str, name: str, *, build: bool = True) -> Any:
    from legorl.protocols import ConfigError, SandboxError
    from legorl.sandbox import make_backend

    try:
        return make_backend(name, build=build)
    except (ConfigError, SandboxError) as err:
        fail(cmd, str(err), 2)


def _tasks(cmd: str, paths: list[Path], task_format: str | None) -> dict[str, Any]:
    from legorl.protocols import SandboxError
    from legorl.sandbox.stage import task_refs

    if not paths:
        fail(cmd, "--tasks FILE is required", 2)
    try:
        return task_refs(paths, task_format)
    except SandboxError as err:
        fail(cmd, str(err), 2)


@app.command()
def build(
    tasks: TasksOpt,
    task_format: TaskFormat = None,
    task: Annotated[
        list[str] | None, typer.Option("--task", help="Only this instance id (repeatable).")
    ] = None,
    backend: Backend = "docker",
    cache_level: Level = "instance",
    runtime: Annotated[
        bool, typer.Option("--runtime", help="Also build the shared harness-runtime layer.")
    ] = False,
    jobs: Annotated[int, typer.Option("--jobs", "-j", help="Tasks built at a time.")] = 2,
    as_json: Json = False,
) -> None:
    """Build every task's layers (base → env → instance), reusing what is cached."""
    from legorl.protocols import SandboxError
    from legorl.sandbox import stage

    refs = _tasks("sandbox build", tasks, task_format)
    try:
        chosen = [stage.find_task(refs, i, tasks) for i in task] if task else list(refs.values())
        back = _backend("sandbox build", backend)
        started = time.monotonic()
        counts: dict[str, int] = {}
        for report in stage.build(chosen, back, level=cache_level, runtime=runtime, jobs=jobs):
            counts[report.action] = counts.get(report.action, 0) + 1
            if as_json:
                print(json.dumps(_report_dict(report)), flush=True)
            elif report.action != "cached":
                console.print(
                    f"legorl sandbox: {report.action} {report.kind} {report.tag} ({report.name})"
                    + (f" in {report.seconds:.1f}s" if report.seconds else ""),
                    markup=False,
                    soft_wrap=True,
                )
    except SandboxError as err:
        fail("sandbox build", str(err))
    summary = ", ".join(f"{n} {action}" for action, n in sorted(counts.items())) or "nothing"
    console.print(
        f"legorl sandbox: {len(chosen)} task(s): layers {summary} "
        f"in {time.monotonic() - started:.1f}s",
        markup=False,
        soft_wrap=True,
    )


def _report_dict(report: Any) -> dict[str, Any]:
    return {
        "kind": report.kind,
        "tag": report.tag,
        "name": report.name,
        "action": report.action,
        "seconds": round(report.seconds, 3),
    }


@app.command("exec", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def exec_(
    ctx: typer.Context,
    task_id: Annotated[str, typer.Argument(help="Instance id of the task.", show_default=False)],
    tasks: TasksOpt,
    task_format: TaskFormat = None,
    backend: Backend = "docker",
    no_build: NoBuild = False,
    timeout: Annotated[
        float, typer.Option("--timeout", help="Seconds before the command is killed.")
    ] = 600.0,
    proxy: Annotated[
        str | None,
        typer.Option("--proxy", help="Proxy URL the sandbox may reach (nothing else)."),
    ] = None,
    runtime: Annotated[
        bool, typer.Option("--runtime", help="Attach the harness runtime at /opt/legorl-runtime.")
    ] = False,
    cpus: Annotated[float, typer.Option(help="CPU limit.")] = 1.0,
    memory_mb: Annotated[int, typer.Option(help="Memory limit in MB.")] = 2048,
    pids: Annotated[int, typer.Option(help="Process limit.")] = 256,
    output_bytes: Annotated[int, typer.Option(help="Output kept per command.")] = 1_000_000,
    run_id: Annotated[str | None, typer.Option(help="Run id label (default: cli-PID).")] = None,
    cache_level: Level = "instance",
) -> None:
    """Run one command in a fresh sandbox of TASK: legorl sandbox exec TASK --tasks T -- CMD…"""
    from legorl.protocols import Limits, SandboxError
    from legorl.sandbox import stage

    cmd = list(ctx.args)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        fail("sandbox exec", "no command given: legorl sandbox exec TASK --tasks FILE -- CMD…", 2)
    refs = _tasks("sandbox exec", tasks, task_format)
    limits = Limits(
        cpus=cpus,
        memory_mb=memory_mb,
        pids=pids,
        wall_s=max(timeout + 60.0, 120.0),
        output_bytes=output_bytes,
    )

    def echo(data: bytes) -> None:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()

    try:
        ref = stage.find_task(refs, task_id, tasks)
        back = _backend("sandbox exec", backend, build=not no_build)
        result = asyncio.run(
            stage.run_command(
                back,
                ref,
                cmd if len(cmd) > 1 else cmd[0],
                run_id=run_id or f"cli-{os.getpid()}",
                timeout=timeout,
                limits=limits,
                proxy_url=proxy,
                runtime=runtime,
                on_output=echo,
                keep_level=cache_level,
            )
        )
    except SandboxError as err:
        fail("sandbox exec", str(err))
    if result.killed_by in ("timeout", "wall"):
        fail("sandbox exec", f"command timed out after {timeout:g}s and was killed", 124)
    if result.killed_by == "memory":
        fail("sandbox exec", f"command killed: out of memory (limit {memory_mb} MB)", 137)
    if result.killed_by == "pids":
        fail("sandbox exec", f"command hit the process limit ({pids}); exit {result.exit_code}", 1)
    raise typer.Exit(result.exit_code or 0)


@app.command("ls")
def ls(backend: Backend = "docker", as_json: Json = False) -> None:
    """List cached layers: kind, tag, name, size, created, last use."""
    from legorl.protocols import SandboxError
    from legorl.sandbox import stage

    try:
        rows = stage.listing(_backend("sandbox ls", backend))
    except SandboxError as err:
        fail("sandbox ls", str(err))
    if as_json:
        for row in rows:
            print(json.dumps(row))
        return
    from rich.table import Table

    table = Table("kind", "tag", "name", "size", "created", "last use", box=None)
    for row in rows:
        table.add_row(
            row["kind"],
            row["tag"],
            row["name"],
            stage.human_size(row["size"]),
            stage.human_age(row["created"]),
            stage.human_age(row["last_used"]),
        )
    from rich.console import Console

    Console(file=sys.stdout, highlight=False, width=max(120, console.width)).print(table)


@app.command()
def gc(
    backend: Backend = "docker",
    everything: Annotated[
        bool, typer.Option("--all", help="Also remove sandboxes of live runs.")
    ] = False,
    budget_gb: Annotated[
        float | None,
        typer.Option("--budget-gb", help="Remove least-recently-used layers until this total."),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only say what would go.")] = False,
    as_json: Json = False,
) -> None:
    """Remove containers and sandboxes of dead runs, stale images, and layers over a budget."""
    from legorl.protocols import SandboxError
    from legorl.sandbox import stage

    try:
        out = stage.gc(
            _backend("sandbox gc", backend),
            everything=everything,
            budget_gb=budget_gb,
            dry_run=dry_run,
        )
    except SandboxError as err:
        fail("sandbox gc", str(err))
    if as_json:
        print(json.dumps(out))
        return
    verb = "would remove" if dry_run else "removed"
    parts = [f"{len(v)} {k}" for k, v in out.items()]
    console.print(f"legorl sandbox gc: {verb} {', '.join(parts)}", markup=False, soft_wrap=True)
