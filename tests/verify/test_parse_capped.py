"""The official swebench log parsers run under caps: for each parser kind whose regular
expressions backtrack (Django's, sympy's, pytest-with-options'), a pathological log ends at
the CPU cap with ``{}`` and a reason, while the event loop keeps serving other work; an
ordinary log parses as the parser itself reads it (the control), and so does a linear parser
given the same flood."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("swebench")

from legorl.records import Task
from legorl.verify.specs import parse_capped, swebench_parser


def _task() -> Task:
    return Task(
        instance_id="x__y-1",
        repo="x/y",
        base_commit="0" * 40,
        problem_statement="",
        test_patch="",
        version="1.0",
        environment_setup_commit="0" * 40,
        FAIL_TO_PASS=["a"],
        PASS_TO_PASS=[],
    )


#: Each parser and a log that makes its regular expression backtrack quadratically or worse.
PATHOLOGICAL = {
    "parse_log_django": "t ... Testing against Django installed in x\n" * 40_000,
    "parse_log_sympy": "_ " + " x.py" * 200_000,
    "parse_log_pytest_options": "PASSED t" + "[" * 60_000,
}


@pytest.mark.parametrize("parser", sorted(PATHOLOGICAL))
def test_a_backtracking_log_ends_at_the_cpu_cap(parser: str) -> None:
    async def go() -> tuple[dict[str, str], str | None, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        beat = asyncio.ensure_future(ticker())
        try:
            parsed, reason = await parse_capped(parser, PATHOLOGICAL[parser], _task(), cpu_s=2)
        finally:
            beat.cancel()
        return parsed, reason, ticks

    t0 = time.monotonic()
    parsed, reason, ticks = asyncio.run(go())
    assert parsed == {} and reason is not None and "CPU" in reason, reason
    assert time.monotonic() - t0 < 40  # the cap held (the uncapped parse runs for minutes)
    assert ticks >= 10  # the loop ran other work meanwhile


def test_ordinary_logs_parse_as_the_parser_reads_them() -> None:
    from swebench.types import TestSpec

    task = _task()
    spec = TestSpec(
        instance_id=task.instance_id,
        image="",
        eval_script_list=[],
        repo=task.repo,
        version=task.version,
        FAIL_TO_PASS=task.FAIL_TO_PASS,
        PASS_TO_PASS=task.PASS_TO_PASS,
        log_parser="parse_log_django",
    )
    log = "test_a (m.T) ... ok\ntest_b (m.T) ... FAIL\ntest_c (m.T) ... ERROR\n"
    parsed, reason = asyncio.run(parse_capped("parse_log_django", log, task))
    assert reason is None
    assert parsed == swebench_parser("parse_log_django")(log, spec) and len(parsed) == 3
    # A linear parser given a flood finishes under the same cap.
    flood = "PASSED t" + "[" * 60_000 + "\nPASSED tests/t.py::test_ok\n"
    parsed, reason = asyncio.run(parse_capped("parse_log_pytest", flood, task, cpu_s=2))
    assert reason is None and parsed["tests/t.py::test_ok"] == "PASSED"


def test_a_parser_out_of_memory_gets_a_reason() -> None:
    parsed, reason = asyncio.run(
        parse_capped("parse_log_pytest", "PASSED a\n" * 200_000, _task(), memory=64 << 20)
    )
    assert parsed == {} and reason is not None and "memory" in reason, reason


def test_a_tests_own_pattern_cannot_hold_the_judge_on_a_message_made_for_it() -> None:
    """``pytest.raises(E, match=...)``: the pattern is the task's, the message the judged
    code's. Two ``.*`` backtrack for hours with ``re`` on this text (the judge, and with it
    every other grading, would wait); bounded, the search ends and finds no match."""
    from legorl.verify.assertions import _bounded_search

    made = "a" * 20_000 + "b" * 20_000 + "c" * 20_000
    assert _bounded_search(r"a.*b.*c.*d", made) is False
    # Control: the same pattern and the plain meaning of a search.
    assert _bounded_search(r"a.*b.*c.*d", "a b c d") is True
    assert _bounded_search(r"invalid \w+ for", "an invalid value for x") is True
    assert _bounded_search(r"^invalid", "an invalid value") is False
    assert _bounded_search(r"(unclosed", "(unclosed") is False  # a bad pattern matches nothing
