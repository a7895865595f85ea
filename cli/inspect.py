"""`legorl inspect`: follow trajectory, sample and metric JSONL files live in a Textual viewer,
or print their summary.

    legorl inspect runs/graded.jsonl runs/samples.jsonl runs/metrics.jsonl --model fixtures/models/tiny-qwen3
    legorl inspect --summary runs/graded.jsonl runs/metrics.jsonl runs/alerts.jsonl
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from ._common import console, fail

HELP = "Live trajectory, sample and metric viewer (Textual)."


def inspect(
    files: Annotated[
        list[Path],
        typer.Argument(
            help="JSONL files of Trajectory, Sample, Metric records (also Turn files, "
            "alerts.jsonl and trainer log-prob files), or folders of them; followed as they grow.",
            show_default=False,
        ),
    ],
    model: Annotated[
        Path | None,
        typer.Option("--model", "-m", help="Model folder: decode prompts, completions and tokens."),
    ] = None,
    summary: Annotated[
        bool, typer.Option("--summary", help="Print a summary of the files and exit (no TUI).")
    ] = False,
    follow: Annotated[
        bool, typer.Option("--follow/--no-follow", help="Keep reading the files as they grow.")
    ] = True,
    interval: Annotated[
        float, typer.Option(help="Seconds between reads of the files when following.")
    ] = 0.5,
) -> None:
    """Live trajectory, sample and metric viewer (Textual); --summary prints tables instead."""
    if not sys.stdout.isatty() and not summary:
        console.print(
            "legorl inspect: stdout is not a terminal; printing --summary "
            "(run it in a terminal for the live viewer)",
            markup=False,
        )
        summary = True
    if summary:
        from rich.console import Console

        from legorl.inspect.summary import summarize_paths

        missing = [str(f) for f in files if not f.exists()]
        if missing:
            fail("inspect", f"{missing[0]}: no such file")
        summarize_paths(files, Console(highlight=False))
        return
    if model is not None and not model.is_dir():
        fail("inspect", f"--model {model}: no such folder")
    from legorl.inspect.app import InspectApp

    try:
        app = InspectApp(files, model=model, follow=follow, interval=interval)
    except (OSError, ValueError) as exc:
        fail("inspect", f"--model {model}: {exc}")
    app.run()
