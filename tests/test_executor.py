"""The executor interface: work described as plain data (it survives pickling, as it must to
reach another machine), and the in-process executor running two rollout works at once on one
proxy, each work's Turns in its own folder, then grading them.

Real parts: the embedded engine serving the random tiny model, the built-in `mini` agent in
`local` (bubblewrap) sandboxes, grading in fresh sandboxes.
"""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path

from conftest import ROOT

from legorl.executors import InProcessExecutor
from legorl.protocols import Executor, GradeWork, RolloutWork
from legorl.records import ENVIRONMENT_FAILURES, Trajectory, Turn, read_jsonl
from legorl.rollout import EngineSpec, Run, plan_runs, serve_engine
from legorl.tasks import load_tasks

TASKS = ROOT / "fixtures" / "tasks"
MODEL = ROOT / "fixtures" / "models" / "tiny-qwen3"


def _work(runs: list[Run], folder: Path) -> RolloutWork:
    return RolloutWork(
        runs=runs,
        harness="mini",
        harness_options={"max_turns": 1, "max_tokens": 8, "seed": 3},
        sandbox="local",
        model="tiny",
        tasks_dir=str(TASKS),
        folder=str(folder),
        timeout=60.0,
        concurrency=2,
        run_id="legorl-test-executor",
    )


def test_work_is_plain_data_that_survives_pickling(tmp_path: Path) -> None:
    task = load_tasks(TASKS / "train.jsonl")[0]
    work = _work(plan_runs([task], 2, None, set(), prefix="p-"), tmp_path)
    back = pickle.loads(pickle.dumps(work))
    assert back == work and back.runs[1].trajectory_id == f"p-{task.instance_id}.1"
    grade = GradeWork(
        trajectories=[], tasks=[task], tasks_dir=str(TASKS), folder=str(tmp_path), run_id="x"
    )
    assert pickle.loads(pickle.dumps(grade)) == grade


def test_two_works_at_once_keep_their_turns_apart_and_grade(tmp_path: Path) -> None:
    tasks = load_tasks(TASKS / "train.jsonl")[:2]

    async def main() -> tuple[dict[str, list[Trajectory]], list[Trajectory]]:
        engine = EngineSpec(
            name="embedded", weights=MODEL, options={"device": "cpu"}, log_dir=tmp_path
        )
        async with serve_engine(MODEL, engine, tmp_path / "core-turns") as (endpoint, core):
            executor = InProcessExecutor(core, endpoint.url)
            assert isinstance(executor, Executor)
            await executor.prepare("local", {}, tasks)
            works = {
                name: _work(plan_runs([task], 2, None, set(), prefix=f"{name}-"), tmp_path / name)
                for name, task in zip(("a", "b"), tasks, strict=True)
            }

            async def collect(work: RolloutWork) -> list[Trajectory]:
                return [t async for t in executor.rollout(work)]

            got = await asyncio.gather(*(collect(w) for w in works.values()))
            by_work = dict(zip(works, got, strict=True))
            grade = GradeWork(
                trajectories=by_work["a"],
                tasks=tasks,
                tasks_dir=str(TASKS),
                folder=str(tmp_path / "a"),
                concurrency=2,
                run_id="legorl-test-executor-grade",
            )
            graded = [g async for g in executor.grade(grade)]
            await executor.close()
            return by_work, graded

    by_work, graded = asyncio.run(main())
    for name, trajs in by_work.items():
        assert len(trajs) == 2 and all(t.trajectory_id.startswith(f"{name}-") for t in trajs)
        for t in trajs:
            assert t.status not in ENVIRONMENT_FAILURES, t.evidence
            assert t.turns_ref == [f"turns/{t.trajectory_id}.jsonl"]
            assert (tmp_path / name / "turns" / f"{t.trajectory_id}.jsonl").is_file()
        # no Turn of one work landed in the other's folder, nor in the core's own
        other = tmp_path / ("b" if name == "a" else "a") / "turns"
        assert not any((other / f"{t.trajectory_id}.jsonl").exists() for t in trajs)
    assert not list((tmp_path / "core-turns").glob("*.jsonl"))
    assert [g.trajectory_id for g in graded] == [t.trajectory_id for t in by_work["a"]]
    assert all(g.verdict is not None for g in graded)
    for t in by_work["a"]:
        if t.turns_ref:  # every run has them (checked above)
            turns = list(read_jsonl(tmp_path / "a" / t.turns_ref[0], Turn))
            assert turns and all(turn.session == t.trajectory_id for turn in turns)
