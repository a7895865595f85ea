"""The control's decision rule, on scripted gradings (a grade function that returns what the
test says, standing in for ``grade()``; the real-Docker cases are in test_grading_faults.py):
a null or an exception the empty patch does not share is the patch's 0 with its flags kept,
a null the control shares stands, and one control serves every trajectory of a task."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from legorl.records import Task, Trajectory, Turn
from legorl.verify.control import FLAG, Controls, graded_or_control


def _task(image: str | None = None) -> Task:
    return Task(
        instance_id="x__y-1",
        repo="x/y",
        base_commit="0" * 40,
        problem_statement="",
        test_patch="",
        version="1.0",
        environment_setup_commit="0" * 40,
        FAIL_TO_PASS=["a"],
        PASS_TO_PASS=[],
        image=image,
    )


def _traj(tid: str, patch: str) -> Trajectory:
    return Trajectory(
        trajectory_id=tid,
        task_id="x__y-1",
        group_id="x__y-1",
        sample_index=0,
        harness="scripted",
        status="ok",
        patch=patch,
    )


class Scripted:
    """Grades by the patch's text: "null" -> reward None, "raise" -> MemoryError, else 0.0;
    the empty patch (the control) as ``control`` says. Counts the control's gradings."""

    def __init__(self, control: float | str | None) -> None:
        self.control = control
        self.controls = 0

    async def __call__(self, traj: Trajectory, turns: list[Turn]) -> Trajectory:
        await asyncio.sleep(0.01)
        outcome: float | str | None = 0.0
        if not traj.patch:
            self.controls += 1
            outcome = self.control
        elif "null" in traj.patch:
            outcome = None
        elif "raise" in traj.patch:
            outcome = "raise"
        if outcome == "raise":
            raise MemoryError("blew up")
        return replace(
            traj, reward=outcome, verdict={"reason": "restore failed"}, hack_flags=["own_flag"]
        )


def _run(trajs: list[Trajectory], grade: Scripted, task: Task | None = None) -> list[Trajectory]:
    async def go() -> list[Trajectory]:
        controls = Controls()
        jobs = [
            graded_or_control(t, task or _task(), turns=[], grade=grade, controls=controls)
            for t in trajs
        ]
        try:
            return list(await asyncio.gather(*jobs))
        finally:
            await controls.close()

    return asyncio.run(go())


def test_a_failure_the_control_does_not_share_is_zero() -> None:
    grade = Scripted(control=0.0)
    null, boom, fine = _run([_traj("n", "null"), _traj("b", "raise"), _traj("f", "ok")], grade)
    assert null.reward == 0.0 and FLAG in null.hack_flags and "own_flag" in null.hack_flags
    assert null.verdict["control"] == {"patch": "empty", "reward": 0.0, "reason": "restore failed"}
    assert null.verdict["reason"] == "grading failed where the empty patch grades: restore failed"
    assert boom.reward == 0.0 and FLAG in boom.hack_flags
    assert "MemoryError: blew up" in boom.verdict["reason"]
    assert fine.reward == 0.0 and FLAG not in fine.hack_flags and "control" not in fine.verdict
    assert grade.controls == 1  # one control for the task, shared by both failures


def test_a_failure_the_control_shares_stays_null() -> None:
    for control in (None, "raise"):
        (got,) = _run([_traj("n", "null")], Scripted(control=control))
        assert got.reward is None and FLAG not in got.hack_flags
        assert got.verdict["control"]["reward"] is None
        assert got.verdict["reason"].endswith("the control grading (empty patch) failed too")


def test_the_empty_patch_is_its_own_control_and_environments_get_their_own() -> None:
    grade = Scripted(control=None)
    (got,) = _run([_traj("e", "")], grade)
    assert got.reward is None and grade.controls == 1  # graded once, as itself
    grade = Scripted(control=0.0)

    async def two_images() -> None:
        controls = Controls()
        for image in ("img:a", "img:b", "img:a"):
            out = await graded_or_control(
                _traj("n", "null"), _task(image), turns=[], grade=grade, controls=controls
            )
            assert out.reward == 0.0
        await controls.close()

    asyncio.run(two_images())
    assert grade.controls == 2


def test_a_failed_control_is_run_again_for_a_later_failure() -> None:
    # Round 35: a control that failed while a neighbour exhausted the host was kept for the
    # batch, so every later null of the task stood. It now stands only for the trajectories
    # that waited on it; a later one gets a fresh control.
    class Recovering(Scripted):
        async def __call__(self, traj: Trajectory, turns: list[Turn]) -> Trajectory:
            if not traj.patch:
                self.control = None if self.controls == 0 else 0.0
            return await super().__call__(traj, turns)

    grade = Recovering(control=None)

    async def one_after_another() -> list[Trajectory]:
        controls = Controls()
        out = []
        for tid in ("first", "second", "third"):
            out.append(
                await graded_or_control(
                    _traj(tid, "null"), _task(), turns=[], grade=grade, controls=controls
                )
            )
        await controls.close()
        return out

    first, second, third = asyncio.run(one_after_another())
    assert first.reward is None and first.verdict["control"]["reward"] is None
    assert second.reward == 0.0 and FLAG in second.hack_flags
    assert third.reward == 0.0 and grade.controls == 2  # a control that graded is kept


def test_a_gold_record_is_not_reused_once_the_sandbox_code_changed(monkeypatch: Any) -> None:
    # Round 56: the gold record's key named the grader's files only. A record made where the
    # gold passed was reused after the local judged root had lost the time-zone files, so
    # every right patch got 0 there while the empty patch's control said the environment
    # worked. The sandbox code that decides what a graded run sees is in the key now.
    from pathlib import Path

    from legorl.verify import gold

    task = _task()
    before = gold.task_key(task, "local")
    real = Path.read_bytes

    def changed(path: Path) -> bytes:
        data = real(path)
        return data + b"\n# changed\n" if path.name == "memory_root.py" else data

    monkeypatch.setattr(Path, "read_bytes", changed)
    assert gold.task_key(task, "local") != before
