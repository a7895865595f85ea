"""Align cost and storage, measured side by side in one run (`python -m legorl.bench --only align`).

Sessions are synthetic but shaped like agent runs: a long first prompt (system prompt + tool
schemas), then every turn adds a fixed-size prompt delta (tool result + template glue) and a
fixed-size completion, all in one segment, stored as the proxy stores them (a turns file of
deltas, referenced by the trajectory). Each pass runs the stage as `legorl align` does: read the
trajectory file, read its turns, merge, write the samples.

* time: a 200-turn session against a 100-turn session of the same turn size (target <= 2.3;
  linear is 2, quadratic 4), beside a baseline that rebuilds every turn's full prompt
  (``segment_prompts``) and compares it with the previous prompt + completion to merge;
* storage: bytes of turns + samples per trained token at several session lengths (it must not
  grow with the number of turns), beside the per-turn baseline that stores one full-prompt
  sample per turn.
"""

from __future__ import annotations

import gc
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from legorl.records import (
    JsonlWriter,
    Sample,
    Trajectory,
    Turn,
    read_jsonl,
    segment_prompts,
    write_jsonl,
)


def _session(turns: int, first: int, delta: int, completion: int, seed: int) -> list[Turn]:
    rng = random.Random(seed)
    out, held = [], 0
    for n in range(turns):
        prompt = [rng.randrange(10, 3000) for _ in range(first if n == 0 else delta)]
        comp = [rng.randrange(10, 3000) for _ in range(completion)]
        out.append(
            Turn(
                session="bench",
                turn=n,
                segment=0,
                segment_reason="start" if n == 0 else None,
                api="openai_chat",
                model="bench",
                prompt_offset=held,
                prompt_delta=prompt,
                completion_ids=comp,
                completion_logprobs=[-rng.expovariate(1.0) for _ in comp],
                finish_reason="tool_calls",
            )
        )
        held += len(prompt) + len(comp)
    return out


def _write_episode(folder: Path, turns: list[Turn]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(folder / "turns.jsonl", turns)
    traj = Trajectory(
        trajectory_id="bench",
        task_id="bench",
        group_id="bench",
        sample_index=0,
        harness="bench",
        status="ok",
        turns_ref=["turns.jsonl"],
        reward=1.0,
    )
    path = folder / "graded.jsonl"
    write_jsonl(path, [traj])
    return path


def _align_file(path: Path, out: Path) -> int:
    from legorl.align import align

    out.unlink(missing_ok=True)
    with JsonlWriter(out) as writer:
        return writer.write_many(align(read_jsonl(path, Trajectory), base_dir=path.parent))


def _per_turn_samples(traj: Trajectory, base: Path) -> Iterator[Sample]:
    """The baseline: every turn's full prompt rebuilt and compared with the previous sequence;
    merged while it extends (the same samples as align), at a cost quadratic in turns."""
    turns = list(read_jsonl(base / (traj.turns_ref or [])[0], Turn))
    prev: list[int] = []
    ids: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    for turn, prompt in segment_prompts(turns):
        if prompt[: len(prev)] != prev:
            raise AssertionError("bench sessions always extend")
        ids = list(prompt)
        mask = mask + [0] * (len(prompt) - len(mask))
        ids += turn.completion_ids
        mask += [1] * len(turn.completion_ids)
        lps = lps + turn.completion_logprobs
        prev = ids
    yield Sample(
        sample_id="bench/0",
        episode_id="bench",
        group_id="bench",
        segment_index=0,
        segment_count=1,
        input_ids=ids,
        loss_mask=mask,
        rollout_logprobs=lps,
        reward=1.0,
    )


def _baseline_file(path: Path, out: Path) -> int:
    out.unlink(missing_ok=True)
    with JsonlWriter(out) as writer:
        n = 0
        for traj in read_jsonl(path, Trajectory):
            n += writer.write_many(_per_turn_samples(traj, path.parent))
        return n


def _time(fn: Any, path: Path, out: Path) -> float:
    gc.collect()
    t0 = time.perf_counter()
    fn(path, out)
    return time.perf_counter() - t0


def _storage(folder: Path, turns: list[Turn]) -> dict[str, float]:
    """Bytes of turns + samples per trained token: align's samples, and one full-prompt sample
    per turn (what a per-turn pipeline stores)."""
    path = _write_episode(folder, turns)
    out = folder / "samples.jsonl"
    _align_file(path, out)
    trained = sum(len(t.completion_ids) for t in turns)
    turn_bytes = (folder / "turns.jsonl").stat().st_size
    per_turn = folder / "per-turn.jsonl"
    with JsonlWriter(per_turn) as writer:
        for n, (turn, prompt) in enumerate(segment_prompts(turns)):
            writer.write(
                Sample(
                    sample_id=f"bench/{n}",
                    episode_id="bench",
                    group_id="bench",
                    segment_index=n,
                    segment_count=len(turns),
                    input_ids=prompt + turn.completion_ids,
                    loss_mask=[0] * len(prompt) + [1] * len(turn.completion_ids),
                    rollout_logprobs=turn.completion_logprobs,
                    reward=1.0,
                )
            )
    return {
        "align": (turn_bytes + out.stat().st_size) / trained,
        "per_turn_baseline": (turn_bytes + per_turn.stat().st_size) / trained,
    }


def bench_align(quick: bool = False) -> dict[str, Any]:
    first, delta, completion = (1000, 100, 50) if quick else (3000, 200, 100)
    passes = 5 if quick else 15
    lengths = (25, 50, 100, 200)
    with tempfile.TemporaryDirectory(prefix="legorl-bench-align-") as tmp:
        root = Path(tmp)
        sessions = {n: _session(n, first, delta, completion, seed=n) for n in lengths}
        paths = {n: _write_episode(root / f"t{n}", sessions[n]) for n in (100, 200)}
        times: dict[str, dict[int, list[float]]] = {"align": {}, "baseline": {}}
        for _ in range(passes):  # interleaved, so drift on a shared machine hits both alike
            for n in (100, 200):
                out = root / f"t{n}" / "out.jsonl"
                times["align"].setdefault(n, []).append(_time(_align_file, paths[n], out))
                times["baseline"].setdefault(n, []).append(_time(_baseline_file, paths[n], out))
        med = {k: {n: statistics.median(v) for n, v in by_n.items()} for k, by_n in times.items()}
        storage = {n: _storage(root / f"s{n}", sessions[n]) for n in lengths}
    per_token = {str(n): round(storage[n]["align"], 2) for n in lengths}
    baseline_per_token = {str(n): round(storage[n]["per_turn_baseline"], 2) for n in lengths}
    return {
        "turn_size": {"first_prompt": first, "prompt_delta": delta, "completion": completion},
        "passes": passes,
        "time_s": {"100": round(med["align"][100], 5), "200": round(med["align"][200], 5)},
        "time_ratio_200_over_100": round(med["align"][200] / med["align"][100], 3),
        "time_ratio_target_max": 2.3,
        "baseline_time_s": {
            "100": round(med["baseline"][100], 5),
            "200": round(med["baseline"][200], 5),
        },
        "baseline_time_ratio_200_over_100": round(med["baseline"][200] / med["baseline"][100], 3),
        "bytes_per_trained_token": per_token,
        "bytes_per_trained_token_growth_200_over_25": round(
            storage[200]["align"] / storage[25]["align"], 3
        ),
        "baseline_bytes_per_trained_token": baseline_per_token,
        "baseline_bytes_growth_200_over_25": round(
            storage[200]["per_turn_baseline"] / storage[25]["per_turn_baseline"], 3
        ),
    }
