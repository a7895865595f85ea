"""Test-result parsers behind a Protocol; a task names its parser (``Task.log_parser``).

The pytest parser reads the signed, chained record stream of `pytest_report.py` (out of the
runner's exec output, or a report file), never what the run printed. A record counts only if
its MAC verifies at the next place in the chain; anything else that looks like a record is
forged (or, after a cut, unverifiable) and ignored.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from legorl.verify.pytest_report import GENESIS, MARK

# A test's outcome, worst first: one bad phase makes the test bad.
_RANK = {"error": 0, "failed": 1, "skipped": 2, "passed": 3}


@dataclass(slots=True)
class TestResults:
    outcomes: dict[str, str] = field(default_factory=dict)  # nodeid -> passed|failed|error|skipped
    forged_lines: int = 0
    collect_errors: list[str] = field(default_factory=list)
    finished: bool = False  # the runner reached the end of its session
    exitstatus: int | None = None
    others_failed: int = 0  # failed phases of tests without records of their own
    tampered: list[dict[str, Any]] = field(default_factory=list)
    shadowed: list[str] = field(default_factory=list)  # repo modules the environment also has


class LogParser(Protocol):
    name: str

    def parse(self, report: bytes, key: bytes) -> TestResults: ...


#: What one stream's records may cost the judge once decoded, in all (bytes, an upper bound
#: from their text, `decoded_cost`): the judged code can sign records (the channel is in its
#: process), and a signed list of 29 million small numbers is 58 MB of text and 1.1 GB of
#: objects; 11 MB of lists nested 400 deep were 4 million lists, 350 MB, inside the older
#: budget of 4 million brackets, commas and colons (round 101). Operands travel as one
#: marshalled text each, with budgets of their own (`assertions.Budget`).
DECODED_BYTES = 64 << 20


def decoded_cost(body: bytes) -> int:
    """An upper bound on the bytes ``json.loads(body)`` allocates, from its text: a list or a
    dict under 90 (an empty dict is 64 and a one-item list 88 with its collector header), each
    item or key under 60 more (a separator marks it), each string's object under 30 a quote,
    and the characters themselves (measured on CPython 3.11 with ``tracemalloc``: nested lists
    86 a bracket, one-key dicts 64 a separator, short strings 65 an item)."""
    brackets = body.count(b"[") + body.count(b"{")
    items = body.count(b",") + body.count(b":")
    return len(body) + 90 * brackets + 60 * items + 30 * body.count(b'"')


def records(stream: bytes, key: bytes) -> tuple[list[dict[str, Any]], int]:
    """The verified records of one chain in order, and the count of lines that did not verify
    (or that verified past what the stream's ``DECODED_BYTES`` allows)."""
    keyed = hmac.new(key, digestmod="sha256")
    seq, prev = 0, GENESIS
    found: list[dict[str, Any]] = []
    forged = 0
    mark = MARK.encode() + b" "
    budget = DECODED_BYTES
    # Only the lines that hold the mark are cut out of the stream: a stream of 32 million
    # empty lines made 32 million objects when every line was.
    pos, size = 0, len(stream)
    while pos < size:
        at = stream.find(mark, pos)
        if at < 0:
            break
        end = _line_end(stream, at, size)
        line, pos = stream[at:end], end + 1
        at = 0
        try:
            number, rest = line[at + len(mark) :].split(b" ", 1)
            body, mac = rest.rsplit(b" ", 1)
            expected = keyed.copy()
            expected.update(b"%d %s %s" % (seq, prev.encode(), body))
            if int(number) != seq or not hmac.compare_digest(mac, expected.hexdigest().encode()):
                raise ValueError("not the next record of the chain")
            budget -= decoded_cost(body)
            if budget < 0:
                raise ValueError("past what the stream's records may cost decoded")
            record = json.loads(body)
            if not isinstance(record, dict):
                raise ValueError("not a record")
        except (ValueError, RecursionError):
            forged += 1
            continue
        found.append(record)
        seq, prev = seq + 1, mac.decode()
    return found, forged


def _line_end(stream: bytes, at: int, size: int) -> int:
    """Where the line holding ``at`` ends (a record is one JSON line: ``\n`` ends it)."""
    end = stream.find(b"\n", at)
    return size if end < 0 else end


class PytestReportParser:
    """Signed, chained records from the report plugin and the unittest recorder."""

    name = "pytest"

    def parse(self, report: bytes, key: bytes) -> TestResults:
        return self.read(*records(report, key))

    def read(self, found: list[dict[str, Any]], forged: int) -> TestResults:
        """The outcomes of records already verified (`records`)."""
        results = TestResults(forged_lines=forged)
        for record in found:
            try:
                self._take(results, record)
            except Exception:  # e.g. round 101: ``int(inf)``'s OverflowError
                results.forged_lines += 1  # signed, but not a record of ours: it counts for nothing
        return results

    @staticmethod
    def _take(results: TestResults, record: dict[str, Any]) -> None:
        """One record into ``results``; a field of the wrong type raises (TypeError)."""
        event = record.get("event")
        if event == "test":
            nodeid, outcome, when = (_text(record[k]) for k in ("nodeid", "outcome", "when"))
            if outcome not in _RANK:
                outcome = "error"
            if when != "call" and outcome == "failed":
                outcome = "error"  # setup or teardown failed
            # The unittest recorder also signs the other spellings runners print.
            for name in [nodeid, *(_text(a) for a in record.get("aliases", ()))]:
                old = results.outcomes.get(name)
                if old is None or _RANK[outcome] < _RANK[old]:
                    results.outcomes[name] = outcome
        elif event == "collect_error":
            results.collect_errors.append(_text(record["nodeid"]))
        elif event == "tampered":
            results.tampered.append(record)
        elif event == "shadowed":
            results.shadowed = [_text(n) for n in record["names"]]
        elif event == "finish":
            status, failed = record["exitstatus"], record.get("failed", 0)
            if type(status) is not int or type(failed) is not int:
                raise TypeError("exitstatus or failed")
            results.finished = True
            results.exitstatus = status
            results.others_failed = failed


def _text(value: Any) -> str:
    if type(value) is not str:
        raise TypeError("not text")
    return value


PARSERS: dict[str, LogParser] = {"pytest": PytestReportParser()}
