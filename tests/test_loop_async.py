"""`legorl loop --async`: admission control bounds staleness, K = 0 is the synchronous loop
(same trajectories, samples and bit-identical checkpoints), filtered and dropped groups are
counted, and bad options are refused before any work.

Real parts: the embedded engine serving the random tiny model, the built-in `mini` agent in
`local` (bubblewrap) sandboxes, grading in fresh sandboxes, the trainer. As in test_loop.py,
the tiny model never solves a task (every reward 0), so the mechanics runs keep zero-variance
groups and add an entropy bonus, which gives every step a gradient.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT

from legorl.loop import LoopConfig, LoopConfigError, LoopResult, run_loop
from legorl.records import Metric, Sample, Trajectory, Turn, read_jsonl

TASKS = ROOT / "fixtures" / "tasks"
MODEL = ROOT / "fixtures" / "models" / "tiny-qwen3"
MECHANICS = ["drop_zero_variance_groups=false", "entropy_coef=0.01"]


def _config(out: Path, **changes: object) -> LoopConfig:
    fields: dict = dict(
        model=MODEL,
        tasks_dir=TASKS,
        out=out,
        iterations=2,
        group_size=2,
        tasks_per_iteration=2,
        eval_samples=1,
        eval_limit=1,
        max_turns=2,
        max_tokens=16,
        concurrency=1,
        timeout=120.0,
        lr=1e-3,
        train_overrides=list(MECHANICS),
        device="cpu",
        seeded_rollouts=True,
    )
    fields.update(changes)
    return LoopConfig(**fields)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _trajectories(folder: Path) -> dict[str, dict]:
    """What a run produced, without what the clock sets."""
    out = {}
    for t in read_jsonl(folder / "graded.jsonl", Trajectory):
        out[t.trajectory_id] = {
            "status": t.status,
            "patch": t.patch,
            "tokens": (t.tokens.prompt, t.tokens.completion),
            "reward": t.reward,
            "hack_flags": t.hack_flags,
        }
    return out


def _turns(folder: Path) -> dict[str, list[tuple]]:
    return {
        p.name: [
            (t.turn, t.policy_version, t.prompt_delta, t.completion_ids, t.completion_logprobs)
            for t in read_jsonl(p, Turn)
        ]
        for p in sorted((folder / "turns").glob("*.jsonl"))
    }


def _trainer_figures(folder: Path) -> list[tuple]:
    """The trainer's metrics but those the clock and the machine set (timings, memory)."""
    timed = ("seconds", "time", "memory", "_mb", "per_s")
    return [
        (m.step, m.name, m.value)
        for m in read_jsonl(folder / "metrics.jsonl", Metric)
        if not (m.name.endswith("_s") or any(x in m.name for x in timed))
    ]


@pytest.fixture(scope="module")
def sync_and_k0(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, LoopResult]:
    base = tmp_path_factory.mktemp("k0")
    run_loop(_config(base / "sync"))
    k0 = run_loop(_config(base / "async", use_async=True, max_staleness=0))
    return base / "sync", base / "async", k0


def test_max_staleness_0_is_the_synchronous_loop(
    sync_and_k0: tuple[Path, Path, LoopResult],
) -> None:
    sync, k0, result = sync_and_k0
    assert result.state.finished == 2 and result.state.policy_version == 2
    for folder in ("eval-before", "iter-001", "iter-002", "eval-after"):
        assert _trajectories(sync / folder) == _trajectories(k0 / folder), folder
        assert _turns(sync / folder) == _turns(k0 / folder), folder
    for k in (1, 2):
        it = f"iter-{k:03d}"
        a = list(read_jsonl(sync / it / "samples.jsonl", Sample))
        b = list(read_jsonl(k0 / it / "samples.jsonl", Sample))
        assert a and a == b, it  # every field, in the same order
        # the weights after each step, bit for bit
        assert _sha(sync / it / "checkpoint" / "model.safetensors") == _sha(
            k0 / it / "checkpoint" / "model.safetensors"
        ), it
        # the trainer's own figures; its timings and memory are the clock's and the machine's
        ma, mb = _trainer_figures(sync / it), _trainer_figures(k0 / it)
        assert len(ma) > 10 and ma == mb, it
    # K = 0: every trained sample was sampled by the weights it is trained against
    for it in result.state.iterations:
        assert set(it.staleness) == {"0"} and it.dropped == [] and it.filtered == []


