"""What every legorl command shares: stderr console, JSONL input/output, one-line failures."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console

from legorl.records import JsonlReader, R, RecordError, read_jsonl


def choices(kind: str) -> str:
    """The names a flag takes, as its help lists them: read from the registry of ``kind``
    (harness, engine, sandbox, algorithm, task_format), so the help says what exists."""
    names: list[str]
    if kind == "harness":
        from legorl.harnesses import HARNESSES

        names = list(HARNESSES)
    elif kind == "engine":
        from legorl.engines import ENGINES

        names = list(ENGINES)
    elif kind == "sandbox":
        from legorl.sandbox import SANDBOXES

        names = list(SANDBOXES)
    elif kind == "algorithm":
        from typing import get_args

        from legorl.train.config import Algorithm

        names = list(get_args(Algorithm))
    elif kind == "task_format":
        from legorl.tasks import FORMATS

        names = [*FORMATS, "legorl"]
    else:
        raise ValueError(f"no registry of {kind!r}")
    return " | ".join(names)


#: Human-facing output only; stdout carries records.
console = Console(stderr=True, highlight=False)

Inputs = Annotated[
    list[Path] | None,
    typer.Argument(help="JSONL files to read; none or '-' reads stdin.", show_default=False),
]
Out = Annotated[
    Path | None,
    typer.Option("--out", "-o", help="Append records to this file instead of stdout."),
]
TaskFormat = Annotated[
    str | None,
    typer.Option(
        "--task-format",
        help=f"Task set the rows come from: {choices('task_format')} "
        "(default: detected from the columns).",
    ),
]
SkipBad = Annotated[
    bool,
    typer.Option(
        "--skip-bad", help="Skip malformed or invalid lines (counted on stderr) instead of failing."
    ),
]

# Episode budgets, enforced by the proxy (``legorl.proxy.core.Budget``).
MaxCallTokens = Annotated[
    int | None, typer.Option(help="Cap on each call's max_tokens (clamped, not refused).")
]
MaxEpisodeTurns = Annotated[
    int | None, typer.Option(help="Calls per episode; the next one ends it as truncated.")
]
MaxEpisodeTokens = Annotated[
    int | None, typer.Option(help="Sampled tokens per episode; then it ends as truncated.")
]
MaxEpisodeS = Annotated[
    float | None, typer.Option(help="Seconds per episode; a later call ends it as truncated.")
]


def budget(
    command: str,
    call_tokens: int | None,
    turns: int | None,
    tokens: int | None,
    seconds: float | None,
) -> Any:
    """The ``Budget`` of the budget options, or one readable failure line naming the option."""
    from legorl.proxy.core import Budget

    given = {
        "--max-call-tokens": call_tokens,
        "--max-episode-turns": turns,
        "--max-episode-tokens": tokens,
        "--max-episode-s": seconds,
    }
    for flag, value in given.items():
        if value is not None and not value > 0:
            fail(command, f"{flag} {value}: must be > 0", 2)
    return Budget(max_call_tokens=call_tokens, max_turns=turns, max_tokens=tokens, max_s=seconds)


ReportTo = Annotated[
    list[str] | None,
    typer.Option(
        "--report-to",
        help="Also send the metrics to these trackers: wandb, tensorboard, mlflow (repeat or "
        "comma-separate; logs under trackers/ beside the metrics). The JSONL stays the record.",
        show_default=False,
    ),
]


def require_images(command: str, backend: Any, tasks: list[Any]) -> None:
    """The prebuilt images the tasks name, present or pulled before any run starts; one that
    is not here and cannot be pulled ends the command with what to build or pull."""
    from legorl.protocols import SandboxError

    ensure = getattr(backend, "ensure_images", None)
    if ensure is None:
        return
    try:
        ensure(tasks)
    except SandboxError as exc:
        fail(command, str(exc), 2)


def fail(command: str, message: str, code: int = 1) -> NoReturn:
    """One readable line on stderr, then exit with ``code``."""
    console.print(f"legorl {command}: error: {message}", markup=False, soft_wrap=True)
    raise typer.Exit(code)


def iter_inputs(
    command: str,
    paths: list[Path] | None,
    expect: type[R] | tuple[type[R], ...] | None,
    skip_bad: bool,
) -> Iterator[R]:
    """Records from each input in turn; bad lines fail the command or are counted (``--skip-bad``)."""
    sources: list[str | Path] = list(paths) if paths else ["-"]
    for source in sources:
        if str(source) != "-" and not Path(source).is_file():
            fail(command, f"{source}: no such file")
        reader: JsonlReader[R] = read_jsonl(
            "-" if str(source) == "-" else source, expect, skip_bad=skip_bad
        )
        try:
            yield from reader
        except RecordError as err:
            fail(command, f"{err} (use --skip-bad to skip bad lines)")
        if reader.skipped:
            first = reader.errors[0] if reader.errors else ""
            console.print(
                f"legorl {command}: skipped {reader.skipped} bad line(s) in {reader.name}; "
                f"first: {first}",
                markup=False,
                soft_wrap=True,
            )


def key_values(command: str, flag: str, pairs: list[str] | None) -> dict[str, Any]:
    """``KEY=VALUE`` options as a dict; values that parse as JSON (numbers, booleans) do."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            fail(command, f"{flag} {pair!r}: expected KEY=VALUE", 2)
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def engine_log_beside(engine: str, opts: dict[str, Any], folder: Path) -> dict[str, Any]:
    """A vLLM server that legorl launches writes its log into ``folder`` (unless told where)."""
    if engine == "vllm" and "base_url" not in opts:
        opts.setdefault("log_path", str(folder / "vllm-server.log"))
    return opts


@contextlib.asynccontextmanager
async def on_ray(command: str, address: str, setup: Any) -> AsyncIterator[Any]:
    """The Ray executor (``legorl.executors.ray``) for ``setup`` on the cluster at
    ``address``: started before anything is written (the nodes it leaves out named on stderr),
    stopped after, its summary on stderr; a cluster that cannot take the work ends the
    command in one line."""
    from legorl.executors.ray import ExecutorError, RayExecutor

    executor = RayExecutor(address, setup)
    try:
        await executor.start()
        for why in executor.stats.refused.values():
            console.print(f"legorl {command}: left out: {why}", markup=False, soft_wrap=True)
        yield executor
    except ExecutorError as exc:
        fail(command, f"--ray {address}: {exc}")
    finally:
        await executor.close()
    console.print(f"legorl {command}: on Ray: {executor.stats.summary()}", markup=False)
