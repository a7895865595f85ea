"""The LoRA demo experiment (issue 36): `legorl loop --lora` against the start policy at its best
sampling temperature, on the same held-out runs.

    python -m experiments.lora_demo all --root runs/lora-demo      # everything, one run at a time
    python -m experiments.lora_demo report --root runs/lora-demo   # the table, from the run folders

``all`` runs, each under the machine's shared lock (``flock /tmp/legorl-heavy.lock``):

1. the baseline: the start policy's held-out evaluation at T in {0.3, 0.5, 0.7} for every seed
   (``baseline``: the loop's own evaluation, the same seeded runs as a loop's "before"; T = 1.0
   is each LoRA loop's own evaluation before its first iteration);
2. the sweep at seed 0: one ``legorl loop --lora`` per point of ``SWEEP`` (rank, targets, lr);
3. the better of the sweep's first two points (held-out success after), at seeds 1 and 2,
   before the sweep's other points.

The budget per loop is ``BUDGET`` (fewer iterations and held-out samples than the demo's
defaults: the machine is shared by several engineers; say so wherever the figures go).
A finished run is not run again (the loop continues a folder; the baseline keeps its state).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

LOCK = "/tmp/legorl-heavy.lock"
SEEDS = (0, 1, 2)
#: and 1.0: each loop's own "before"; 0.1 and 0.2 below the issue's grid (colder is better here)
TEMPERATURES = (0.1, 0.2, 0.3, 0.5, 0.7)
#: Per loop: the demo's tasks, fewer iterations and held-out samples than its defaults.
BUDGET = ["--iterations", "6", "--eval-samples", "2"]
#: name -> the loop's LoRA options (the temperature factor stays frozen under --lora).
SWEEP: dict[str, list[str]] = {
    "r8-all-lr3e-3": ["--lr", "3e-3", "lora_rank=8"],
    "r8-all-lr1e-3": ["--lr", "1e-3", "lora_rank=8"],
    "r8-all-lr3e-4": ["--lr", "3e-4", "lora_rank=8"],
    "r1-all-lr1e-3": ["--lr", "1e-3", "lora_rank=1", "lora_alpha=4"],
}


def loop_command(out: Path, seed: int, options: list[str]) -> list[str]:
    legorl = str(Path(sys.executable).with_name("legorl"))
    return [legorl, "loop", "--lora", "--seed", str(seed), "--out", str(out), *BUDGET, *options]


def baseline(
    out: Path, seed: int, temperature: float, eval_samples: int, model: Path | None = None
) -> dict[str, Any]:
    """The start policy's held-out evaluation at ``temperature``: the loop's runner with no
    training iteration (the same seeded runs, harness and grading as a loop's "before").
    ``model``: another policy evaluated the same way (a LoRA checkpoint: its base with the
    adapter merged, written to ``out/model`` first)."""
    from legorl.loop import LoopConfig
    from legorl.loop.runner import Runner, load_splits
    from legorl.loop.state import STATE_FILE, LoopState

    class EvalOnly(Runner):
        async def train_iterations(self) -> None:  # the evaluation before, nothing after
            return None

    extra: dict[str, Any] = {}
    if model is not None:
        extra["model"] = _merged(model, out / "model")
    config = LoopConfig(
        out=out,
        seed=seed,
        temperature=temperature,
        eval_samples=eval_samples,
        iterations=1,
        **extra,
    )
    config.validate()
    state_path = out / STATE_FILE
    state = LoopState.load(state_path) if state_path.is_file() else LoopState(config={})
    state.config = config.to_dict()
    if state.eval_at(0) is None:
        out.mkdir(parents=True, exist_ok=True)
        runner = EvalOnly(config, state, load_splits(config), print, None)
        asyncio.run(runner.run())
    before = state.eval_at(0)
    assert before is not None
    return {"success": before.success, "graded": before.graded, "seconds": before.seconds}


def _merged(checkpoint: Path, out: Path) -> Path:
    """A full-weights folder of ``checkpoint`` (a LoRA adapter's base with it merged)."""
    from legorl.engines.models import load_model, load_tokenizer

    if not (out / "config.json").is_file():
        load_model(checkpoint).save_pretrained(out)
        load_tokenizer(checkpoint).save_pretrained(out)
    return out


def _held_out(out: Path) -> tuple[float | None, float | None, float]:
    """(before, after, whole-loop seconds) of a loop folder."""
    data = json.loads((out / "state.json").read_text())
    evals = {e["step"]: e for e in data["evals"]}

    def success(e: dict[str, Any] | None) -> float | None:
        return e["solved"] / e["graded"] if e and e["graded"] else None

    after = evals.get(data["finished"]) if data["finished"] else None
    return success(evals.get(0)), success(after), float(data["seconds"])


def _locked(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(["flock", LOCK, *cmd], check=True)


def run_all(root: Path) -> None:
    """The baseline at seed 0, the sweep's first two points, the better one at seeds 1 and 2
    with their baselines, then the sweep's other points (the machine is shared: what finishes
    first is what decides the most)."""
    me = [sys.executable, "-m", "experiments.lora_demo"]
    samples = BUDGET[BUDGET.index("--eval-samples") + 1]

    def base(seed: int) -> None:
        for t in TEMPERATURES:
            out = root / f"base-s{seed}-t{t}"
            _locked([*me, "baseline", "--seed", str(seed), "--temperature", str(t),
                     "--eval-samples", samples, "--out", str(out)])  # fmt: skip

    names = list(SWEEP)
    base(0)
    for name in names[:2]:
        _locked(loop_command(root / f"{name}-s0", 0, SWEEP[name]))
    best = max(names[:2], key=lambda n: _held_out(root / f"{n}-s0")[1] or 0.0)
    print(f"chosen: {best}", flush=True)
    (root / "chosen.txt").write_text(best + "\n")
    for seed in SEEDS[1:]:
        _locked(loop_command(root / f"{best}-s{seed}", seed, SWEEP[best]))
        base(seed)
    for name in names[2:]:
        _locked(loop_command(root / f"{name}-s0", 0, SWEEP[name]))
    report(root)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def report(root: Path) -> None:
    print("| sweep point (seed 0) | held-out before → after | whole loop |")
    print("|---|---|---|")
    for name in SWEEP:
        if (root / f"{name}-s0" / "state.json").is_file():
            b, a, s = _held_out(root / f"{name}-s0")
            print(f"| {name} | {_pct(b)} → {_pct(a)} | {s / 60:.1f} min |")
    chosen = root / "chosen.txt"
    if not chosen.is_file():
        return
    best = chosen.read_text().strip()
    print(f"\nchosen: {best}\n")
    print("| seed | T=1 (before) | best T | best-T baseline | LoRA after | vs T=1 | vs best T |")
    print("|---|---|---|---|---|---|---|")
    gains_1, gains_t = [], []
    for seed in SEEDS:
        folder = root / f"{best}-s{seed}"
        if not (folder / "state.json").is_file():
            continue
        b, a, _s = _held_out(folder)
        temps: dict[float, float | None] = {1.0: b}
        for t in TEMPERATURES:
            state = root / f"base-s{seed}-t{t}" / "state.json"
            if state.is_file():
                temps[t] = _held_out(state.parent)[0]
        best_t = max(temps, key=lambda t: temps[t] or 0.0)
        if a is None or b is None:
            continue
        bt = temps[best_t] or 0.0
        gains_1.append(a - b)
        gains_t.append(a - bt)
        print(
            f"| {seed} | {_pct(b)} | {best_t} | {_pct(bt)} | {_pct(a)} | "
            f"{100 * (a - b):+.1f} | {100 * (a - bt):+.1f} |"
        )
    if gains_1:
        print(
            f"\nmedian over {len(gains_1)} seed(s): {100 * statistics.median(gains_1):+.1f} points "
            f"over T=1, {100 * statistics.median(gains_t):+.1f} over the best-T baseline"
        )
    for seed in SEEDS:
        row = []
        for t in TEMPERATURES:
            state = root / f"base-s{seed}-t{t}" / "state.json"
            if state.is_file():
                row.append(f"T={t}: {_pct(_held_out(state.parent)[0])}")
        if row:
            print(f"baseline seed {seed}: " + ", ".join(row))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("all")
    p.add_argument("--root", type=Path, default=Path("runs/lora-demo"))
    p = sub.add_parser("report")
    p.add_argument("--root", type=Path, default=Path("runs/lora-demo"))
    p = sub.add_parser("baseline")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, required=True)
    p.add_argument("--eval-samples", type=int, default=4)
    p.add_argument("--model", type=Path, help="another policy (a LoRA checkpoint is merged)")
    args = parser.parse_args(argv)
    if args.what == "all":
        run_all(args.root)
    elif args.what == "report":
        report(args.root)
    else:
        found = baseline(args.out, args.seed, args.temperature, args.eval_samples, args.model)
        print(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
