"""A grading failure the patch can cause is the patch's failure: a null reward ("no signal")
only when a control grading in the same environment fails too. Used by ``verify()``:

    controls = Controls()
    graded = await graded_or_control(traj, task, turns=turns, grade=one_grading, controls=controls)

When grading a trajectory gives reward null (or raises), the task is graded once more with
the empty patch, the cheapest control, in the same backend and environment. If that control
grades (reward 0.0 or 1.0), the environment works and the candidate's failure was its patch's
doing: reward 0.0, its flags kept, plus ``grading_failed`` and the reason. Only when the control
fails as well does the null stand. One control per task and environment per batch, shared by
every trajectory that needs it while it runs and after it grades; one that failed is run again
for a trajectory that needs it later. Trajectories whose own status is an environment failure
never reach this (``verify()`` passes them through).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from legorl.records import Task, Trajectory, Turn

FLAG = "grading_failed"
#: The control's patch: nothing changed, so whatever it does is the environment's own.
CONTROL_PATCH = ""

#: One grading of a trajectory with the turns its flags are read from.
Grade = Callable[[Trajectory, list[Turn]], Awaitable[Trajectory]]


def environment_key(task: Task) -> tuple[str, str, str]:
    """What makes two gradings of a task run in the same environment."""
    return task.instance_id, task.image or "", repr(task.env)


@dataclass(slots=True)
class Controls:
    """The control gradings of one batch: one per task and environment, run at most once
    even when several trajectories ask for it at the same time."""

    runs: dict[tuple[str, str, str], asyncio.Task[Trajectory]] = field(default_factory=dict)

    async def outcome(self, traj: Trajectory, task: Task, grade: Grade) -> Trajectory:
        """The task's control grading: the one running or passed, shared; a control that
        failed stands only for the trajectories that waited on it (its failure's window), and a
        later one gets a fresh control (round 35: a failure a neighbour caused for a while,
        kept for the batch, let every later null of the task stand)."""
        key = environment_key(task)
        run = self.runs.get(key)
        if run is not None and run.done() and _failed(run):
            run = None
        if run is None:
            control = replace(
                traj,
                trajectory_id=f"{traj.trajectory_id}.control",
                patch=CONTROL_PATCH,
                reward=None,
                verdict={},
                hack_flags=[],
            )
            run = self.runs[key] = asyncio.ensure_future(_guarded(control, [], grade))
        return await asyncio.shield(run)

    async def close(self) -> None:
        """Stop the controls still running (the batch is over or was abandoned)."""
        for run in self.runs.values():
            run.cancel()
        await asyncio.gather(*self.runs.values(), return_exceptions=True)


def _failed(run: asyncio.Task[Trajectory]) -> bool:
    return run.cancelled() or run.exception() is not None or run.result().reward is None


async def _guarded(traj: Trajectory, turns: list[Turn], grade: Grade) -> Trajectory:
    """One grading whose exception becomes its null reward, with the reason."""
    try:
        return await grade(traj, turns)
    except Exception as exc:  # any failure of grading itself, MemoryError included
        return failed(traj, exc)


def failed(traj: Trajectory, exc: BaseException) -> Trajectory:
    """A trajectory whose grading raised: reward null, the exception as the reason."""
    why = f"grading raised {type(exc).__name__}: {str(exc)[:300]}"
    return replace(traj, reward=None, verdict={"resolved": None, "reason": why})


def _summary(control: Trajectory) -> dict[str, Any]:
    verdict = control.verdict or {}
    out: dict[str, Any] = {"patch": "empty", "reward": control.reward}
    if verdict.get("reason"):
        out["reason"] = verdict["reason"]
    return out


async def graded_or_control(
    traj: Trajectory, task: Task, *, turns: list[Turn], grade: Grade, controls: Controls
) -> Trajectory:
    """``grade(traj, turns)``, with a null reward or an exception decided by the control."""
    got = await _guarded(traj, turns, grade)
    if got.reward is not None:
        return got
    verdict = dict(got.verdict or {})
    own = str(verdict.get("reason") or "grading gave no verdict")
    if not traj.patch.strip():
        # The empty patch is its own control: its failure is the environment's.
        return got
    control = await controls.outcome(traj, task, grade)
    verdict["control"] = _summary(control)
    if control.reward is None:
        verdict["reason"] = f"{own}; the control grading (empty patch) failed too"
        return replace(got, verdict=verdict)
    verdict.update(resolved=False, reason=f"grading failed where the empty patch grades: {own}")
    return replace(got, reward=0.0, verdict=verdict, hack_flags=sorted({*got.hack_flags, FLAG}))
