"""The gold record of every task of the shipped suites: whether the gold patch passes under the
out-of-process judge, which required tests no assertion of which is judged out of process
(against what each task declares ``uncoverable``), the share of ``FAIL_TO_PASS`` assertion
events the judge makes itself, and which required tests the gold patch's ordinary run was not
read passing (no ordinary run of a candidate can then fail them).

    python -m experiments.gold_coverage                     # the three suites, docker
    python -m experiments.gold_coverage --backend local --tasks fixtures/tasks/train.jsonl

Prints one JSON line a task, then one a suite; docs/integrity.md has the latest figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from legorl.records import Task, read_jsonl
from legorl.sandbox import make_backend
from legorl.verify import VerifyConfig, assertions, gold_record, rewrite
from legorl.verify.runner import framing
from legorl.verify.specs import resolve

ROOT = Path(__file__).resolve().parents[1]
SUITES = [
    ROOT / "fixtures" / "tasks" / "train.jsonl",
    ROOT / "fixtures" / "tasks" / "heldout.jsonl",
    ROOT / "fixtures" / "tasks-real" / "tasks.jsonl",
]


def _counts(task: Task, plan: rewrite.Plan, gold: assertions.Gold, tests: list[str]) -> list[int]:
    """[events judged out of process, all events] of ``tests`` in the gold record."""
    out = [0, 0]
    for test in tests:
        for event in gold.runs[-1].get(plan.keys.get(test, ""), assertions.TestEvents()).events:
            site = plan.sites.get(event.site)
            out[1] += 1
            out[0] += bool(event.ok is None and site and site.counted and site.mode == "judge")
    return out


async def scan(path: Path, backend_name: str, cache: Path) -> list[dict[str, Any]]:
    tasks = list(read_jsonl(path, Task))
    backend = make_backend(backend_name)
    config = VerifyConfig(gold_cache=cache)
    gate = asyncio.Semaphore(2)
    rows: list[dict[str, Any]] = []

    async def one(task: Task) -> None:
        async with gate:
            start = time.monotonic()
            grader = resolve(task)
            record = await gold_record(
                task,
                backend=backend,
                tasks_dir=str(path.parent),
                run_id="legorl-gold-coverage",
                config=config,
                runner_paths=grader.runner_paths(),
            )
            row: dict[str, Any] = {"id": task.instance_id, "ok": record.ok, "reason": record.reason}
            if record.ok:
                required = task.FAIL_TO_PASS + task.PASS_TO_PASS
                plan = rewrite.plan_files(
                    required, record.sources, **framing(grader), inproc=set(record.inproc)
                )
                gold = record.gold()
                covered = assertions.covered_tests(
                    plan, gold, set(task.FAIL_TO_PASS), public=task.problem_statement
                )
                row["uncovered"] = sorted(t for t, c in covered.items() if not c)
                row["undeclared"] = sorted(set(row["uncovered"]) - set(task.uncoverable))
                row["f2p"] = _counts(task, plan, gold, task.FAIL_TO_PASS)
                row["p2p"] = _counts(task, plan, gold, task.PASS_TO_PASS)
                # Required tests the gold patch's ordinary run was not read passing: a
                # candidate's ordinary run cannot take their pass away (round 47).
                row["ordinary_unread"] = sorted(set(required) - set(record.ordinary))
                row["ordinary_exit"] = record.ordinary_exit  # 0: a candidate's must be 0 too
            row["seconds"] = round(time.monotonic() - start, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)

    await asyncio.gather(*(one(t) for t in tasks))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=Path, action="append", help="task files (default: all)")
    parser.add_argument("--backend", default="docker")
    parser.add_argument(
        "--cache", type=Path, help="keep the gold records here (default: fresh ones, thrown away)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="legorl-gold-") as fresh:
        cache = args.cache or Path(fresh)
        for path in args.tasks or SUITES:
            rows = asyncio.run(scan(path, args.backend, cache))
            good = [r for r in rows if r["ok"]]
            f2p = [sum(r["f2p"][i] for r in good) for i in (0, 1)]
            summary = {
                "suite": str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path),
                "tasks": len(rows),
                "gold_passes": len(good),
                "undeclared_uncovered": sum(len(r["undeclared"]) for r in good),
                "ordinary_unread": sum(len(r["ordinary_unread"]) for r in good),
                "f2p_judged_out_of_process": f2p,
                "f2p_fraction": round(f2p[0] / f2p[1], 3) if f2p[1] else None,
            }
            print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
