"""The Textual viewer driven by its pilot: list, filter, sort, detail, token view, metrics,
alerts, and live follow of files that grow while it runs. Each test saves an SVG screenshot to
tests/inspect/screenshots/."""

from __future__ import annotations

from pathlib import Path

import pytest
import run_data
from rich.console import Console
from run_data import MODEL, SCREENSHOTS, RunFiles
from textual.pilot import Pilot
from textual.widgets import DataTable, Input, Sparkline, Static, TabbedContent

from legorl.inspect.app import DetailScreen, InspectApp, MainScreen, MetricRow, TokenScreen
from legorl.records import Metric, TokenCounts, Trajectory, to_json

SIZE = (150, 44)
pytestmark = pytest.mark.asyncio

# The run's fixtures, shared with the other test module of this folder.
built_run = run_data.built_run
run = run_data.run


def shot(app: InspectApp, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    app.save_screenshot(f"{name}.svg", str(SCREENSHOTS))
    path = SCREENSHOTS / f"{name}.svg"
    assert path.stat().st_size > 1000
    return path


def text_of(widget: Static, width: int = 200) -> str:
    console = Console(record=True, width=width, color_system=None)
    console.print(widget.content)
    return console.export_text()


def column(table: DataTable, key: str) -> list[str]:
    return [str(table.get_cell(row, key)) for row in table.rows]


def ids(app: InspectApp) -> list[str]:
    table = app.main.query_one("#traj-table", DataTable)
    return [str(k.value) for k in table.rows]


async def settle(pilot: Pilot, until, tries: int = 200) -> None:
    """Let the app run (its follow timer too) until ``until()`` holds; bounded, not timed."""
    for _ in range(tries):
        if until():
            return
        await pilot.pause(0.05)
    assert until(), "the app never reached the expected state"


async def test_list_shows_each_trajectory(run: RunFiles) -> None:
    app = InspectApp(run.all(), follow=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        table = app.main.query_one("#traj-table", DataTable)
        assert ids(app) == ["traj-0", "traj-1", "traj-2"]
        assert column(table, "status") == ["ok", "agent_error", "sandbox_error"]
        assert column(table, "reward") == ["1", "0", "–"]
        assert column(table, "hack") == ["", "test_file_edited", ""]
        assert column(table, "turns") == ["4", "1", "0"]
        assert column(table, "harness") == ["mini", "opencode", "claude-code"]
        status = text_of(app.main.query_one("#traj-status", Static))
        assert "3 of 3 trajectories" in status and "3 alert(s)" in status
        shot(app, "list")


async def test_filter_search_and_sort(run: RunFiles) -> None:
    app = InspectApp(run.all(), follow=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("slash")
        assert isinstance(app.focused, Input)
        await pilot.press(*"hack:any")
        assert ids(app) == ["traj-1"]
        shot(app, "filter")
        search = app.main.query_one("#search", Input)
        search.value = ""
        await pilot.press(*"-status:ok")
        assert ids(app) == ["traj-1", "traj-2"]
        search.value = "geometry"
        await pilot.pause()
        assert ids(app) == ["traj-0"]
        search.value = "colour:red"
        await pilot.pause()
        assert "unknown field 'colour'" in text_of(app.main.query_one("#traj-status", Static))
        search.value = ""
        await pilot.press("enter")  # back to the list
        assert isinstance(app.focused, DataTable)
        # s cycles the sort column (order → task → harness → status → reward), S reverses.
        for _ in range(4):
            await pilot.press("s")
        assert app.main.sort_key == "reward"
        assert ids(app) == ["traj-2", "traj-1", "traj-0"]
        await pilot.press("S")
        assert ids(app) == ["traj-0", "traj-1", "traj-2"]
        # Clicking a header sorts by that column.
        await pilot.click("#traj-table", offset=(3, 0))
        assert app.main.sort_key == "task"
        assert ids(app) == ["traj-2", "traj-0", "traj-1"]
        shot(app, "sorted")


async def test_detail_shows_turns_segments_aux_patch_and_verdict(
    run: RunFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("legorl.inspect.render.PROMPT_CHARS", 200)  # cut the system prompt
    app = InspectApp(run.all(), model=MODEL, follow=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("enter")
        assert isinstance(app.screen, DetailScreen)
        assert app.screen.trajectory_id == "traj-0"
        head = text_of(app.screen.query_one("#detail-head", Static))
        assert "legorl-toy__geometry-1" in head and "867 prompt, 71 completion; 4 turns" in head
        turns = text_of(app.screen.query_one("#detail-turns", Static))
        assert "aux sub-sessions: traj-0~aux-" in turns
        assert "segment 0 · start" in turns
        assert "segment 1 · history rewritten at message 1" in turns
        assert "sub-session of traj-0" in turns
        assert "→ bash" in turns and "cat geometry.py" in turns
        assert "<tool_response>" in turns  # decoded with --model: the tool result
        assert "more characters (press e to expand)" in turns  # the system prompt is long
        await pilot.press("e")
        assert "press e to expand" not in text_of(app.screen.query_one("#detail-turns", Static))
        patch = text_of(app.screen.query_one("#detail-patch", Static))
        assert "+    return side * side" in patch
        verdict = text_of(app.screen.query_one("#detail-verdict", Static))
        assert "resolved" in verdict and "True" in verdict
        assert "tests/test_geometry.py::test_area" in verdict and "✓ passed" in verdict
        shot(app, "detail")
        await pilot.press("escape")
        assert isinstance(app.screen, MainScreen)
        assert isinstance(app.focused, DataTable)  # keys go to the list again
        # Without a model the parsed output is shown; an agent_error with a hack flag:
        await pilot.press("down", "enter")
        assert app.screen.trajectory_id == "traj-1"
        verdict = text_of(app.screen.query_one("#detail-verdict", Static))
        assert "✗ failed" in verdict
        head = text_of(app.screen.query_one("#detail-head", Static))
        assert "test_file_edited" in head


async def test_token_view_colours_by_logprob_and_delta(run: RunFiles) -> None:
    app = InspectApp(run.all(), model=MODEL, follow=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("enter", "k")  # traj-0's first sample, from its detail
        screen = app.screen
        assert isinstance(screen, TokenScreen) and screen.sample_id == "traj-0/0"
        assert screen.mode == "delta"  # trainer log-probs exist for it
        await pilot.press("n")
        assert screen.sample_id == "traj-0/1"
        stats = text_of(screen.query_one("#token-stats", Static))
        assert "Pearson(prob)" in stats and "max |Δ| 3.00e+00" in stats
        body = screen.query_one("#token-body", Static).content
        trained = [s.style for s in body.spans if s.style.bgcolor is not None]
        assert len(trained) == 9
        reds = [i for i, s in enumerate(trained) if s.bgcolor.triplet.green < 100]
        assert reds == [0, 3, 6]
        legend = text_of(screen.query_one("#token-legend", Static))
        assert "|Δ log-prob|" in legend
        shot(app, "tokens-delta")
        await pilot.press("d")
        assert screen.mode == "logprob"
        assert "rollout p" in text_of(screen.query_one("#token-legend", Static))
        shot(app, "tokens-logprob")
        await pilot.press("escape", "escape", "p")  # the samples tab
        assert app.main.query_one(TabbedContent).active == "samples"
        table = app.main.query_one("#sample-table", DataTable)
        assert [str(k.value) for k in table.rows] == ["traj-0/0", "traj-0/1", "traj-1/0"]
        await pilot.press("down", "down", "enter")
        assert isinstance(app.screen, TokenScreen) and app.screen.sample_id == "traj-1/0"


async def test_metrics_panel_has_a_sparkline_per_metric(run: RunFiles) -> None:
    app = InspectApp(run.all(), follow=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("m")
        assert app.main.query_one(TabbedContent).active == "metrics"
        rows = {r.series_name: r for r in app.main.query(MetricRow)}
        assert set(rows) == {
            "clip_fraction",
            "kl",
            "reward",
            "rollout_trainer_pearson",
            "runs: crash rate",
            "runs: reward (mean of 20)",
        }
        corr = rows["rollout_trainer_pearson"].query_one(Sparkline).data
        assert list(corr) == [0.9995] * 7 + [0.95] * 3
        assert "step 9: 0.95" in str(
            rows["rollout_trainer_pearson"].query_one(".metric-stats").content
        )
        shot(app, "metrics")
        await pilot.press("a")
        alerts = app.main.query_one("#alert-table", DataTable)
        assert column(alerts, "kind") == ["clip_spike", "correlation", "hack"]
        shot(app, "alerts")


async def test_live_follow_sees_appended_lines(run: RunFiles) -> None:
    app = InspectApp(run.all(), follow=True, interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: len(ids(app)) == 3)
        new = Trajectory(
            trajectory_id="traj-3",
            task_id="legorl-toy__stats-4",
            group_id="legorl-toy__stats-4",
            sample_index=1,
            harness="mini",
            status="harness_crash",
            tokens=TokenCounts(prompt=10, completion=5),
        )
        line = to_json(new) + b"\n"
        with open(run.trajectories, "ab") as fh:
            fh.write(line[:30])  # half a line: not shown, not an error
            fh.flush()
            await pilot.pause(0.2)
            assert ids(app) == ["traj-0", "traj-1", "traj-2"] and not app.store.errors
            fh.write(line[30:])
        await settle(pilot, lambda: "traj-3" in ids(app))
        table = app.main.query_one("#traj-table", DataTable)
        assert str(table.get_cell("traj-3", "status")) == "harness_crash"
        # Metrics grow live too, and the monitor sees them: a new step and an alert.
        with open(run.metrics, "ab") as fh:
            fh.write(to_json(Metric(step=10, name="clip_fraction", value=0.9)) + b"\n")
        await settle(pilot, lambda: 10 in app.store.metrics["clip_fraction"].by_step)
        await settle(pilot, lambda: any(a.step == 10 for a in app.store.monitor.alerts))
        await pilot.press("m")
        row = next(r for r in app.main.query(MetricRow) if r.series_name == "clip_fraction")
        assert list(row.query_one(Sparkline).data)[-1] == 0.9
        shot(app, "live")
        # f pauses following: lines appended now wait for r (reload).
        await pilot.press("t", "f")
        with open(run.trajectories, "ab") as fh:
            fh.write(line.replace(b"traj-3", b"traj-4"))
        await pilot.pause(0.3)
        assert "traj-4" not in ids(app)
        assert "not following" in text_of(app.main.query_one("#traj-status", Static))
        await pilot.press("r")
        assert "traj-4" in ids(app)


async def test_bad_lines_are_counted_not_fatal(run: RunFiles) -> None:
    with open(run.trajectories, "ab") as fh:
        fh.write(b'{"schema": "legorl/trajectory@1"}\n')
    app = InspectApp([run.trajectories], follow=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert len(ids(app)) == 3
        status = text_of(app.main.query_one("#traj-status", Static))
        assert "1 bad line(s)" in status and "graded.jsonl:4" in status


async def test_a_followed_folder_shows_runs_as_they_start_and_end(
    run: RunFiles, tmp_path: Path
) -> None:
    folder = tmp_path / "live"
    (folder / "turns").mkdir(parents=True)
    app = InspectApp([folder], follow=True, interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert ids(app) == []
        turns = (run.dir / "turns" / "traj-0.jsonl").read_bytes().splitlines(keepends=True)
        (folder / "turns" / "traj-0.jsonl").write_bytes(turns[0] + turns[1])  # a run starts
        await settle(pilot, lambda: ids(app) == ["traj-0"])
        table = app.main.query_one("#traj-table", DataTable)
        assert str(table.get_cell("traj-0", "status")) == "running"
        with open(folder / "turns" / "traj-0.jsonl", "ab") as fh:
            fh.write(b"".join(turns[2:]))
        await settle(pilot, lambda: str(table.get_cell("traj-0", "turns")) == "4")
        await pilot.press("enter")
        assert "running (no trajectory record yet)" in text_of(
            app.screen.query_one("#detail-head", Static)
        )
        shot(app, "running")
        await pilot.press("escape")
        # The run ends: rollout appends its trajectory record.
        line = run.trajectories.read_bytes().splitlines(keepends=True)[0]
        (folder / "traj.jsonl").write_bytes(line)
        await settle(pilot, lambda: str(table.get_cell("traj-0", "status")) == "ok")
        assert str(table.get_cell("traj-0", "task")) == "legorl-toy__geometry-1"
