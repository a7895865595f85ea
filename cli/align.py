"""`legorl align`: graded trajectories in, token-exact training samples out; `--check` recomputes
every loss token's log-prob with the model and reports rollout-vs-trainer agreement.

legorl align graded.jsonl --out samples.jsonl --summary align.json
legorl verify … | legorl align --check --model fixtures/models/tiny-qwen3 | legorl train …

Exit status: 0 done; 1 bad input (the message names the file and line, or the trajectory and
turn); 2 bad usage; 3 `--check` found the Pearson correlation below `--min-corr` (the samples
are written all the same).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from legorl.records import JsonlWriter, Trajectory

from ._common import Inputs, Out, SkipBad, console, fail, iter_inputs

HELP = "Turn graded trajectories into token-exact training samples (--check: fidelity)."

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def align(
    inputs: Inputs = None,
    out: Out = None,
    skip_bad: SkipBad = False,
    model: Annotated[
        Path | None,
        typer.Option(help="Model folder: what --check scores with.", show_default=False),
    ] = None,
    include_aux: Annotated[
        bool,
        typer.Option(
            "--include-aux", help="Keep auxiliary sub-sessions (sub-agents, titles) as samples."
        ),
    ] = False,
    summary: Annotated[
        Path | None,
        typer.Option(help="Write the stats (and --check figures) to this JSON file."),
    ] = None,
    check: Annotated[
        bool,
        typer.Option(
            "--check", help="Recompute loss-token log-probs with --model and compare (fidelity)."
        ),
    ] = False,
    dtype: Annotated[
        str, typer.Option(help="Weights dtype for --check: float32 (fp32) or bfloat16 (bf16).")
    ] = "float32",
    min_corr: Annotated[
        float, typer.Option(help="--check fails (exit 3) below this Pearson correlation.")
    ] = 0.99,
    temperature: Annotated[
        float, typer.Option(help="Sampling temperature of the rollout, for --check.")
    ] = 1.0,
    device: Annotated[
        str, typer.Option(help="Device for --check: auto, cpu, cuda, cuda:1, …")
    ] = "auto",
    truncation: Annotated[
        str,
        typer.Option(help="Truncated episodes: mask (weight 0) or penalty (DAPO overlong)."),
    ] = "mask",
    overlong_max: Annotated[
        int | None, typer.Option(help="penalty: sampled tokens past which the reward gets -1.")
    ] = None,
    overlong_buffer: Annotated[
        int, typer.Option(help="penalty: the band below --overlong-max penalised linearly.")
    ] = 0,
) -> None:
    """Turn graded trajectories into token-exact training samples."""
    from legorl.align import AlignError, AlignStats, FidelityCheck, Truncation
    from legorl.align import align as align_stage

    try:
        rule = Truncation(truncation, overlong_max, overlong_buffer)  # type: ignore[arg-type]
    except ValueError as exc:
        fail("align", f"--truncation: {exc}", 2)

    if dtype not in _DTYPES:
        fail("align", f"--dtype: expected one of {', '.join(_DTYPES)}, got {dtype!r}", 2)
    if not 0.0 <= min_corr <= 1.0:
        fail("align", f"--min-corr: expected a value in 0..1, got {min_corr}", 2)
    if temperature < 0:
        fail("align", f"--temperature: expected >= 0, got {temperature}", 2)
    checker: FidelityCheck | None = None
    if check:
        if model is None:
            fail("align", "--check needs --model (the model folder to score with)", 2)
        if not model.is_dir():
            fail("align", f"--model {model}: no such folder", 2)
        checker = FidelityCheck(_load(model, _DTYPES[dtype], device), temperature=temperature)
    stats = AlignStats()
    sources = list(inputs) if inputs else [Path("-")]
    with JsonlWriter(out) as writer:
        for source in sources:
            base = Path.cwd() if str(source) == "-" else source.parent
            trajectories = iter_inputs("align", [source], Trajectory, skip_bad)
            try:
                for sample in align_stage(
                    trajectories,
                    include_aux=include_aux,
                    base_dir=base,
                    stats=stats,
                    skip_bad=skip_bad,
                    truncation=rule,
                ):
                    writer.write(sample)
                    if checker is not None:
                        _score(checker, sample)
            except AlignError as err:
                fail("align", f"{err} (use --skip-bad to skip bad trajectories)")
    report: dict[str, Any] = stats.summary()
    _print_stats(report)
    passed = True
    if checker is not None:
        overall = checker.report()
        overall["dtype"] = _DTYPES[dtype]
        overall["min_corr"] = min_corr
        pearson = overall["pearson"]
        passed = pearson is not None and pearson >= min_corr
        overall["passed"] = passed
        report["check"] = {
            **overall,
            "per_sample": [
                {
                    "sample_id": c.sample_id,
                    "tokens": c.tokens,
                    "pearson": c.pearson,
                    "mean_abs_diff": c.mean_abs_diff,
                    "max_abs_diff": c.max_abs_diff,
                    "k3_kl": c.k3_kl,
                }
                for c in checker.checks
            ],
        }
        _print_check(report["check"])
    if summary is not None:
        summary.parent.mkdir(parents=True, exist_ok=True)
        summary.write_text(json.dumps(report, indent=2) + "\n")
    if not passed:
        pearson = report["check"]["pearson"]
        shown = "undefined (no loss tokens, or constant probabilities)"
        if pearson is not None:
            shown = f"{pearson:.6f}"
        fail("align", f"--check: rollout-vs-trainer Pearson {shown} is below {min_corr}", 3)


def _score(checker: Any, sample: Any) -> None:
    try:
        checker.score(sample)
    except (ValueError, IndexError, RuntimeError) as exc:  # e.g. token ids outside the vocab
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        fail("align", f"--check: sample {sample.sample_id!r}: {first}")


def _load(model: Path, dtype: str, device: str) -> Any:
    from transformers.utils import logging as hf_logging

    from legorl.engines.models import load_model

    hf_logging.disable_progress_bar()  # stderr is for legorl's own lines
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return load_model(model, dtype=dtype, device=device)
    except Exception as exc:  # a broken folder, an unknown device: one line, not a traceback
        fail("align", f"--model {model}: cannot load: {exc}".splitlines()[0])


def _print_stats(s: dict[str, Any]) -> None:
    dropped = ", ".join(f"{k} {v}" for k, v in s["dropped"].items()) or "none"
    frac = s["trained_fraction"]
    seg = s["segments_per_episode"]
    share = "" if frac is None else f" ({frac:.1%})"
    console.print(
        f"legorl align: {s['episodes']} of {s['episodes_in']} episode(s) → {s['samples']} "
        f"sample(s) ({s['aux_samples']} aux); segments/episode {_fmt(seg['mean'], '.2f')} "
        f"(max {seg['max']}); trained {s['trained_tokens']} of {s['total_tokens']} "
        f"tokens{share}; dropped: {dropped}",
        markup=False,
        soft_wrap=True,
    )
    if s["errors"]:
        console.print(
            f"legorl align: skipped {len(s['errors'])} bad trajectory(ies); first: "
            f"{s['errors'][0]}",
            markup=False,
            soft_wrap=True,
        )


def _fmt(x: float | None, spec: str = ".6f") -> str:
    return "-" if x is None else format(x, spec)


def _print_check(c: dict[str, Any]) -> None:
    from rich.table import Table

    rows = c["per_sample"]
    worst = sorted(rows, key=lambda r: (r["pearson"] is not None, r["pearson"] or 0.0))[:5]
    if worst:
        table = Table(title="lowest-agreement samples", title_justify="left")
        for col in ("sample", "tokens", "pearson", "mean |Δlp|", "max |Δlp|", "k3 KL"):
            table.add_column(col, justify="left" if col == "sample" else "right")
        for r in worst:
            table.add_row(
                r["sample_id"],
                str(r["tokens"]),
                _fmt(r["pearson"]),
                _fmt(r["mean_abs_diff"], ".2e"),
                _fmt(r["max_abs_diff"], ".2e"),
                _fmt(r["k3_kl"], ".2e"),
            )
        console.print(table)
    verdict = "ok" if c["passed"] else f"BELOW --min-corr {c['min_corr']}"
    console.print(
        f"legorl align --check ({c['dtype']}): {c['tokens']} loss tokens in {c['samples']} "
        f"sample(s): pearson {_fmt(c['pearson'])}, mean |Δlp| {_fmt(c['mean_abs_diff'], '.2e')}, "
        f"max |Δlp| {_fmt(c['max_abs_diff'], '.2e')}, k3 KL {_fmt(c['k3_kl'], '.2e')}: {verdict}",
        markup=False,
        soft_wrap=True,
    )
