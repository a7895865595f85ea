"""`legorl check`: preflight validation of a run: model, template, engine, proxy, sandbox,
tasks, harnesses and disk; a table of pass / fail with the reason and the fix.

    legorl check --config run.yaml --dry-run
    legorl check --model fixtures/models/tiny-qwen3 --engine forced \\
        --tasks fixtures/tasks/train.jsonl --harness mini --sandbox local

Exits 1 when any check fails (0 with --exit-zero), 2 when the configuration is wrong.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from ._common import TaskFormat, choices, console, fail

HELP = "Preflight validation of a run: model, template, engine, proxy, sandbox, tasks."


def _options(pairs: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            fail("check", f"--engine-opt {pair!r}: expected KEY=VALUE", 2)
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def check(
    config: Annotated[
        Path | None,
        typer.Option("--config", "-c", help="Run config (.yaml or .json); flags override it."),
    ] = None,
    model: Annotated[Path | None, typer.Option("--model", "-m", help="Model folder.")] = None,
    engine: Annotated[
        str | None, typer.Option(help=f"{choices('engine')} (default embedded).")
    ] = None,
    engine_opt: Annotated[
        list[str] | None,
        typer.Option("--engine-opt", help="Engine KEY=VALUE, e.g. dtype=bfloat16."),
    ] = None,
    trainer_model: Annotated[
        Path | None, typer.Option(help="Checkpoint the trainer recomputes log-probs with.")
    ] = None,
    harness: Annotated[
        list[str] | None,
        typer.Option("--harness", "-H", help="Harness the run uses (repeatable; default mini)."),
    ] = None,
    api: Annotated[
        list[str] | None,
        typer.Option(help="Extra API shape to probe: openai_chat | anthropic | responses."),
    ] = None,
    tasks: Annotated[
        Path | None, typer.Option("--tasks", "-t", help="Task file or datasets folder.")
    ] = None,
    task_format: TaskFormat = None,
    sandbox: Annotated[
        str | None, typer.Option(help=f"{choices('sandbox')} | none (default local).")
    ] = None,
    docker_host: Annotated[str | None, typer.Option(help="Docker daemon URL.")] = None,
    image: Annotated[
        list[str] | None, typer.Option("--image", help="Docker image that must be present.")
    ] = None,
    workdir: Annotated[Path | None, typer.Option(help="Where the run writes.")] = None,
    disk_budget: Annotated[
        float | None, typer.Option(help="GB that must be free in --workdir.")
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Also sample and recompute log-probs: correlation >= 0.99."),
    ] = False,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print one JSON object per check instead of the table.")
    ] = False,
    exit_zero: Annotated[
        bool, typer.Option("--exit-zero", help="Exit 0 even when a check fails.")
    ] = False,
) -> None:
    """Check that a run can start: each check passes, fails (with the reason and the fix) or is
    skipped because what it needs failed."""
    from legorl.check import ConfigError, RunConfig, config_from_dict, load_config

    try:
        cfg = load_config(config) if config is not None else RunConfig()
        overrides: dict[str, Any] = {
            "model": str(model) if model else None,
            "engine": engine,
            "trainer_model": str(trainer_model) if trainer_model else None,
            "harnesses": harness or None,
            "apis": api or None,
            "tasks": str(tasks) if tasks else None,
            "task_format": task_format,
            "sandbox": sandbox,
            "docker_host": docker_host,
            "images": image or None,
            "workdir": str(workdir) if workdir else None,
            "disk_budget_gb": disk_budget,
        }
        merged = {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}
        merged.update({k: v for k, v in overrides.items() if v is not None})
        merged["engine_options"] = {**cfg.engine_options, **_options(engine_opt)}
        cfg = config_from_dict(merged, where="flags")
    except ConfigError as exc:
        fail("check", str(exc), 2)

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if cfg.model:
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except ImportError:
            pass
    from legorl.check import run_checks

    with console.status("legorl check: running checks…") as status:
        results = run_checks(
            cfg,
            dry_run=dry_run,
            on_result=lambda r: status.update(f"legorl check: {r.name}: {r.status}…"),
        )
    if json_out:
        for r in results:
            print(
                json.dumps({"name": r.name, "status": r.status, "reason": r.reason, "fix": r.fix})
            )
    else:
        _table(results)
    failed = [r for r in results if not r.ok]
    if failed and not exit_zero:
        raise typer.Exit(1)


def _table(results: list[Any]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    marks = {"pass": ("✓ pass", "green"), "fail": ("✗ FAIL", "bold red"), "skip": ("– skip", "dim")}
    table = Table(title="legorl check", title_justify="left", show_lines=False)
    table.add_column("check", style="bold", no_wrap=True)
    table.add_column("result", no_wrap=True)
    table.add_column("reason")
    fixes = any(r.fix for r in results)
    if fixes:
        table.add_column("fix")
    for r in results:
        label, style = marks[r.status]
        cells = [r.name, Text(label, style=style), r.reason]
        table.add_row(*cells, *([Text(r.fix, style="yellow")] if fixes else []))
    failed = sum(1 for r in results if r.status == "fail")
    out = Console(highlight=False)
    out.print(table)
    if failed:
        out.print(Text(f"{failed} check(s) failed", style="bold red"))
    else:
        out.print(Text(f"all {len(results)} checks passed or were skipped", style="green"))
