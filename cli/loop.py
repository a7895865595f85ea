"""`legorl loop`: K iterations of rollout → verify → align → train with the embedded engine, the
weights reloaded into the in-process proxy after each step; held-out evaluation before and after.

    legorl loop --model fixtures/models/tiny-agent --tasks-dir fixtures/tasks-generated --out runs/loop
    legorl loop --iterations 8 --group-size 8 --lr 1e-5 kl_coef=0.01 correction=seq_mask
    legorl loop --ray auto …   # every phase on the running Ray cluster

Re-running the same command with the same --out continues an interrupted loop; a finished one
only prints its summary. Exit status: 0 done; 1 a stage failed; 2 bad usage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from legorl.loop_config import (
    LOOP_ENGINES,
    LOOP_LR,
    LOOP_LR_ALL,
    LOOP_LR_LORA,
    LOOP_LR_SCALE,
    LoopConfig,
)

from ._common import ReportTo, TaskFormat, choices, console, fail, key_values

if TYPE_CHECKING:
    from legorl.loop import LoopResult

#: The flags' defaults are LoopConfig's: one place says what the loop runs with.
_D = types.SimpleNamespace(
    **{
        f.name: f.default
        for f in dataclasses.fields(LoopConfig)
        if f.default is not dataclasses.MISSING
    }
)

HELP = "The RL loop: rollout → verify → align → train, K iterations, held-out eval; resumable."


def loop(
    overrides: Annotated[
        list[str] | None,
        typer.Argument(
            help="Train config key=value overrides (e.g. kl_coef=0.01).", show_default=False
        ),
    ] = None,
    model: Annotated[
        Path, typer.Option("--model", "-m", help="Model folder to start from.")
    ] = _D.model,
    tasks_dir: Annotated[
        Path, typer.Option(help="Folder with train.jsonl and heldout.jsonl.")
    ] = _D.tasks_dir,
    task_format: TaskFormat = _D.task_format,
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Run folder (re-use it to continue).")
    ] = _D.out,
    iterations: Annotated[int, typer.Option(help="Training iterations.")] = _D.iterations,
    group_size: Annotated[
        int, typer.Option("--group-size", "-g", help="Samples per task.")
    ] = _D.group_size,
    tasks_per_iteration: Annotated[
        int, typer.Option(help="Train tasks per iteration (round-robin, seeded shuffle).")
    ] = _D.tasks_per_iteration,
    eval_samples: Annotated[
        int, typer.Option(help="Seeded samples per held-out task.")
    ] = _D.eval_samples,
    eval_limit: Annotated[
        int | None, typer.Option(help="Only the first N held-out tasks (default: all).")
    ] = _D.eval_limit,
    sandbox: Annotated[str, typer.Option(help=choices("sandbox"))] = _D.sandbox,
    concurrency: Annotated[
        int, typer.Option("--concurrency", "-c", help="Runs and gradings at once.")
    ] = _D.concurrency,
    max_turns: Annotated[int, typer.Option(help="Agent turns per run.")] = _D.max_turns,
    max_tokens: Annotated[
        int, typer.Option(help="Completion tokens per model call.")
    ] = _D.max_tokens,
    temperature: Annotated[float, typer.Option(help="Sampling temperature.")] = _D.temperature,
    seed: Annotated[
        int, typer.Option(help="Task shuffle; eval seeds are SEED + sample.")
    ] = _D.seed,
    steps_per_iteration: Annotated[
        int, typer.Option(help="Optimizer steps per iteration.")
    ] = _D.steps_per_iteration,
    train_params: Annotated[
        str,
        typer.Option(
            help="Parameters to train, a regular expression over their names ('' = all); the "
            "rest stay frozen."
        ),
    ] = _D.train_params,
    lr: Annotated[
        float | None,
        typer.Option(
            help=f"Learning rate (default: {LOOP_LR_SCALE} with the default --train-params and "
            f"--scale-only, {LOOP_LR} with the default --train-params and --scale-only '', else "
            f"{LOOP_LR_ALL}; or an lr= override)."
        ),
    ] = _D.lr,
    lr_groups: Annotated[
        str,
        typer.Option(
            help="Other learning rates for some trained parameters: space-separated REGEX=LR "
            "entries, the first that finds a name wins (say '^model\\.norm\\.=0.4' with "
            "--train-params '' --lr 3e-5)."
        ),
    ] = _D.lr_groups,
    scale_only: Annotated[
        str | None,
        typer.Option(
            help="Of the trained parameters, those trained through one scalar factor each (a "
            "regular expression; '' = none). Default: the final norm with the default "
            "--train-params (a learned inverse temperature), else none."
        ),
    ] = _D.scale_only,
    lora: Annotated[
        bool,
        typer.Option(
            "--lora",
            help=f"Train a LoRA adapter on every linear layer instead (lr {LOOP_LR_LORA} unless "
            "given); its rank and the rest as overrides (lora_rank=4 lora_alpha=16).",
        ),
    ] = _D.lora,
    eval_base: Annotated[
        bool,
        typer.Option(
            "--eval-base",
            help="With --lora: the last held-out evaluation also runs on the base model, in "
            "the same engine beside the adapter (eval-base/).",
        ),
    ] = _D.eval_base,
    algorithm: Annotated[
        str | None, typer.Option(help=f"{choices('algorithm')} (default: the trainer's).")
    ] = _D.algorithm,
    timeout: Annotated[float, typer.Option(help="Seconds per harness run.")] = _D.timeout,
    device: Annotated[str, typer.Option(help="Engine device: auto, cpu, cuda, …")] = _D.device,
    engine: Annotated[
        str,
        typer.Option(
            help=f"{' | '.join(LOOP_ENGINES)} (vllm: launched by legorl, or --engine-opt "
            "base_url=…)."
        ),
    ] = _D.engine,
    engine_opt: Annotated[
        list[str] | None,
        typer.Option(
            "--engine-opt", help="Engine KEY=VALUE, e.g. dtype=bfloat16 (embedded: dtype only)."
        ),
    ] = None,
    use_async: Annotated[
        bool,
        typer.Option(
            "--async/--sync",
            help="Rollouts run on while the trainer trains, within --max-staleness; --sync: "
            "each iteration waits for the one before.",
        ),
    ] = _D.use_async,
    max_staleness: Annotated[
        int,
        typer.Option(
            help="With --async: the most policy versions a trained sample may be behind (0: the "
            "synchronous loop's order); a group is admitted only while (K + steps + 1) · "
            "batch groups have not been."
        ),
    ] = _D.max_staleness,
    batch_groups: Annotated[
        int | None,
        typer.Option(help="Whole groups per trainer step (default: --tasks-per-iteration)."),
    ] = _D.batch_groups,
    on_stale: Annotated[
        str,
        typer.Option(help="A group older than the bound when trained: drop | rerun (its task)."),
    ] = _D.on_stale,
    refill_filtered: Annotated[
        bool,
        typer.Option(
            help="With --async: a group filtered for equal rewards frees its batch slot for "
            "another (default: it takes its slot, empty)."
        ),
    ] = _D.refill_filtered,
    seeded_rollouts: Annotated[
        bool,
        typer.Option(help="Training runs sample with seeds from SEED, iteration and sample."),
    ] = _D.seeded_rollouts,
    ray: Annotated[
        str | None,
        typer.Option(
            "--ray",
            metavar="ADDRESS",
            help="Run every phase on the Ray cluster at ADDRESS (auto: the one running here), "
            "one worker per node with its own engine, proxy and sandboxes; the weights reach "
            "every node after each step.",
        ),
    ] = _D.ray,
    report_to: ReportTo = None,
) -> None:
    """Rollout → verify → align → train, ITERATIONS times, with held-out evaluation."""
    from legorl.loop import LoopConfigError, LoopError, run_loop

    config = LoopConfig(
        model=model,
        tasks_dir=tasks_dir,
        task_format=task_format,
        out=out,
        iterations=iterations,
        group_size=group_size,
        tasks_per_iteration=tasks_per_iteration,
        eval_samples=eval_samples,
        eval_limit=eval_limit,
        sandbox=sandbox,
        concurrency=concurrency,
        max_turns=max_turns,
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        steps_per_iteration=steps_per_iteration,
        train_params=train_params,
        lr=lr,
        lr_groups=lr_groups,
        scale_only=scale_only,
        lora=lora,
        eval_base=eval_base,
        algorithm=algorithm,
        train_overrides=list(overrides or []),
        timeout=timeout,
        device=device,
        engine=engine,
        engine_options=key_values("loop", "--engine-opt", engine_opt),
        use_async=use_async,
        max_staleness=max_staleness,
        batch_groups=batch_groups,
        on_stale=on_stale,
        refill_filtered=refill_filtered,
        seeded_rollouts=seeded_rollouts,
        ray=ray,
    )
    try:
        config.validate()
    except LoopConfigError as exc:
        _bad(exc)
    from legorl.train.trackers import TrackerError, parse_report_to

    try:
        trackers = parse_report_to(report_to)
    except TrackerError as exc:
        fail("loop", str(exc), 2)

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    def say(msg: str) -> None:
        console.print(f"legorl loop: {msg}", markup=False, soft_wrap=True)

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        shown: dict[str, TaskID] = {}

        def progress(phase: str, done: int, total: int) -> None:
            if phase not in shown:
                for old in shown.values():
                    bar.remove_task(old)
                shown.clear()
                shown[phase] = bar.add_task(phase, total=total)
            bar.update(shown[phase], completed=done)

        try:
            with _reporting(trackers, out, config.train_config().to_dict()):
                result = run_loop(config, log=say, progress=progress)
        except LoopConfigError as exc:
            _bad(exc)
        except LoopError as exc:
            fail("loop", str(exc))
        except KeyboardInterrupt:
            fail("loop", f"interrupted: run the same command again to continue {out}", 130)
    summary(result)


@contextlib.contextmanager
def _reporting(trackers: list[str], out: Path, config: dict[str, Any]) -> Iterator[None]:
    """Feed the trackers from the run folder's metrics files while the loop writes them."""
    if not trackers:
        yield
        return
    from legorl.loop import METRICS_FILE
    from legorl.train.trackers import Reporter, follow_metrics

    reporter = Reporter(
        trackers, run_name=out.resolve().name, logging_dir=out / "trackers", config=config
    )
    stop = threading.Event()
    patterns = [METRICS_FILE, f"iter-*/{METRICS_FILE}"]
    thread = threading.Thread(
        target=follow_metrics, args=(out, patterns, reporter, stop, 2.0), daemon=True
    )
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        reporter.close()


