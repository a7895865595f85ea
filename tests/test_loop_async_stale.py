"""Groups older than the bound: dropped and counted, or re-rolled in their slot with
``--on-stale rerun``; never trained. Run on the bench's simulated engine, harness, grader and
trainer (``legorl.bench.loop_async``: sleeps instead of model calls and optimizer steps; a real
engine cannot be made to return old-version Turns on demand) with the loop's real async driver,
where batch 3's first group reports version 0, as episodes kept from before a resume do."""

from __future__ import annotations

from typing import Any

import pytest

from legorl.bench.loop_async import _run
from legorl.loop_config import LoopConfig

BASE: dict[str, Any] = dict(
    iterations=4,
    group_size=2,
    tasks_per_iteration=2,
    concurrency=4,
    train_overrides=["drop_zero_variance_groups=false"],
    use_async=True,
    max_staleness=1,
)


def _state(on_stale: str, old: tuple[str, ...]) -> Any:
    kept: dict[str, Any] = {}
    _run(
        LoopConfig(**BASE, on_stale=on_stale),
        call_s=0.002,
        step_s=0.01,
        sync_s=0.001,
        old=old,
        keep=kept,
    )
    return kept["state"]


def _first_of_batch_3() -> str:
    from legorl.bench.loop_async import _tasks
    from legorl.loop.state import iteration_tasks

    return f"it003-{iteration_tasks(_tasks(32), 2, 3, 0)[0].instance_id}"


@pytest.mark.parametrize("on_stale", ["drop", "rerun"])
def test_a_stale_group_is_never_trained(on_stale: str) -> None:
    stale = _first_of_batch_3()
    state = _state(on_stale, (stale,))
    dropped = [g for it in state.iterations for g in it.dropped]
    assert dropped == [stale]
    for it in state.iterations:
        assert all(int(k) <= 1 for k in it.staleness), it.staleness
    trained = sum(it.samples for it in state.iterations)
    if on_stale == "drop":
        assert trained == 4 * 2 * 2 - 2  # its two episodes are lost to training, counted
        assert sum(it.rerun for it in state.iterations) == 0
    else:
        # re-rolled under a new id in its slot, and trained once fresh
        assert sum(it.rerun for it in state.iterations) == 1
        consumed = [g for it in state.iterations for g in it.groups]
        assert stale.replace("it003-", "it003r1-") in consumed
        assert trained == 4 * 2 * 2  # nothing lost


def test_the_control_without_old_episodes_drops_nothing() -> None:
    state = _state("drop", ())
    assert [g for it in state.iterations for g in it.dropped] == []
    assert sum(it.samples for it in state.iterations) == 16
