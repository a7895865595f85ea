"""Test-result parsers behind a Protocol; a task names its parser (``Task.log_parser``).

The pytest parser reads the signed side-channel report written by `pytest_report.py`, never the
run's printed output.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass, field
from typing import Protocol

# A test's outcome, worst first: one bad phase makes the test bad.
_RANK = {"error": 0, "failed": 1, "skipped": 2, "passed": 3}


@dataclass(slots=True)
class TestResults:
    outcomes: dict[str, str] = field(default_factory=dict)  # nodeid -> passed|failed|error|skipped
    forged_lines: int = 0
    collect_errors: list[str] = field(default_factory=list)
    finished: bool = False  # the runner reached the end of its session
    exitstatus: int | None = None


class LogParser(Protocol):
    name: str

    def parse(self, report: bytes, key: bytes) -> TestResults: ...


class PytestReportParser:
    """Signed JSON lines from the `legorl_pytest_report` plugin."""

    name = "pytest"

    def parse(self, report: bytes, key: bytes) -> TestResults:
        results = TestResults()
        for raw in report.splitlines():
            try:
                line = json.loads(raw)
                record, mac = line["r"], line["mac"]
                body = json.dumps(record, sort_keys=True).encode()
            except (ValueError, KeyError, TypeError):
                results.forged_lines += 1
                continue
            expected = hmac.new(key, body, hashlib.sha256).hexdigest()
            if not isinstance(mac, str) or not hmac.compare_digest(mac, expected):
                results.forged_lines += 1
                continue
            event = record.get("event")
            if event == "test":
                nodeid, outcome = record["nodeid"], record["outcome"]
                if record["when"] != "call" and outcome == "failed":
                    outcome = "error"  # setup or teardown failed
                old = results.outcomes.get(nodeid)
                if old is None or _RANK[outcome] < _RANK[old]:
                    results.outcomes[nodeid] = outcome
            elif event == "collect_error":
                results.collect_errors.append(record["nodeid"])
            elif event == "finish":
                results.finished = True
                results.exitstatus = record["exitstatus"]
        return results


PARSERS: dict[str, LogParser] = {"pytest": PytestReportParser()}