def test_the_async_loop_reports_its_metrics(sync_and_k0: tuple[Path, Path, LoopResult]) -> None:
    _, k0, result = sync_and_k0
    names = {(m.step, m.name) for m in read_jsonl(k0 / "metrics.jsonl", Metric)}
    for name in (
        "staleness_0",
        "dropped_stale",
        "filtered_groups",
        "spanning_fraction",
        "drain_seconds",
        "engine_busy_fraction",
        "trainer_idle_fraction",
    ):
        assert (1, name) in names and (2, name) in names, name
    for it in result.state.iterations:
        # the drain is the engine's wait for the calls in flight, a part of the whole sync
        assert it.trained and 0 <= it.drain_seconds <= it.phase_seconds["reload"]
        assert it.engine_busy_fraction is not None and 0 < it.engine_busy_fraction <= 1
        assert it.trainer_idle_fraction is not None and 0 <= it.trainer_idle_fraction < 1
        # every group consumed once, in the order drawn
        assert it.groups == [f"it{it.iteration:03d}-{t}" for t in it.tasks]


def test_staleness_1_overlaps_and_trains_each_episode_once(tmp_path: Path) -> None:
    result = run_loop(
        _config(tmp_path / "run", use_async=True, max_staleness=1, iterations=3, concurrency=2)
    )
    state = result.state
    assert state.finished == 3 and state.policy_version == 3
    for it in state.iterations:
        assert set(it.staleness) <= {"0", "1"}, it.staleness
    consumed = [g for it in state.iterations for g in it.groups]
    assert len(consumed) == len(set(consumed)) == 6
    # each trained episode's samples appear in exactly one step
    episodes = [
        s.episode_id
        for k in (1, 2, 3)
        for s in read_jsonl(tmp_path / "run" / f"iter-{k:03d}" / "samples.jsonl", Sample)
    ]
    assert len(set(episodes)) == 12 and all(
        episodes.count(e) == episodes.count(episodes[0]) for e in episodes
    )
    # the bound let batch 2 start before step 1's weights were synced: some of its turns
    # were sampled at version 0 (or the admission did not overlap, which it must at K = 1)
    versions = {
        t.policy_version
        for p in (tmp_path / "run" / "iter-002" / "turns").glob("*.jsonl")
        for t in read_jsonl(p, Turn)
    }
    assert 0 in versions


def test_zero_variance_groups_are_filtered_and_counted(tmp_path: Path) -> None:
    # The trainer's defaults drop zero-variance groups: the loop filters them first.
    result = run_loop(_config(tmp_path / "run", use_async=True, iterations=1, train_overrides=[]))
    (it,) = result.state.iterations
    assert len(it.filtered) == 2 and it.samples == 0 and not it.trained
    filtered = [
        m.value
        for m in read_jsonl(tmp_path / "run" / "metrics.jsonl", Metric)
        if m.name == "filtered_groups"
    ]
    assert filtered == [2.0]


