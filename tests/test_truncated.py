"""Truncated episodes: the rollout classifies from what the proxy recorded for the session (a
spent budget, a context overflow), not from the harness's exit; align's truncation rule (mask
or DAPO's overlong penalty) decides what training makes of them.

The rollouts run the built-in `mini` harness in real `local` (bubblewrap) sandboxes: on the
real tiny model (embedded engine) where the context overflows, and on the `forced` engine (a
fake shipping in the package: scripted completions, log-probs from a real forward pass of the
tiny model) for the budget, with controls the same runs without the budget, or with an engine
that fails.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_task

from legorl.align import Truncation, align
from legorl.engines import make_engine
from legorl.harnesses import make_harness
from legorl.proxy.core import Budget
from legorl.records import Task, Trajectory, Turn, read_jsonl
from legorl.rollout import inprocess_proxy
from legorl.sandbox import make_backend
from legorl.verify.redteam import honest

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "fixtures" / "tasks"
MODEL = ROOT / "fixtures" / "models" / "tiny-qwen3"


def _task() -> Task:
    return next(iter(read_jsonl(TASKS / "train.jsonl", Task)))


async def _mini(tmp: Path, script: list, budget: Budget | None) -> Trajectory:
    engine = make_engine("forced", model_path=str(MODEL), script=script)
    try:
        async with inprocess_proxy(MODEL, engine, tmp / "turns", budget) as (endpoint, _):
            return await run_task(
                _task(),
                make_harness("mini"),
                make_backend("local"),
                endpoint,
                refs=tmp,
                wall_s=240,
                run_id="legorl-test-truncated",
            )
    finally:
        await engine.close()


def test_a_spent_turn_budget_ends_mini_as_truncated(tmp_path: Path) -> None:
    script = honest(_task())  # an edit, then a submit: two calls
    capped = asyncio.run(_mini(tmp_path / "capped", script, Budget(max_turns=1)))
    assert capped.status == "truncated" and capped.evidence["truncated"] == "max_turns"
    assert capped.evidence["exit_code"] == 4  # mini's own exit for an API error
    assert len(list(read_jsonl(tmp_path / "capped" / capped.turns_ref[0], Turn))) == 1
    # Control: the same run without the budget submits.
    free = asyncio.run(_mini(tmp_path / "free", script, None))
    assert free.status == "ok" and "truncated" not in free.evidence


def test_an_engine_failure_stays_an_environment_failure(tmp_path: Path) -> None:
    # The forced engine with nothing scripted fails every call (503): mini exits 4 as it does
    # for a refusal, but the proxy recorded no truncation, so the run is the environment's.
    traj = asyncio.run(_mini(tmp_path, [], Budget(max_turns=5)))
    assert traj.status == "proxy_error" and "truncated" not in traj.evidence
    assert traj.evidence["exit_code"] == 4


def test_mini_on_the_real_tiny_model_overflowing_its_context_is_truncated(
    tmp_path: Path,
) -> None:
    # As a new user runs it: default harness options, the embedded engine, one task.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "legorl.cli.main",
            "rollout",
            "--tasks",
            str(TASKS / "train.jsonl"),
            "--harness",
            "mini",
            "--limit",
            "1",
            "--engine",
            "embedded",
            "--model",
            str(MODEL),
            "--sandbox",
            "local",
            "--out",
            "traj.jsonl",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    [traj] = read_jsonl(tmp_path / "traj.jsonl", Trajectory)
    assert traj.status == "truncated", json.dumps(traj.evidence)[:2000]
    assert traj.evidence["truncated"] == "context_length"
    turns = list(read_jsonl(tmp_path / traj.turns_ref[0], Turn))
    assert turns and all(t.max_tokens is not None for t in turns)


# ---- align's truncation rule ------------------------------------------------------------------


def _episode(tid: str, status: str, sampled: int, reward: float = 1.0) -> Trajectory:
    turn = Turn(
        session=tid,
        turn=0,
        segment=0,
        api="openai_chat",
        model="tiny",
        prompt_offset=0,
        prompt_delta=[1, 2, 3],
        completion_ids=list(range(10, 10 + sampled)),
        completion_logprobs=[-0.5] * sampled,
        finish_reason="length",
    )
    return Trajectory(
        trajectory_id=tid,
        task_id="t",
        group_id="t",
        sample_index=0,
        harness="mini",
        status=status,  # type: ignore[arg-type]
        turns=[turn],
        reward=reward,
    )


def test_mask_keeps_a_truncated_episode_in_its_group_with_weight_zero() -> None:
    samples = list(align([_episode("a", "ok", 4), _episode("b", "truncated", 4)]))
    assert [(s.episode_id, s.reward, s.weight) for s in samples] == [
        ("a", 1.0, 1.0),
        ("b", 1.0, 0.0),
    ]


def test_penalty_is_dapos_soft_overlong_punishment() -> None:
    rule = Truncation("penalty", overlong_max=10, overlong_buffer=4)
    episodes = [
        _episode("short", "ok", 6),  # 6 <= 10 - 4: no penalty
        _episode("soft", "ok", 8),  # (6 - 8) / 4
        _episode("edge", "ok", 10),  # (6 - 10) / 4 = -1 at L_max
        _episode("long", "ok", 11),  # past L_max
        _episode("cut", "truncated", 3),  # truncated: -1 however short
    ]
    got = {s.episode_id: (s.reward, s.weight) for s in align(episodes, truncation=rule)}
    assert got == {
        "short": (1.0, 1.0),
        "soft": (0.5, 1.0),
        "edge": (0.0, 1.0),
        "long": (0.0, 1.0),
        "cut": (0.0, 1.0),
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rule": "drop"}, "expected mask or penalty"),
        ({"rule": "penalty"}, "overlong_max: the penalty rule needs a length > 0"),
        ({"rule": "penalty", "overlong_max": 4, "overlong_buffer": 5}, "overlong_buffer"),
    ],
)
def test_a_bad_rule_is_refused_naming_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Truncation(**kwargs)