def _bad(exc: object) -> NoReturn:
    from legorl.loop import LoopConfigError

    assert isinstance(exc, LoopConfigError)
    if exc.field == "train":  # the message names the key=value override or the flag
        fail("loop", exc.problem, 2)
    flag = {"use_async": "async"}.get(exc.field, exc.field)
    fail("loop", f"--{flag.replace('_', '-')}: {exc.problem}", 2)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _num(x: float | None, spec: str = ".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def _duration(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s"


def summary(result: LoopResult) -> None:
    """The loop's outcome, on stderr: per-iteration table, held-out before → after, health."""
    from rich import box
    from rich.table import Table

    state = result.state
    table = Table(
        title=f"legorl loop: {result.config.out}",
        title_justify="left",
        box=box.SIMPLE,
        show_edge=False,
        caption="ver: policy version after the iteration",
        caption_justify="left",
    )
    for col in ("iter", "reward", "solved", "pearson", "crash", "flags", "train", "ver", "time"):
        table.add_column(col, justify="right", no_wrap=True)
    for it in state.iterations:
        table.add_row(
            str(it.iteration),
            _num(it.reward_mean),
            _pct(it.solved_fraction),
            _num(it.rollout_trainer_pearson, ".4f"),
            str(it.crashes),
            str(it.hack_flags),
            "yes" if it.trained else "no",
            str(it.policy_version),
            _duration(it.seconds),
        )
    console.print(table)
    before, after = result.before, result.after
    line = f"held-out success: {_pct(before.success if before else None)}"
    if after is not None:
        line += f" → {_pct(after.success)}"
        if before is not None and before.success is not None and after.success is not None:
            line += f" ({(after.success - before.success) * 100:+.1f} points)"
        line += f" (policy version {before.policy_version if before else 0} → "
        line += f"{after.policy_version})"
    console.print(line, markup=False)
    from legorl.protocols import BASE_ADAPTER

    base = state.eval_at(state.finished, BASE_ADAPTER) if state.finished else None
    if base is not None and after is not None:
        console.print(
            f"held-out success after iteration {state.finished}, one engine: base model "
            f"{_pct(base.success)}, adapter {_pct(after.success)}",
            markup=False,
        )
    corr = [i.rollout_trainer_pearson for i in state.iterations]
    known = [c for c in corr if c is not None]
    span = f"{min(known):.4f}–{max(known):.4f}" if known else "n/a"
    crashes = sum(i.crashes for i in state.iterations) + sum(e.crashes for e in state.evals)
    flags = sum(i.hack_flags for i in state.iterations) + sum(e.hack_flags for e in state.evals)
    skipped = sum(not i.trained for i in state.iterations)
    console.print(
        f"rollout/trainer Pearson over {len(state.iterations)} iteration(s): {span}; "
        f"crashes (environment failures) {crashes}; runs with hack flags {flags}; "
        f"iterations without training {skipped}",
        markup=False,
        soft_wrap=True,
    )
    console.print(
        f"time {_duration(result.total_seconds)}"
        + ("" if result.already_finished else f" ({_duration(result.seconds)} in this call)"),
        markup=False,
    )
    plot = str(result.plot_path) if result.plot_path else "none (no matplotlib)"
    console.print(
        f"metrics: {result.metrics_path}  plot: {plot}  state: {result.state_path}", markup=False
    )
    weights = (
        result.config.out / state.checkpoint
        if state.checkpoint
        else f"{result.config.model} (no iteration trained)"
    )
    console.print(f"weights: {weights}", markup=False)