# ---- bad input ---------------------------------------------------------------------------


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "legorl.cli.main", "loop", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--async", "--max-staleness", "-1"], "--max-staleness: must be >= 0"),
        (["--async", "--batch-groups", "0"], "--batch-groups: must be at least one whole group"),
        (["--async", "--on-stale", "keep"], "--on-stale: expected drop or rerun"),
    ],
)
def test_bad_async_options_exit_2_naming_the_flag(
    tmp_path: Path, args: list[str], message: str
) -> None:
    result = _cli("--model", str(MODEL), "--tasks-dir", str(TASKS), *args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr, result.stderr
    assert not (tmp_path / "runs").exists()  # nothing started


@pytest.fixture
def not_dev_vllm() -> Iterator[str]:
    """An HTTP server that answers like a vLLM server outside dev mode: no /server_info."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_async_refuses_an_engine_that_cannot_reload_live(tmp_path: Path, not_dev_vllm: str) -> None:
    config = _config(
        tmp_path / "run",
        use_async=True,
        engine="vllm",
        engine_options={"base_url": not_dev_vllm},
    )
    with pytest.raises(LoopConfigError, match="cannot reload weights while it serves") as err:
        run_loop(config)
    assert err.value.field == "async" and not_dev_vllm in str(err.value)
    assert not (tmp_path / "run").exists()
    # the same server, told to reload through collective_rpc, passes this check
    from legorl.loop.driver_async import check_live_reload

    check_live_reload(
        _config(
            tmp_path / "run",
            use_async=True,
            engine="vllm",
            engine_options={"base_url": not_dev_vllm, "weight_reload": "collective_rpc"},
        )
    )


def test_state_json_keeps_the_async_fields(sync_and_k0: tuple[Path, Path, LoopResult]) -> None:
    _, k0, _ = sync_and_k0
    data = json.loads((k0 / "state.json").read_text())
    assert data["config"]["use_async"] is True and data["config"]["max_staleness"] == 0
    assert data["iterations"][0]["groups"] and "staleness" in data["iterations"][0]


# ---- faults ----------------------------------------------------------------------------------


def _children() -> list[str]:
    """This process's live child processes (a sandbox's bubblewrap, a vLLM server), by name."""
    me, found = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            found.append(stat.parent.name)
    return found


def test_a_trainer_crash_stops_the_loop_with_the_reason_and_the_rollouts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from legorl.loop import stages
    from legorl.loop.state import LoopError

    real = stages.train_samples

    def crash_at_step_2(config: LoopConfig, samples: list, **kw: object) -> object:
        if kw["step"] == 2:  # a fault inside the trainer, as a real one would raise
            raise RuntimeError("CUDA error: an illegal memory access")
        return real(config, samples, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(stages, "train_samples", crash_at_step_2)
    before = set(_children())
    config = _config(tmp_path / "run", use_async=True, max_staleness=1, iterations=3, concurrency=2)
    with pytest.raises(LoopError, match="iteration 2: train: RuntimeError: CUDA error"):
        run_loop(config)
    # the rollouts in flight were stopped: no sandbox process is left behind
    assert set(_children()) <= before
    # what was written stays: step 1 finished, its checkpoint and the runs' records
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    assert state["finished"] == 1 and state["checkpoint"] == "iter-001/checkpoint"
    assert len(list(read_jsonl(tmp_path / "run" / "iter-001" / "graded.jsonl", Trajectory))) == 4


def _runs_at(out: Path) -> tuple[dict[str, bytes], dict[str, bytes], dict[str, bytes]]:
    """Of the training batches under ``out``: each written trajectory's record and each written
    grading's (by run id), and the Turns of each run in flight (a Turn file, no trajectory)."""
    written: dict[str, bytes] = {}
    graded: dict[str, bytes] = {}
    in_flight: dict[str, bytes] = {}
    for folder in sorted(out.glob("iter-*")):
        for name, into in (("trajectories.jsonl", written), ("graded.jsonl", graded)):
            path = folder / name
            for line in path.read_bytes().splitlines() if path.exists() else []:
                try:
                    into[json.loads(line)["trajectory_id"]] = line
                except ValueError:  # a line cut by the kill: not written
                    continue
        for turns in (folder / "turns").glob("*.jsonl"):
            if turns.stem not in written:
                in_flight[turns.stem] = turns.read_bytes()
    return written, graded, in_flight


