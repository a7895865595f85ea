"""`legorl inspect --summary FILES`: the state of a run from its JSONL files, as plain tables
(for a terminal without the TUI, for CI logs, and for the Claude Code plugin's status command).

    from legorl.inspect.summary import load, summarize
    store = load(["runs/graded.jsonl", "runs/metrics.jsonl"])
    summarize(store, console)
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from legorl.inspect import render
from legorl.inspect.follow import FileFollower, expand
from legorl.inspect.store import RunStore
from legorl.records import ENVIRONMENT_FAILURES


def load(paths: Sequence[str | os.PathLike[str]]) -> RunStore:
    """Every whole line of every file, read once into a store."""
    store = RunStore()
    for path in expand(paths):
        follower = FileFollower(path)
        while True:
            lines = follower.poll()
            for line in lines:
                if line.error is not None:
                    store.add_error(line.error)
                elif line.record is not None:
                    store.add(line.record, follower.path)
            if not follower.pending:
                break
    return store


def summarize(store: RunStore, console: Console) -> None:
    counts = ", ".join(f"{n} {kind}" for kind, n in sorted(store.counts.items())) or "no records"
    console.print(Text(f"records: {counts}", style="bold"))
    if store.errors:
        console.print(
            Text(f"{len(store.errors)} bad line(s); first: {store.errors[0]}", style="red")
        )
    if store.trajectories:
        _trajectories(store, console)
    if store.samples:
        _samples(store, console)
    series = store.series()
    if series:
        table = Table(title="metrics", title_justify="left", expand=False)
        for column in ("metric", "steps", "last", "min", "max", "trend"):
            table.add_column(column, justify="right" if column in ("steps",) else "left")
        for s in series:
            points = s.points()
            values = [v for _, v in points]
            if not values:
                table.add_row(s.name, "0", "–", "–", "–", "")
                continue
            table.add_row(
                s.name,
                str(len(values)),
                f"{render.fmt(values[-1])} @ {points[-1][0]}",
                render.fmt(min(values)),
                render.fmt(max(values)),
                render.sparkline(values),
            )
        console.print(table)
    alerts = store.alerts
    if alerts:
        table = Table(title=f"alerts ({len(alerts)})", title_justify="left")
        for column in ("source", "kind", "where", "message"):
            table.add_column(column)
        for source, alert in alerts[-30:]:
            where = f"step {alert.step}" if alert.step is not None else alert.trajectory_id or ""
            table.add_row(source, Text(alert.kind, style="bold red"), where, alert.message)
        console.print(table)
    else:
        console.print(Text("alerts: none", style="green"))


def _trajectories(store: RunStore, console: Console) -> None:
    trajs = [e.traj for e in store.trajectories.values() if not e.running]
    running = len(store.trajectories) - len(trajs)
    if running:
        console.print(Text(f"running: {running} session(s) without a trajectory yet", style="cyan"))
    if not trajs:
        return
    n = len(trajs)
    by_status = Counter(t.status for t in trajs)
    crashes = sum(1 for t in trajs if t.status in ENVIRONMENT_FAILURES)
    graded = [t.reward for t in trajs if t.reward is not None]
    hacks = Counter(f for t in trajs for f in t.hack_flags)
    table = Table(title=f"trajectories ({n})", title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row(
        "status",
        ", ".join(f"{s} {c}" for s, c in by_status.most_common()),
    )
    crash_style = "bold red" if n and crashes / n > 0.2 else "green"
    table.add_row("crash rate", Text(f"{crashes}/{n} ({crashes / n:.0%})", style=crash_style))
    harnesses = Counter(t.harness for t in trajs)
    table.add_row("harnesses", ", ".join(f"{h} {c}" for h, c in harnesses.most_common()))
    if graded:
        solved = sum(1 for r in graded if r > 0)
        table.add_row(
            "reward",
            f"{len(graded)} graded, mean {sum(graded) / len(graded):.3f}, "
            f"{solved} with reward > 0 ({solved / len(graded):.0%})",
        )
    else:
        table.add_row("reward", "not graded yet (run legorl verify)")
    table.add_row(
        "hack flags",
        Text(", ".join(f"{f} {c}" for f, c in hacks.most_common()), style="bold red")
        if hacks
        else Text("none", style="green"),
    )
    table.add_row(
        "tokens",
        f"{sum(t.tokens.prompt for t in trajs)} prompt, "
        f"{sum(t.tokens.completion for t in trajs)} completion",
    )
    console.print(table)
    recent = list(store.trajectories.values())[-10:]
    listing = Table(title="latest trajectories", title_justify="left")
    for column in ("task", "harness", "status", "reward", "hack flags", "turns", "gen tok"):
        listing.add_column(column)
    for entry in recent:
        t = entry.traj
        listing.add_row(
            t.task_id,
            t.harness,
            Text(entry.status, style=render.STATUS_STYLE.get(entry.status, "")),
            render.fmt(t.reward),
            ", ".join(t.hack_flags),
            str(store.turn_count(entry)),
            str(t.tokens.completion),
        )
    console.print(listing)


def _samples(store: RunStore, console: Console) -> None:
    rows = store.sample_rows()
    trained = sum(len(e.sample.rollout_logprobs) for e in rows)
    corrs = [c for e in rows if (c := store.correlation_of(e.sample.sample_id)) is not None]
    line = f"samples: {len(rows)}, {trained} trained tokens"
    if corrs:
        worst = min(corrs)
        style = "green" if worst >= 0.99 else "bold red"
        console.print(
            Text(line + f"; Pearson(prob) over {len(corrs)} with trainer log-probs: worst ")
            + Text(f"{worst:.6f}", style=style)
        )
    else:
        console.print(line + "; no trainer log-probs")


def summarize_paths(paths: Sequence[Path], console: Console) -> RunStore:
    store = load(paths)
    summarize(store, console)
    return store
