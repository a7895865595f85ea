"""Grading throughput on the toy set at concurrency 4, tasks per minute, in Docker, beside
concurrency 1 in the same run (`python -m legorl.bench --only verify`). Each task is graded on
its gold patch, so every grading runs the full test command. ``grading_time``: seconds per
grading against the grader of ``BASELINE`` (before assertions were judged out of process),
docker and local, side by side."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any


async def _grade_all(
    trajs: list[Any], tasks: dict[str, Any], tasks_dir: Path, concurrency: int
) -> tuple[float, int]:
    from legorl.sandbox import make_backend
    from legorl.verify import verify

    backend = make_backend("docker")
    start = time.perf_counter()
    resolved = 0
    async for graded in verify(
        trajs,
        tasks,
        backend=backend,
        tasks_dir=str(tasks_dir),
        run_id=f"legorl-bench-verify-{concurrency}",
        load_turns=lambda t: [],
        concurrency=concurrency,
    ):
        resolved += graded.reward == 1.0
    return time.perf_counter() - start, resolved


def bench_verify(quick: bool = False) -> dict[str, Any]:
    from legorl.records import Task, Trajectory, read_jsonl

    root = Path(__file__).resolve().parents[3]
    tasks_file = root / "fixtures" / "tasks" / "train.jsonl"
    tasks = list(read_jsonl(tasks_file, Task))[: 8 if quick else 24]
    trajs = [
        Trajectory(
            trajectory_id=f"{t.instance_id}.gold",
            task_id=t.instance_id,
            group_id=t.instance_id,
            sample_index=0,
            harness="gold",
            status="ok",
            patch=t.patch,
        )
        for t in tasks
    ]
    by_id = {t.instance_id: t for t in tasks}
    # Build the instance images first, so the figure is grading, not image building.
    asyncio.run(_grade_all(trajs, by_id, tasks_file.parent, 4))
    report: dict[str, Any] = {"tasks": len(trajs)}
    for c in (1, 4):
        seconds, resolved = asyncio.run(
            _grade_all([dataclasses.replace(t) for t in trajs], by_id, tasks_file.parent, c)
        )
        report[f"concurrency_{c}"] = {
            "seconds": round(seconds, 2),
            "resolved": resolved,
            "tasks_per_min": round(len(trajs) / seconds * 60, 1),
        }
    report["speedup_4_vs_1"] = round(
        report["concurrency_4"]["tasks_per_min"] / report["concurrency_1"]["tasks_per_min"], 2
    )
    report["grading_time"] = grading_ratio(quick)
    return report


#: The grader before assertions were judged out of process (one container, the independent
#: re-run and its twin): the "today" of the grading-time ratio.
BASELINE = "801b577"
_OLD_GRADER = """
import asyncio, json, sys, time
sys.path.insert(0, sys.argv[1] + "/src")
from pathlib import Path
from legorl.records import Task, Trajectory, from_dict
from legorl.sandbox import make_backend
from legorl.verify import VerifyConfig, grade

async def main():
    backend = make_backend(sys.argv[2])
    # The task fields the baseline's records know (later ones, e.g. uncoverable, left out).
    known = set(Task.__dataclass_fields__)
    rows = [json.loads(line) for line in open(sys.argv[3])][: int(sys.argv[4])]
    tasks = [from_dict({k: v for k, v in r.items() if k in known}, Task) for r in rows]
    times = []
    for rep in range(2):  # the first pass builds what it needs; the second is timed
        times = []
        for t in tasks:
            for patch in (t.patch, ""):
                traj = Trajectory(trajectory_id=t.instance_id + ".b", task_id=t.instance_id,
                    group_id=t.instance_id, sample_index=0, harness="gold", status="ok", patch=patch)
                start = time.perf_counter()
                await grade(traj, t, backend=backend, tasks_dir=str(Path(sys.argv[3]).parent),
                    run_id="legorl-bench-old", turns=[], config=VerifyConfig())
                times.append(time.perf_counter() - start)
    print(json.dumps(times))

asyncio.run(main())
"""


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


async def _new_times(
    backend_name: str, tasks: list[Any], tasks_dir: Path
) -> dict[str, list[float]]:
    from legorl.records import Trajectory
    from legorl.sandbox import make_backend
    from legorl.verify import VerifyConfig, grade

    backend = make_backend(backend_name)
    out: dict[str, list[float]] = {"first": [], "steady": []}
    import tempfile

    with tempfile.TemporaryDirectory(prefix="legorl-bench-gold-") as cache:
        config = VerifyConfig(gold_cache=Path(cache))
        for phase in ("first", "steady"):
            for t in tasks:
                for patch in (t.patch, ""):
                    traj = Trajectory(trajectory_id=t.instance_id + ".b", task_id=t.instance_id,
                        group_id=t.instance_id, sample_index=0, harness="gold", status="ok",
                        patch=patch)  # fmt: skip
                    start = time.perf_counter()
                    await grade(traj, t, backend=backend, tasks_dir=str(tasks_dir),
                        run_id="legorl-bench-new", turns=[], config=config)  # fmt: skip
                    out[phase].append(time.perf_counter() - start)
    return out


def grading_ratio(quick: bool = False) -> dict[str, Any]:
    """Seconds per grading (gold and empty patch of each task, one at a time), this grader
    against the baseline commit's, both backends, in one run. ``first``: the new grader's
    first grading of a task, which records the task's gold record (two more judged runs);
    ``steady``: every later grading of it. The baseline runs from a git worktree of
    ``BASELINE`` in a subprocess."""
    import subprocess
    import tempfile

    from legorl.records import Task, read_jsonl

    root = Path(__file__).resolve().parents[3]
    tasks_file = root / "fixtures" / "tasks" / "train.jsonl"
    count = 2 if quick else 6
    tasks = list(read_jsonl(tasks_file, Task))[:count]
    report: dict[str, Any] = {
        "tasks": count,
        "baseline": BASELINE,
        "target_steady_over_baseline": 1.5,
    }
    with tempfile.TemporaryDirectory(prefix="legorl-bench-old-") as tmp:
        made = subprocess.run(
            ["git", "-C", str(root), "worktree", "add", "-q", "--detach", f"{tmp}/old", BASELINE],
            capture_output=True, text=True,
        )  # fmt: skip
        if made.returncode != 0:
            return {"skipped": f"no baseline commit {BASELINE} here: {made.stderr.strip()[-200:]}"}
        try:
            for backend in ("docker", "local"):
                old = subprocess.run(
                    [sys.executable, "-c", _OLD_GRADER, f"{tmp}/old", backend, str(tasks_file), str(count)],
                    capture_output=True, text=True, timeout=3600,
                )  # fmt: skip
                if old.returncode != 0:
                    report[backend] = {"error": old.stderr.strip()[-400:]}
                    continue
                old_times = json.loads(old.stdout.strip().splitlines()[-1])
                new = asyncio.run(_new_times(backend, tasks, tasks_file.parent))
                report[backend] = {
                    "baseline_s": round(_median(old_times), 3),
                    "first_s": round(_median(new["first"]), 3),
                    "steady_s": round(_median(new["steady"]), 3),
                    "first_over_baseline": round(_median(new["first"]) / _median(old_times), 2),
                    "steady_over_baseline": round(_median(new["steady"]) / _median(old_times), 2),
                }
        finally:
            subprocess.run(
                ["git", "-C", str(root), "worktree", "remove", "--force", f"{tmp}/old"],
                capture_output=True,
            )
    return report
