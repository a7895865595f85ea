"""The viewer's pure parts: following growing files, the store and its query language, and the
renderables (tokens, verdicts, turns), on a real recorded run."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import run_data
from rich.console import Console
from run_data import MODEL, RunFiles

from legorl.inspect.follow import FileFollower
from legorl.inspect.render import (
    MASKED,
    Decoder,
    sparkline,
    token_text,
    turns_renderable,
    verdict_tests,
)
from legorl.inspect.store import QueryError, RunStore
from legorl.inspect.summary import load
from legorl.records import Metric, Trajectory, read_jsonl, to_json

# The run's fixtures, shared with the other test module of this folder.
built_run = run_data.built_run
run = run_data.run


def plain(renderable: object, width: int = 160) -> str:
    console = Console(record=True, width=width, color_system=None)
    console.print(renderable)
    return console.export_text()


# ---- following ---------------------------------------------------------------------------------


def test_follower_reads_only_whole_lines_and_keeps_going(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    follower = FileFollower(path)
    assert follower.poll() == []  # the file does not exist yet: wait for it
    line = to_json(Metric(step=0, name="reward", value=0.5)) + b"\n"
    path.write_bytes(line + line[:20])  # a writer is half-way through its second line
    first = follower.poll()
    assert [(x.lineno, x.record.step) for x in first] == [(1, 0)]
    assert follower.poll() == []
    with open(path, "ab") as fh:
        fh.write(line[20:] + b'{"schema": "legorl/metric@1", "step": "x"}\n')
    second = follower.poll()
    assert second[0].record.name == "reward" and second[0].lineno == 2
    assert second[1].record is None and second[1].error is not None
    assert str(second[1].error) == f"{path}:3: name: missing required field"


def test_follower_rereads_a_file_that_was_replaced(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_bytes(
        b"".join(to_json(Metric(step=i, name="kl", value=i)) + b"\n" for i in range(3))
    )
    follower = FileFollower(path)
    assert len(follower.poll()) == 3
    path.write_bytes(to_json(Metric(step=9, name="kl", value=9.0)) + b"\n")  # truncated, rewritten
    again = follower.poll()
    assert [x.record.step for x in again] == [9] and follower.resets == 1


def test_follower_loads_a_big_file_in_chunks(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_bytes(
        b"".join(to_json(Metric(step=i, name="kl", value=i)) + b"\n" for i in range(200))
    )
    follower = FileFollower(path, chunk_bytes=1000)
    got = []
    while True:
        got += follower.poll()
        if not follower.pending:
            break
    assert [x.record.step for x in got] == list(range(200))


# ---- the store -----------------------------------------------------------------------------------


def test_store_indexes_the_run(run: RunFiles) -> None:
    store = load(run.all())
    assert list(store.trajectories) == ["traj-0", "traj-1", "traj-2"]
    assert len(store.samples) == 3 and len(store.trainer_logprobs) == 3
    assert store.counts["Metric"] == 40 and not store.errors
    assert [a.kind for a in store.recorded_alerts] == ["clip_spike", "correlation"]
    # Computed alerts that repeat a recorded one are not shown twice; the hack flag is new.
    assert [(src, a.kind) for src, a in store.alerts] == [
        ("recorded", "clip_spike"),
        ("recorded", "correlation"),
        ("computed", "hack"),
    ]
    series = {s.name: s.points() for s in store.series()}
    assert series["rollout_trainer_pearson"][-1] == (9, 0.95)
    assert series["runs: crash rate"][-1] == (3, pytest.approx(1 / 3))


def test_turns_by_reference_and_inline(run: RunFiles) -> None:
    store = load([run.trajectories])
    turns, problems = store.turns_of("traj-0")
    assert not problems
    assert [t.segment_reason for t in turns if not t.flags.aux] == [
        "start",
        None,
        "history rewritten at message 1",
    ]
    assert sum(t.flags.aux for t in turns) == 1
    assert store.turn_count(store.trajectories["traj-0"]) == 4
    inline, _ = store.turns_of("traj-1")
    assert len(inline) == 1
    (run.dir / "turns" / "traj-0.jsonl").unlink()
    missing, problems = load([run.trajectories]).turns_of("traj-0")
    assert missing == [] and "no such file" in problems[0]


def test_a_graded_trajectory_replaces_the_rollout_record_in_place(run: RunFiles) -> None:
    store = RunStore()
    trajs = list(read_jsonl(run.trajectories, Trajectory))
    rollout = dataclasses.replace(trajs[0], reward=None, verdict=None)
    store.add(rollout, run.trajectories)
    store.add(trajs[1], run.trajectories)
    graded = dataclasses.replace(trajs[0], hack_flags=["conftest_hook"])
    store.add(graded, run.trajectories)
    assert list(store.trajectories) == ["traj-0", "traj-1"]  # first place kept
    assert store.trajectories["traj-0"].traj.reward == 1.0  # latest content
    assert store.monitor.trajectories == 2  # counted once towards the crash rate
    hacks = [a.trajectory_id for a in store.monitor.alerts if a.kind == "hack"]
    assert hacks == ["traj-1", "traj-0"]


def test_a_rollout_record_read_after_its_graded_one_does_not_undo_the_grade(
    run: RunFiles,
) -> None:
    # A folder read in name order gives graded.jsonl before trajectories.jsonl.
    store = RunStore()
    graded = next(iter(read_jsonl(run.trajectories, Trajectory)))
    assert graded.reward is not None
    store.add(graded, run.trajectories)
    store.add(dataclasses.replace(graded, reward=None, verdict=None), run.trajectories)
    assert store.trajectories[graded.trajectory_id].traj.reward == graded.reward


@pytest.mark.parametrize(
    ("query", "ids"),
    [
        ("", ["traj-0", "traj-1", "traj-2"]),
        ("status:ok", ["traj-0"]),
        ("-status:ok", ["traj-1", "traj-2"]),
        ("harness:open", ["traj-1"]),
        ("hack:any", ["traj-1"]),
        ("hack:none", ["traj-0", "traj-2"]),
        ("hack:test_file", ["traj-1"]),
        ("reward>0.5", ["traj-0"]),
        ("reward=none", ["traj-2"]),
        ("reward>=0 turns<2", ["traj-1"]),
        ("turns>=3", ["traj-0"]),
        ("tokens>10", ["traj-0"]),
        ("geometry", ["traj-0"]),
        ("env:yes", ["traj-2"]),
        ("task:grades status:agent", ["traj-1"]),
    ],
)
def test_query_language(run: RunFiles, query: str, ids: list[str]) -> None:
    store = load([run.trajectories])
    assert [e.traj.trajectory_id for e in store.rows(query)] == ids


def test_bad_queries_say_why(run: RunFiles) -> None:
    store = load([run.trajectories])
    with pytest.raises(QueryError, match="unknown field 'colour'"):
        store.rows("colour:red")
    with pytest.raises(QueryError, match="not a number"):
        store.rows("reward>high")


@pytest.mark.parametrize(
    ("key", "reverse", "ids"),
    [
        ("reward", True, ["traj-0", "traj-1", "traj-2"]),
        ("reward", False, ["traj-2", "traj-1", "traj-0"]),
        ("turns", True, ["traj-0", "traj-1", "traj-2"]),
        ("task", False, ["traj-2", "traj-0", "traj-1"]),
        ("harness", False, ["traj-2", "traj-0", "traj-1"]),
        ("hack", True, ["traj-1", "traj-0", "traj-2"]),
    ],
)
def test_sorting(run: RunFiles, key: str, reverse: bool, ids: list[str]) -> None:
    store = load([run.trajectories])
    assert [e.traj.trajectory_id for e in store.rows("", key, reverse)] == ids


# ---- renderables ---------------------------------------------------------------------------------


def test_token_text_colours_trained_tokens_and_greys_the_rest(run: RunFiles) -> None:
    store = load(run.all())
    sample = store.samples["traj-0/1"].sample
    trainer = store.trainer_logprobs["traj-0/1"].logprobs
    decoder = Decoder(MODEL)
    text = token_text(sample, decoder, trainer, "delta")
    assert text.plain.replace("↵", "") == decoder.text(sample.input_ids)
    styles = [span.style for span in text.spans]
    assert len(styles) == len(sample.input_ids)
    masked = [s for s, m in zip(styles, sample.loss_mask, strict=True) if not m]
    trained = [s for s, m in zip(styles, sample.loss_mask, strict=True) if m]
    assert all(s == MASKED for s in masked)
    assert all(s.bgcolor is not None for s in trained)
    # The trainer disagreed (by 3 nats) on every third loss token: those are red, others green.
    reds = [i for i, s in enumerate(trained) if s.bgcolor.triplet.green < 100]
    assert reds == list(range(0, len(trained), 3))
    by_logprob = token_text(sample, None, None, "logprob")
    assert "⟨" in by_logprob.plain  # without a tokenizer tokens show as ids


def test_verdict_tests_read_several_shapes() -> None:
    swe = {
        "resolved": False,
        "tests_status": {
            "FAIL_TO_PASS": {"success": [], "failure": ["t.py::a"]},
            "PASS_TO_PASS": {"success": ["t.py::b"], "failure": []},
        },
    }
    assert verdict_tests(swe) == [
        ("tests_status.FAIL_TO_PASS", "t.py::a", "failed"),
        ("tests_status.PASS_TO_PASS", "t.py::b", "passed"),
    ]
    assert verdict_tests({"tests": {"t.py::a": "PASSED"}}) == [("tests", "t.py::a", "passed")]
    assert verdict_tests({"results": [{"name": "x", "outcome": "error"}]}) == [
        ("results", "x", "error")
    ]


def test_turns_show_segments_aux_and_tool_calls(run: RunFiles) -> None:
    store = load([run.trajectories])
    turns, _ = store.turns_of("traj-0")
    without = plain(turns_renderable(turns, None))
    assert "aux sub-sessions: traj-0~aux-" in without
    assert "segment 1 · history rewritten at message 1" in without
    assert "→ bash" in without and "cat geometry.py" in without
    assert "Look at the geometry module first." in without  # thinking, parsed
    assert "give --model to decode" in without
    decoded = plain(turns_renderable(turns, Decoder(MODEL), expand=True))
    assert "<tool_response>" in decoded and "return 4 * side" in decoded  # the tool result


def test_sparkline() -> None:
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == "▁▂▃▄▅▆▇█"
    assert sparkline([1.0, 1.0]) == "▅▅"
    assert sparkline([]) == ""


def test_summary_command_prints_the_state(run: RunFiles) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "legorl.cli.main", "inspect", "--summary", *map(str, run.all())],
        capture_output=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert result.returncode == 0, result.stderr.decode()
    out = result.stdout.decode()
    assert "crash rate" in out and "1/3 (33%)" in out
    assert "test_file_edited 1" in out
    assert "rollout_trainer_pearson" in out and "▁" in out
    assert "correlation" in out and "clip_spike" in out and "hack" in out
    missing = subprocess.run(
        [sys.executable, "-m", "legorl.cli.main", "inspect", "--summary", str(run.dir / "nope")],
        capture_output=True,
        timeout=60,
    )
    assert missing.returncode == 1 and b"no such file" in missing.stderr


def test_a_folder_is_followed_and_turn_files_show_running_sessions(run: RunFiles) -> None:
    whole = load([run.dir])  # the trajectory file sorts before turns/: nothing is running
    assert list(whole.trajectories) == ["traj-0", "traj-1", "traj-2"]
    assert not any(e.running for e in whole.trajectories.values())
    live = load([run.dir / "turns"])  # a rollout still going: only its turn files exist
    entries = live.trajectories
    assert list(entries) == ["traj-0", "traj-1"] and all(e.running for e in entries.values())
    assert entries["traj-0"].live_turns == 4  # the aux title call belongs to its parent
    assert [e.traj.trajectory_id for e in live.rows("status:running turns>1")] == ["traj-0"]
    turns, _ = live.turns_of("traj-0")
    assert len(turns) == 4
    for traj in read_jsonl(run.trajectories, Trajectory):
        live.add(traj, run.trajectories)
    assert [(i, e.status) for i, e in live.trajectories.items()] == [
        ("traj-0", "ok"),
        ("traj-1", "agent_error"),
        ("traj-2", "sandbox_error"),
    ]
    assert live.monitor.trajectories == 3  # placeholders never reach the monitor
