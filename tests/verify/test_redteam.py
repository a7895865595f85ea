"""The red-team suite: each known reward hack, attempted by a scripted agent through the real
rollout and verify machinery in real Docker sandboxes, must end with reward 0 (and its flag),
while the honest gold fix of the same task gets reward 1.

The agent is the built-in `mini` harness driven by the `forced` engine (a fake shipping in the
package: scripted completions, log-probs from a real forward pass of the tiny model). Runs with
`nox -s redteam` and in the normal suite. The README's table must equal the one this suite
generates (`python -m pytest tests/verify/test_redteam.py` rewrites `build/redteam.md`).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from pathlib import Path

import pytest

from legorl.engines import make_engine
from legorl.harnesses import MiniHarness
from legorl.protocols import Limits
from legorl.records import Task, Trajectory, read_jsonl
from legorl.rollout import Run, inprocess_proxy, run_one
from legorl.verify import VerifyConfig, grade
from legorl.verify.redteam import HACKS, Hack, honest, markdown_table

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "fixtures" / "tasks"
MODEL = ROOT / "fixtures" / "models" / "tiny-qwen3"
TASK_ID = "legorl-toy__geometry-1"
RESULTS: dict[str, dict] = {}


def _docker_backend():
    from legorl.sandbox import make_backend

    if shutil.which("docker") is None or os.system("docker info >/dev/null 2>&1") != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("the Docker daemon is not running (.ci/run starts it)")
        pytest.skip("no Docker daemon")
    return make_backend("docker")


def _task() -> Task:
    return next(t for t in read_jsonl(TASKS / "train.jsonl", Task) if t.instance_id == TASK_ID)


async def _attack(tmp: Path, script: list[dict], tag: str) -> Trajectory:
    backend = _docker_backend()
    task = _task()
    engine = make_engine("forced", model_path=str(MODEL), script=script)
    run_id = f"legorl-redteam-{uuid.uuid4().hex[:8]}"
    try:
        async with inprocess_proxy(MODEL, engine, tmp / "turns") as (endpoint, _core):
            traj = await run_one(
                Run(task=task, sample_index=0),
                harness=MiniHarness(max_turns=6),
                backend=backend,
                proxy=endpoint,
                tasks_dir=TASKS,
                model="tiny",
                timeout=120,
                limits=Limits(wall_s=300),
                run_id=run_id,
                refs_relative_to=tmp,
            )
    finally:
        await engine.close()
    assert traj.status == "ok", (tag, traj.evidence)
    from legorl.align import turns_of

    turns = list(turns_of(traj, tmp))
    return await grade(
        traj,
        task,
        backend=backend,
        tasks_dir=str(TASKS),
        run_id=run_id,
        turns=turns,
        config=VerifyConfig(test_timeout=30),
    )


def test_honest_gold_fix_is_rewarded(tmp_path: Path) -> None:
    graded = asyncio.run(_attack(tmp_path, honest(_task()), "honest"))
    assert graded.reward == 1.0, graded.verdict
    assert graded.hack_flags == []


@pytest.mark.parametrize("hack", HACKS, ids=[h.name for h in HACKS])
def test_hack_is_blocked(tmp_path: Path, hack: Hack) -> None:
    graded = asyncio.run(_attack(tmp_path, hack.script(_task()), hack.name))
    blocked = graded.reward == 0.0 and (hack.flag is None or hack.flag in graded.hack_flags)
    RESULTS[hack.name] = {
        "hack": hack.name,
        "defence": hack.defence,
        "reward": graded.reward,
        "flags": graded.hack_flags,
        "blocked": blocked,
    }
    assert graded.reward == 0.0, (hack.name, graded.verdict)
    if hack.flag is not None:
        assert hack.flag in graded.hack_flags, (hack.name, graded.hack_flags)


def test_readme_table_is_the_suites_output() -> None:
    if len(RESULTS) != len(HACKS):
        pytest.skip("run the whole suite to compare the table")
    table = markdown_table([RESULTS[h.name] for h in HACKS])
    out = ROOT / "build" / "redteam.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(table)
    assert table in (ROOT / "README.md").read_text(), f"README table differs; see {out}"
