"""The Textual app behind `legorl inspect`: trajectories, samples, metrics and alerts from JSONL
files that are followed live as they grow.

    legorl inspect runs/graded.jsonl runs/samples.jsonl runs/metrics.jsonl --model fixtures/models/tiny-qwen3

    app = InspectApp(["runs/graded.jsonl"], model=None)
    app.run()

Screens: the main tabs (trajectory list with filter / sort / search, samples, metric sparklines,
alerts), a trajectory's detail (turns, segments, aux sub-sessions, patch, verdict) and a
sample's token view (tokens coloured by rollout log-prob or by |Δ log-prob| against the
trainer's recomputed log-probs). Keys are in each class's ``BINDINGS``; styles in
``inspect.tcss``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import (
    DataTable,
    Footer,
    Header,
    Input,
    Label,
    Sparkline,
    Static,
    TabbedContent,
    TabPane,
)
from textual.widgets.data_table import ColumnKey

from legorl.inspect import render
from legorl.inspect.follow import FileFollower, jsonl_files
from legorl.inspect.store import SORT_KEYS, QueryError, RunStore, Series, TrajEntry

TRAJ_COLUMNS = (
    ("task", "task"),
    ("harness", "harness"),
    ("status", "status"),
    ("reward", "reward"),
    ("hack", "hack flags"),
    ("turns", "turns"),
    ("prompt", "prompt tok"),
    ("tokens", "gen tok"),
    ("id", "trajectory"),
)
SAMPLE_COLUMNS = (
    ("sample", "sample"),
    ("episode", "episode"),
    ("segment", "segment"),
    ("tokens", "tokens"),
    ("trained", "trained"),
    ("reward", "reward"),
    ("advantage", "advantage"),
    ("mean_lp", "mean log-prob"),
    ("corr", "Pearson(prob)"),
)
ALERT_COLUMNS = (("source", "source"), ("kind", "kind"), ("where", "where"), ("message", "message"))


class DetailScreen(Screen[None]):
    """One trajectory: header, turns (segments, aux sub-sessions), patch and verdict."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "app.pop_screen", "Back"),
        Binding("e", "expand", "Expand prompts"),
        Binding("k", "tokens", "Token view"),
    ]

    def __init__(self, store: RunStore, trajectory_id: str, decoder: render.Decoder | None):
        super().__init__()
        self.store = store
        self.trajectory_id = trajectory_id
        self.decoder = decoder
        self.expand = False
        self.turns, self.problems = store.turns_of(trajectory_id)

    def compose(self) -> ComposeResult:
        yield Header()
        with VerticalScroll(id="detail"):
            yield Static(id="detail-head")
            yield Static("Turns", classes="section-title")
            yield Static(id="detail-turns")
            yield Static("Patch", classes="section-title")
            yield Static(id="detail-patch")
            yield Static("Verdict", classes="section-title")
            yield Static(id="detail-verdict")
        yield Footer()

    def on_mount(self) -> None:
        entry = self.store.trajectories[self.trajectory_id]
        traj = entry.traj
        self.sub_title = f"{traj.task_id} · {traj.trajectory_id}"
        self.query_one("#detail-head", Static).update(
            render.trajectory_header(traj, len(self.turns), entry.source, running=entry.running)
        )
        self._draw_turns()
        self.query_one("#detail-patch", Static).update(render.patch_renderable(traj.patch))
        self.query_one("#detail-verdict", Static).update(render.verdict_renderable(traj.verdict))

    def _draw_turns(self) -> None:
        body: Any = render.turns_renderable(self.turns, self.decoder, expand=self.expand)
        if self.problems:
            from rich.console import Group

            body = Group(Text("\n".join(self.problems), style="bold red"), body)
        self.query_one("#detail-turns", Static).update(body)

    def action_expand(self) -> None:
        self.expand = not self.expand
        self._draw_turns()

    def action_tokens(self) -> None:
        samples = self.store.samples_of(self.trajectory_id)
        if not samples:
            self.notify("no samples for this trajectory (give the align output too)", timeout=4)
            return
        self.app.push_screen(
            TokenScreen(self.store, [s.sample_id for s in samples], 0, self.decoder)
        )


