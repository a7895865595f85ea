"""`legorl train`: policy-gradient steps (GSPO, GRPO, Dr.GRPO) on Sample records.

legorl train samples.jsonl --model fixtures/models/tiny-qwen3 --out ckpt --metrics metrics.jsonl
legorl align … | legorl train --model M --out ckpt lr=3e-6 correction=seq_mask --push URL
accelerate launch --multi_gpu --num_processes 2 -m legorl.cli.main train samples.jsonl --model M --out ckpt
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated

import typer

from legorl.records import JsonlWriter, Metric, Sample, write_jsonl

from ._common import ReportTo, SkipBad, console, fail, iter_inputs

HELP = "One or more policy-gradient steps (GSPO, GRPO, Dr.GRPO) on samples."

_OVERRIDE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def train(
    model: Annotated[
        Path, typer.Option("--model", "-m", help="Model folder or checkpoint to start from.")
    ],
    args: Annotated[
        list[str] | None,
        typer.Argument(
            help="Sample JSONL files (none or '-' reads stdin) and key=value config overrides.",
            show_default=False,
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Checkpoint folder to write (may be --model itself)."),
    ] = None,
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="YAML file of config keys.")
    ] = None,
    steps: Annotated[
        int | None, typer.Option("--steps", help="Optimizer steps (config key steps; default 1).")
    ] = None,
    metrics: Annotated[
        Path | None,
        typer.Option("--metrics", help="Append Metric records here instead of stdout."),
    ] = None,
    logprobs: Annotated[
        Path | None,
        typer.Option(
            "--logprobs",
            help="Append the trainer's log-probs of each sample's loss tokens here "
            "(legorl inspect colours tokens by them); default: trainer_logprobs.jsonl beside "
            "--metrics, else in --out.",
            show_default=False,
        ),
    ] = None,
    push: Annotated[
        str | None,
        typer.Option("--push", help="Proxy URL: reload the new weights there after saving."),
    ] = None,
    push_token: Annotated[
        str | None,
        typer.Option("--push-token", envvar="LEGORL_ADMIN_TOKEN", help="The proxy's admin token."),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Compute every metric, update nothing, save nothing."),
    ] = False,
    skip_bad: SkipBad = False,
    strict: Annotated[bool, typer.Option(help="Stop at the first monitor alert.")] = False,
    report_to: ReportTo = None,
) -> None:
    """One or more policy-gradient steps (GSPO, GRPO, Dr.GRPO) on samples."""
    from legorl.train.config import ConfigError, build_config
    from legorl.train.trackers import TrackerError, parse_report_to

    overrides = [a for a in args or [] if _OVERRIDE.match(a) and not Path(a).exists()]
    paths = [Path(a) for a in args or [] if a not in overrides]
    try:
        cfg = build_config(config, overrides, steps=steps)
    except ConfigError as exc:
        fail("train", str(exc), 2)
    if not (model / "config.json").is_file() and not (model / "adapter_config.json").is_file():
        fail("train", f"--model {model}: not a model folder (no config.json)", 2)
    if out is None and not dry_run:
        fail("train", "--out is needed (or --dry-run)", 2)
    if push is not None and dry_run:
        fail("train", "--push and --dry-run together: a dry run has no new weights to push", 2)
    if push is not None and not push_token:
        fail("train", "--push needs --push-token (or LEGORL_ADMIN_TOKEN)", 2)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not [p for p in paths if str(p) != "-"]:
        fail("train", "several processes cannot share stdin: name the sample files", 2)
    try:
        trackers = parse_report_to(report_to)
    except TrackerError as exc:
        fail("train", str(exc), 2)

    from transformers.utils import logging as hf_logging

    from legorl.monitors import Monitor, MonitorStop
    from legorl.train.checkpoint import Push, TrainError
    from legorl.train.data import SampleError
    from legorl.train.trainer import train as run_train

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    writer: JsonlWriter | None = None
    # Correlation, clip fraction and reward alerts, to stderr and alerts.jsonl beside the output.
    alerts_dir = metrics.parent if metrics else (out or Path.cwd())
    monitor = Monitor(alerts_path=alerts_dir / "alerts.jsonl", strict=strict)
    reporter = None
    if trackers and int(os.environ.get("RANK", "0")) == 0:
        from legorl.train.trackers import Reporter

        run_name = (out or model).resolve().name
        reporter = Reporter(
            trackers, run_name=run_name, logging_dir=alerts_dir / "trackers", config=cfg.to_dict()
        )

    def emit(metric: Metric) -> None:
        nonlocal writer
        if writer is None:
            writer = JsonlWriter(metrics)
        writer.write(metric)
        if reporter is not None:
            reporter(metric)
        monitor.observe_metric(metric)

    samples = iter_inputs("train", paths, Sample, skip_bad)
    if logprobs is None and (metrics or out):
        logprobs = alerts_dir / "trainer_logprobs.jsonl"
    try:
        result = run_train(
            samples,
            model=model,
            out=out,
            config=cfg,
            dry_run=dry_run,
            push=Push(push, push_token or "") if push is not None else None,
            skip_bad=skip_bad,
            emit=emit,
            log=lambda msg: console.print(f"legorl train: {msg}", markup=False, soft_wrap=True),
            run={"samples": [str(p) for p in paths] or ["-"], "dry_run": dry_run},
        )
    except (SampleError, TrainError, ConfigError, MonitorStop) as exc:
        fail("train", str(exc))
    finally:
        if writer is not None:
            writer.close()
        if reporter is not None:
            reporter.close()
    if logprobs is not None and result.logprobs:
        write_jsonl(logprobs, result.logprobs)
