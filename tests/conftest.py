"""Shared test helpers: the repository root, the docker backend, a scripted run graded, and one
valid record of each type."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from legorl.records import (
    Alert,
    EnvRecipe,
    Metric,
    Sample,
    Task,
    TokenCounts,
    ToolCall,
    TrainerLogprobs,
    Trajectory,
    Turn,
    TurnFlags,
    TurnOutput,
    read_jsonl,
)

ROOT = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI") == "true"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under `pytest -n N --dist loadgroup` (what `nox -s tests` runs), a test module's tests
    stay on one worker, so its module fixtures (a vLLM server, a captured rollout) are built
    once. A module that must not run beside another of its kind names a shared group instead
    (``pytestmark = pytest.mark.xdist_group("vllm")``: the tests that count every vLLM process
    on the host run one after another). tests/test_xdist_groups.py checks that xdist honours
    the groups."""
    for item in items:
        if not any(True for _ in item.iter_markers("xdist_group")):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def sandbox_backend(name: str = "docker"):
    """The ``docker`` or ``local`` (bubblewrap) sandbox backend; skips where it cannot run here,
    fails under CI (which installs and starts both)."""
    import shutil

    from legorl.sandbox import make_backend

    if name == "docker":
        if shutil.which("docker") is None or os.system("docker info >/dev/null 2>&1") != 0:
            if IN_CI:
                pytest.fail("the Docker daemon is not running (.ci/run starts it)")
            pytest.skip("no Docker daemon")
    elif shutil.which("bwrap") is None:
        if IN_CI:
            pytest.fail("bubblewrap is not installed (.ci/run installs it)")
        pytest.skip("no bubblewrap")
    return make_backend(name)


def docker_backend():
    """The docker sandbox backend; skips without a daemon, fails under CI."""
    return sandbox_backend("docker")


async def run_task(
    task: Task,
    harness: Any,
    backend: Any,
    proxy: Any,
    *,
    refs: Path,
    tasks_dir: Path = ROOT / "fixtures" / "tasks",
    model: str = "tiny",
    timeout: float = 120.0,
    wall_s: float = 300.0,
    run_id: str = "",
) -> Trajectory:
    """One run of ``harness`` on ``task`` in ``backend``'s sandbox through ``proxy`` (a
    ``rollout.ProxyEndpoint``), by ``rollout.run_one``; turns_ref relative to ``refs``."""
    from legorl.protocols import Limits
    from legorl.rollout import Run, RunContext, run_one

    ctx = RunContext(
        harness=harness,
        backend=backend,
        limits=Limits(wall_s=wall_s),
        proxy=proxy,
        refs_relative_to=refs,
        run_id=run_id or f"legorl-test-{uuid.uuid4().hex[:8]}",
        model=model,
        tasks_dir=tasks_dir,
        timeout=timeout,
    )
    return await run_one(Run(task=task, sample_index=0), ctx)


def scripted_run(task: Task, patch: str, trajectory_id: str = "") -> Trajectory:
    """An ``ok`` run of the scripted harness that left ``patch`` on ``task`` (a fresh id unless
    given: runs of one task graded at once must not share one)."""
    return Trajectory(
        trajectory_id=trajectory_id or f"{task.instance_id}.{uuid.uuid4().hex[:6]}",
        task_id=task.instance_id,
        group_id=task.instance_id,
        sample_index=0,
        harness="scripted",
        status="ok",
        patch=patch,
    )


async def grade_patch(
    task: Task,
    patch: str,
    *,
    backend: Any,
    tasks_dir: str | Path,
    config: Any = None,
    run_id: str = "",
    trajectory_id: str = "",
) -> Trajectory:
    """``patch`` graded on ``task`` by ``verify.grade``, as the scripted run that wrote it (no
    turns); ``config`` a ``VerifyConfig`` (default: the defaults)."""
    from legorl.verify import VerifyConfig, grade

    return await grade(
        scripted_run(task, patch, trajectory_id),
        task,
        backend=backend,
        tasks_dir=str(tasks_dir),
        run_id=run_id or f"legorl-test-{uuid.uuid4().hex[:8]}",
        turns=[],
        config=config or VerifyConfig(),
    )