def test_a_killed_async_loop_resumes_without_training_an_episode_twice(tmp_path: Path) -> None:
    import signal
    import time

    args = [
        *("--model", str(MODEL), "--tasks-dir", str(TASKS), "--out", "run"),
        *("--iterations", "3", "--group-size", "2", "--tasks-per-iteration", "2"),
        *("--eval-samples", "1", "--eval-limit", "1", "--max-turns", "2", "--max-tokens", "16"),
        *("--device", "cpu", "--lr", "1e-3", "--concurrency", "2"),
        *("--async", "--max-staleness", "1", "--seeded-rollouts", *MECHANICS),
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "legorl.cli.main", "loop", *args],
        cwd=tmp_path,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    out = tmp_path / "run"

    def finished() -> int:
        try:
            return int(json.loads((out / "state.json").read_text())["finished"])
        except (OSError, ValueError, KeyError):
            return 0

    # The kill: after step 1, while a later batch has a run in flight and one written
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        f = finished()
        if f >= 1:
            written, _, in_flight = _runs_at(out)
            if in_flight and any(int(t[2:5]) > f for t in written):
                break
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    steps = finished()
    assert 1 <= steps < 3
    # what the kill left (nothing changes it now): runs written, gradings, runs in flight
    written, graded, in_flight = _runs_at(out)
    assert in_flight, "no run was in flight at the kill"
    untrained = {t for t in written if int(t[2:5]) > steps}  # written, its step not taken
    assert untrained, "no run of a step still to come was written before the kill"
    trained_before = {
        k: (out / f"iter-{k:03d}" / "samples.jsonl").read_bytes() for k in range(1, steps + 1)
    }

    resumed = _cli(*args, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"continuing after iteration {steps}" in resumed.stderr
    for k, data in trained_before.items():  # the finished steps are kept as they were
        assert (out / f"iter-{k:03d}" / "samples.jsonl").read_bytes() == data, k
    state = json.loads((out / "state.json").read_text())
    assert state["finished"] == 3
    after_written, after_graded, after_in_flight = _runs_at(out)
    assert not after_in_flight
    # a run written before the kill is kept: its record and grading as they were, not run again
    for tid, record in written.items():
        assert after_written[tid] == record, tid
        assert not list(out.glob(f"iter-*/turns/{tid}.jsonl.orphan-*")), tid  # not run again
    for tid, record in graded.items():
        assert after_graded[tid] == record, tid
    # a run in flight at the kill was run again: its Turns then were set aside whole, it has a
    # trajectory now, and what was trained of it came from the new run's Turns
    samples = {
        s.episode_id: s
        for k in range(steps + 1, 4)
        for s in read_jsonl(out / f"iter-{k:03d}" / "samples.jsonl", Sample)
    }
    for tid, turns_then in in_flight.items():
        (turns,) = out.glob(f"iter-*/turns/{tid}.jsonl")
        assert (turns.parent / f"{tid}.jsonl.orphan-1").read_bytes() == turns_then, tid
        assert tid in after_written, tid
        if tid in samples:  # its group was trained (not dropped for staleness)
            new = [lp for t in read_jsonl(turns, Turn) for lp in t.completion_logprobs]
            assert samples[tid].rollout_logprobs == new, tid
    # every group of the three batches consumed once, by its ids
    groups = [g for it in state["iterations"] for g in it["groups"]]
    assert len(groups) == len(set(groups)) == 6
    # no run rolled out twice in a batch, none trained twice, none lost
    for k in (1, 2, 3):
        ids = [
            t.trajectory_id for t in read_jsonl(out / f"iter-{k:03d}" / "graded.jsonl", Trajectory)
        ]
        assert len(ids) == len(set(ids)) == 4, k
    trained = [
        (k, s.episode_id)
        for k in (1, 2, 3)
        for s in read_jsonl(out / f"iter-{k:03d}" / "samples.jsonl", Sample)
    ]
    steps_of: dict[str, set[int]] = {}
    for k, e in trained:
        steps_of.setdefault(e, set()).add(k)
    assert all(len(v) == 1 for v in steps_of.values())  # each episode in one step only
    dropped = [g for it in state["iterations"] for g in it["dropped"]]
    assert len(steps_of) == 12 - 2 * len(dropped)  # the others all trained


def test_inspect_shows_the_async_metrics(sync_and_k0: tuple[Path, Path, LoopResult]) -> None:
    _, k0, _ = sync_and_k0
    shown = subprocess.run(
        [sys.executable, "-m", "legorl.cli.main", "inspect", "--summary", str(k0)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    for name in ("staleness_0", "filtered_groups", "drain_seconds", "engine_busy_fraction"):
        assert name in shown.stdout, (name, shown.stdout[:3000])


def test_an_engine_that_dies_fails_its_episodes_and_stops_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio
    import time

    from legorl.loop.driver_async import AsyncRunner
    from legorl.loop.state import LoopError

    real = AsyncRunner._train
    closed: list[float] = []

    def dying(self: AsyncRunner, k: int, samples: list, folder: Path, signal: int) -> object:
        if k == 1:  # the engine dies while step 1 trains, with batch 2's episodes in flight
            done = asyncio.run_coroutine_threadsafe(self.core.engine.close(), self.event_loop)
            done.result(timeout=60)
            closed.append(time.time())
            time.sleep(3)
        return real(self, k, samples, folder, signal)

    monkeypatch.setattr(AsyncRunner, "_train", dying)
    before = set(_children())
    # one run at a time, 8 a batch: batch 2 still has runs to start when the engine dies
    config = _config(tmp_path / "run", use_async=True, max_staleness=1, iterations=3, group_size=4)
    with pytest.raises(LoopError, match="iteration 1: weight sync: engine is closed"):
        run_loop(config)
    assert set(_children()) <= before
    trajs = list(read_jsonl(tmp_path / "run" / "iter-002" / "trajectories.jsonl", Trajectory))
    # How many of batch 2's episodes were still to run when the engine died depends on how
    # long batch 1 took to grade; every one that ended after the death is a proxy_error (an
    # episode whose Turns were all written before it ran on the live engine).
    folder = tmp_path / "run" / "iter-002"
    late = [
        t
        for t in trajs
        if not any(p.stat().st_mtime <= closed[0] for p in folder.rglob(f"{t.trajectory_id}.jsonl"))
    ]
    assert all(t.status == "proxy_error" for t in late), [(t.status, t.evidence) for t in late]