class TokenScreen(Screen[None]):
    """One sample's tokens, coloured by rollout log-prob, by |Δ log-prob| or (MoE) by whether
    the trainer routed them elsewhere than the rollout."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "app.pop_screen", "Back"),
        Binding("d", "toggle_mode", "Log-prob / |Δ|"),
        Binding("r", "routing_mode", "MoE routing"),
        Binding("n", "step(1)", "Next sample"),
        Binding("N", "step(-1)", "Previous sample"),
    ]

    def __init__(
        self,
        store: RunStore,
        sample_ids: Sequence[str],
        index: int,
        decoder: render.Decoder | None,
    ) -> None:
        super().__init__()
        self.store = store
        self.sample_ids = list(sample_ids)
        self.index = index
        self.decoder = decoder
        self.mode = "logprob"

    @property
    def sample_id(self) -> str:
        return self.sample_ids[self.index]

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="token-stats")
        yield Static(id="token-legend")
        with VerticalScroll(id="token-scroll"):
            yield Static(id="token-body")
        yield Footer()

    def on_mount(self) -> None:
        side = self.store.trainer_logprobs.get(self.sample_id)
        if side is not None:
            self.mode = "delta"  # the figure that matters when it exists
        self.draw()

    def draw(self) -> None:
        sample = self.store.samples[self.sample_id].sample
        side = self.store.trainer_logprobs.get(self.sample_id)
        trainer = side.logprobs if side is not None else None
        self.sub_title = f"sample {self.index + 1}/{len(self.sample_ids)}: {self.sample_id}"
        self.query_one("#token-stats", Static).update(render.token_stats(sample, trainer))
        self.query_one("#token-legend", Static).update(
            render.token_legend(self.mode, trainer is not None)
        )
        differs = side.routing_differs if side is not None else None
        self.query_one("#token-body", Static).update(
            render.token_text(sample, self.decoder, trainer, self.mode, differs)
        )

    def action_toggle_mode(self) -> None:
        if self.sample_id not in self.store.trainer_logprobs:
            self.notify("no trainer log-probs for this sample", timeout=3)
            return
        self.mode = "logprob" if self.mode == "delta" else "delta"
        self.draw()

    def action_routing_mode(self) -> None:
        side = self.store.trainer_logprobs.get(self.sample_id)
        if side is None or side.routing_differs is None:
            self.notify("no MoE routing comparison for this sample", timeout=3)
            return
        self.mode = "logprob" if self.mode == "routing" else "routing"
        self.draw()

    def action_step(self, delta: int) -> None:
        self.index = (self.index + delta) % len(self.sample_ids)
        self.mode = "delta" if self.sample_id in self.store.trainer_logprobs else "logprob"
        self.draw()


class MetricRow(Horizontal):
    """A metric's name, a sparkline of its values by step, and its last / min / max."""

    def __init__(self, series: Series) -> None:
        super().__init__(classes="metric-row")
        self.series_name = series.name
        self._points = series.points()

    def compose(self) -> ComposeResult:
        yield Label(self.series_name, classes="metric-name")
        yield Sparkline([v for _, v in self._points], classes="metric-spark")
        yield Label(self._stats(), classes="metric-stats")

    def _stats(self) -> str:
        if not self._points:
            return "no values"
        values = [v for _, v in self._points]
        step, last = self._points[-1]
        return (
            f"step {step}: {render.fmt(last)}  min {render.fmt(min(values))}  "
            f"max {render.fmt(max(values))}  ({len(values)})"
        )

    def update_series(self, series: Series) -> None:
        self._points = series.points()
        self.query_one(Sparkline).data = [v for _, v in self._points]
        self.query_one(".metric-stats", Label).update(self._stats())