#: The toy tasks and the one the grading tests attack.
TOY_TASKS = ROOT / "fixtures" / "tasks"
TOY_TASK_ID = "legorl-toy__geometry-1"


def toy_task(task_id: str = TOY_TASK_ID) -> Task:
    return next(t for t in read_jsonl(TOY_TASKS / "train.jsonl", Task) if t.instance_id == task_id)


def grade_toy(
    patch: str,
    *,
    backend: str = "docker",
    off: frozenset[str] = frozenset(),
    task: Task | None = None,
) -> Trajectory:
    """``patch`` graded on a toy task (default: ``TOY_TASK_ID``) with the named defences off,
    in the named backend's sandboxes."""
    from legorl.verify import VerifyConfig

    graded = grade_patch(
        task or toy_task(),
        patch,
        backend=sandbox_backend(backend),
        tasks_dir=TOY_TASKS,
        config=VerifyConfig(defences_off=off),
    )
    return asyncio.run(graded)


def example_records() -> list:
    """One record of every type, with nested parts filled in."""
    turn0 = Turn(
        session="traj-1",
        turn=0,
        segment=0,
        segment_reason="start",
        api="openai_chat",
        model="tiny-qwen3",
        requested_model="gpt-5",
        prompt_offset=0,
        prompt_delta=[1, 2, 3, 4],
        completion_ids=[5, 6, 7],
        completion_logprobs=[-0.25, -1.5, -0.0625],
        finish_reason="tool_calls",
        output=TurnOutput(
            text="",
            thinking="look first",
            tool_calls=[ToolCall(id="call_1", name="bash", arguments='{"command":"ls"}')],
        ),
        timings={"queue_s": 0.001, "generate_s": 0.5},
        time=1764500000.0,
    )
    turn1 = Turn(
        session="traj-1",
        turn=1,
        segment=0,
        api="openai_chat",
        model="tiny-qwen3",
        prompt_offset=7,
        prompt_delta=[8, 9],
        completion_ids=[10],
        completion_logprobs=[-3.0],
        finish_reason="stop",
        flags=TurnFlags(realigned=1),
    )
    return [
        Task(
            instance_id="legorl-toy__geometry-1",
            repo="legorl-toy/geometry",
            base_commit="0" * 40,
            problem_statement="area is wrong",
            test_patch="diff --git a/tests/t.py b/tests/t.py\n",
            FAIL_TO_PASS=["tests/t.py::test_area"],
            PASS_TO_PASS=["tests/t.py::test_perimeter"],
            version="0.1",
            environment_setup_commit="0" * 40,
            env=EnvRecipe(packages=["pytest"]),
            meta={"family": "off_by_one"},
        ),
        turn0,
        turn1,
        Trajectory(
            trajectory_id="traj-1",
            task_id="legorl-toy__geometry-1",
            group_id="legorl-toy__geometry-1",
            sample_index=0,
            harness="mini",
            status="ok",
            patch="diff --git a/g.py b/g.py\n",
            turns=[turn0, turn1],
            tokens=TokenCounts(prompt=6, completion=4),
            reward=1.0,
            verdict={"resolved": True},
        ),
        Sample(
            sample_id="traj-1/0",
            episode_id="traj-1",
            group_id="legorl-toy__geometry-1",
            segment_index=0,
            segment_count=1,
            input_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
            loss_mask=[0, 0, 0, 0, 1, 1, 1, 0, 0, 1],
            rollout_logprobs=[-0.25, -1.5, -0.0625, -3.0],
            reward=1.0,
        ),
        Metric(step=3, name="rollout_trainer_pearson", value=0.9993),
        Alert(
            kind="correlation",
            message="rollout/trainer probability correlation 0.9700 < 0.99",
            step=3,
            value=0.97,
            threshold=0.99,
            time=1.5,
        ),
        TrainerLogprobs(sample_id="traj-1/0", logprobs=[-0.25, -1.5, -0.125, -3.0], step=3),
    ]


@pytest.fixture
def records() -> list:
    return example_records()