class MainScreen(Screen[None]):
    """The tabs: trajectory list (filter, sort, search), samples, metrics, alerts."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("slash", "search", "Filter"),
        Binding("escape", "leave_search", "List", show=False),
        Binding("s", "sort", "Sort"),
        Binding("S", "reverse", "Reverse"),
        Binding("t", "show_tab('trajectories')", "Trajectories"),
        Binding("p", "show_tab('samples')", "Samples"),
        Binding("m", "show_tab('metrics')", "Metrics"),
        Binding("a", "show_tab('alerts')", "Alerts"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.query_text = ""
        self.query_error: str | None = None
        self.sort_key = "order"
        self.reverse = False
        self._drawn = -1
        self._metric_rows: dict[str, MetricRow] = {}

    @property
    def store(self) -> RunStore:
        return self._inspect.store

    @property
    def _inspect(self) -> InspectApp:
        app = self.app
        assert isinstance(app, InspectApp)
        return app

    def compose(self) -> ComposeResult:
        yield Header()
        with TabbedContent(initial="trajectories", id="tabs"):
            with TabPane("Trajectories", id="trajectories"):
                yield Input(
                    placeholder="filter: words  status:ok  harness:mini  reward>0  hack:any  "
                    "turns>=3  -status:ok   (/ to focus, enter or esc to go back to the list)",
                    id="search",
                )
                yield DataTable(id="traj-table", cursor_type="row", zebra_stripes=True)
                yield Static(id="traj-status", classes="status-line")
            with TabPane("Samples", id="samples"):
                yield DataTable(id="sample-table", cursor_type="row", zebra_stripes=True)
            with TabPane("Metrics", id="metrics"):
                yield VerticalScroll(id="metric-list")
            with TabPane("Alerts", id="alerts"):
                yield DataTable(id="alert-table", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = ", ".join(p.name for p in self._inspect.paths)
        for key, label in TRAJ_COLUMNS:
            self.query_one("#traj-table", DataTable).add_column(label, key=key)
        for key, label in SAMPLE_COLUMNS:
            self.query_one("#sample-table", DataTable).add_column(label, key=key)
        for key, label in ALERT_COLUMNS:
            self.query_one("#alert-table", DataTable).add_column(label, key=key)
        self.query_one("#traj-table", DataTable).focus()
        self._inspect.start()

    def on_screen_resume(self) -> None:
        # Back from a detail or token view: keys go to the list again, not to the filter.
        self._focus_tab()

    # ---- drawing ------------------------------------------------------------------------

    def redraw(self, force: bool = False) -> None:
        if not force and self.store.version == self._drawn:
            return
        self._drawn = self.store.version
        self._draw_trajectories()
        self._draw_samples()
        self._draw_metrics()
        self._draw_alerts()

    def _draw_trajectories(self) -> None:
        table = self.query_one("#traj-table", DataTable)
        keep = _cursor_key(table)
        try:
            rows = self.store.rows(self.query_text, self.sort_key, self.reverse)
            self.query_error = None
        except QueryError as exc:
            rows = self.store.rows("", self.sort_key, self.reverse)
            self.query_error = str(exc)
        table.clear()
        arrow = " ▼" if self.reverse else " ▲"
        for key, label in TRAJ_COLUMNS:
            table.columns[ColumnKey(key)].label = Text(
                label + (arrow if key == self.sort_key else "")
            )
        for entry in rows:
            table.add_row(*self._traj_cells(entry), key=entry.traj.trajectory_id)
        _restore_cursor(table, keep)
        self.draw_status()

    def _traj_cells(self, entry: TrajEntry) -> list[Any]:
        t = entry.traj
        status = Text(entry.status, style=render.STATUS_STYLE.get(entry.status, ""))
        hack = Text(", ".join(t.hack_flags), style="bold red") if t.hack_flags else Text("")
        reward = Text(render.fmt(t.reward), justify="right")
        return [
            t.task_id,
            t.harness,
            status,
            reward,
            hack,
            Text(str(self.store.turn_count(entry)), justify="right"),
            Text(str(t.tokens.prompt), justify="right"),
            Text(str(t.tokens.completion), justify="right"),
            t.trajectory_id,
        ]

    def draw_status(self) -> None:
        store = self.store
        shown = self.query_one("#traj-table", DataTable).row_count
        arrow = "↓" if self.reverse else "↑"
        text = Text(
            f"{shown} of {len(store.trajectories)} trajectories · sorted by {self.sort_key} {arrow}"
            f" · {len(store.samples)} samples · {len(store.metrics)} metrics · "
            f"{'following' if self._inspect.following else 'not following'} "
            f"{len(self._inspect.paths)} file(s)"
        )
        if store.alerts:
            text.append(f" · {len(store.alerts)} alert(s)", style="bold red")
        if store.errors:
            text.append(f" · {len(store.errors)} bad line(s): {store.errors[-1]}", style="red")
        if self.query_error:
            text.append(f"\nfilter: {self.query_error}", style="bold red")
        self.query_one("#traj-status", Static).update(text)

    def _draw_samples(self) -> None:
        table = self.query_one("#sample-table", DataTable)
        keep = _cursor_key(table)
        table.clear()
        for entry in self.store.sample_rows():
            s = entry.sample
            lps = s.rollout_logprobs
            corr = self.store.correlation_of(s.sample_id)
            corr_text = Text(
                render.fmt(corr, 6),
                style="" if corr is None else "green" if corr >= 0.99 else "bold red",
                justify="right",
            )
            table.add_row(
                s.sample_id,
                s.episode_id,
                f"{s.segment_index + 1}/{s.segment_count}",
                Text(str(len(s.input_ids)), justify="right"),
                Text(str(len(lps)), justify="right"),
                Text(render.fmt(s.reward), justify="right"),
                Text(render.fmt(s.advantage), justify="right"),
                Text(f"{sum(lps) / len(lps):.3f}" if lps else "–", justify="right"),
                corr_text,
                key=s.sample_id,
            )
        _restore_cursor(table, keep)

    def _draw_metrics(self) -> None:
        box = self.query_one("#metric-list", VerticalScroll)
        for series in self.store.series():
            row = self._metric_rows.get(series.name)
            if row is None:
                row = MetricRow(series)
                self._metric_rows[series.name] = row
                box.mount(row)
            else:
                row.update_series(series)

    def _draw_alerts(self) -> None:
        table = self.query_one("#alert-table", DataTable)
        alerts = self.store.alerts
        if table.row_count == len(alerts):
            return
        table.clear()
        for source, alert in alerts:
            where = f"step {alert.step}" if alert.step is not None else alert.trajectory_id or ""
            table.add_row(source, Text(alert.kind, style="bold red"), where, alert.message)

    # ---- events -------------------------------------------------------------------------

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "search":
            self.query_text = event.value
            self._draw_trajectories()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "search":
            self.query_one("#traj-table", DataTable).focus()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        key = event.row_key.value
        if key is None:
            return
        decoder = self._inspect.decoder
        if event.data_table.id == "traj-table":
            self.app.push_screen(DetailScreen(self.store, key, decoder))
        elif event.data_table.id == "sample-table":
            ids = [e.sample.sample_id for e in self.store.sample_rows()]
            self.app.push_screen(TokenScreen(self.store, ids, ids.index(key), decoder))

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        if event.data_table.id != "traj-table":
            return
        key = str(event.column_key.value)
        if key == self.sort_key:
            self.reverse = not self.reverse
        else:
            self.sort_key, self.reverse = key, key in ("reward", "turns", "prompt", "tokens")
        self._draw_trajectories()

    # ---- actions ------------------------------------------------------------------------

    def action_search(self) -> None:
        self.action_show_tab("trajectories")
        self.query_one("#search", Input).focus()

    def action_leave_search(self) -> None:
        self.query_one("#traj-table", DataTable).focus()

    def action_sort(self) -> None:
        keys = list(SORT_KEYS)
        self.sort_key = keys[(keys.index(self.sort_key) + 1) % len(keys)]
        self._draw_trajectories()

    def action_reverse(self) -> None:
        self.reverse = not self.reverse
        self._draw_trajectories()

    def action_show_tab(self, tab: str) -> None:
        self.query_one(TabbedContent).active = tab
        self._focus_tab()

    def _focus_tab(self) -> None:
        tab = self.query_one(TabbedContent).active
        table = {
            "trajectories": "#traj-table",
            "samples": "#sample-table",
            "alerts": "#alert-table",
        }
        if tab in table:
            self.query_one(table[tab], DataTable).focus()
        else:
            self.set_focus(None)


class InspectApp(App[None]):
    """Follows JSONL files of Trajectory, Sample, Metric (and alert / trainer log-prob side)
    records; see the module docstring."""

    CSS_PATH = "inspect.tcss"
    TITLE = "legorl inspect"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "Quit"),
        Binding("r", "refresh", "Reload"),
        Binding("f", "toggle_follow", "Follow"),
    ]

    def __init__(
        self,
        paths: Sequence[str | Path],
        *,
        model: str | Path | None = None,
        follow: bool = True,
        interval: float = 0.5,
    ) -> None:
        super().__init__()
        self.paths = [Path(p) for p in paths]
        self.folders = [p for p in self.paths if p.is_dir()]
        self.followers = [FileFollower(p) for p in self.paths if p not in self.folders]
        self.store = RunStore()
        self.decoder = render.Decoder(model) if model is not None else None
        self.follow = follow
        self.interval = interval
        self._timer: Timer | None = None
        self._paused = False
        self.main = MainScreen()

    def get_default_screen(self) -> Screen[Any]:
        return self.main

    def start(self) -> None:
        """Read the files, then keep reading them (once the main screen exists)."""
        if self.follow:
            self._timer = self.set_interval(self.interval, self.poll_files)
        self.poll_files()

    @property
    def following(self) -> bool:
        return self._timer is not None and not self._paused

    def poll_files(self) -> None:
        """Read what was appended to each file (and new files in followed folders) and redraw
        what changed."""
        followed = {f.path for f in self.followers}
        for path in jsonl_files(self.folders):
            if path not in followed:
                self.followers.append(FileFollower(path))
        for follower in self.followers:
            for line in follower.poll():
                if line.error is not None:
                    self.store.add_error(line.error)
                elif line.record is not None:
                    self.store.add(line.record, follower.path)
        self.main.redraw()
        if any(f.pending for f in self.followers):
            self.call_after_refresh(self.poll_files)

    def action_refresh(self) -> None:
        self.poll_files()

    def action_toggle_follow(self) -> None:
        if self._timer is None:
            self._timer = self.set_interval(self.interval, self.poll_files)
        elif self._paused:
            self._timer.resume()
            self._paused = False
        else:
            self._timer.pause()
            self._paused = True
        self.main.draw_status()


def _cursor_key(table: DataTable[Any]) -> str | None:
    if table.row_count == 0:
        return None
    try:
        return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
    except Exception:
        return None


def _restore_cursor(table: DataTable[Any], key: str | None) -> None:
    if key is None:
        return
    with contextlib.suppress(Exception):  # the row is filtered out now
        table.move_cursor(row=table.get_row_index(key), animate=False)
