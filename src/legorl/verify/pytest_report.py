"""The grading side channel: a pytest plugin copied into the grading sandbox (stdlib only).

    LEGORL_REPORT=/tmp/…/report.jsonl python -m pytest -p legorl_pytest_report … < key

It reads a one-time key from stdin when pytest imports it (before any test module), then
appends one line per test phase outcome to the report file, each signed with an HMAC of that
key. Results are
never parsed from the run's output, so printed `PASSED` lines prove nothing; lines without a
valid signature are counted as forged; tests that never report (a crash, ``os._exit``, broken
collection, a hang) are missing, and missing counts as failed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

_state: dict = {}


def _emit(record: dict) -> None:
    fd = _state.get("fd")
    if fd is None:
        return
    body = json.dumps(record, sort_keys=True)
    mac = hmac.new(_state["key"], body.encode(), hashlib.sha256).hexdigest()
    os.write(fd, (json.dumps({"r": record, "mac": mac}) + "\n").encode())


def _read_key() -> bytes:
    # Read at import, when pytest loads `-p` plugins: before its capture points fd 0 at
    # /dev/null, and before any test module (or code under test) is imported.
    key = b""
    while not key.endswith(b"\n"):
        try:
            chunk = os.read(0, 256)
        except OSError:
            break
        if not chunk:
            break
        key += chunk
    return key.strip()


_state["path"] = os.environ.pop("LEGORL_REPORT", None)
if _state["path"]:
    _state["key"] = _read_key()


def pytest_configure(config: Any) -> None:
    path = _state.get("path")
    if not path or not _state.get("key") or "fd" in _state:
        return  # no key, no report: every test then counts as missing
    _state["fd"] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    _emit({"event": "start"})


def pytest_collectreport(report: Any) -> None:
    if report.failed:
        _emit({"event": "collect_error", "nodeid": report.nodeid})


def pytest_runtest_logreport(report: Any) -> None:
    if report.when == "call" or report.outcome != "passed":
        # Setup/teardown only matter when they did not pass (an error, or a skip).
        _emit(
            {
                "event": "test",
                "nodeid": report.nodeid,
                "when": report.when,
                "outcome": report.outcome,
            }
        )


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    _emit({"event": "finish", "exitstatus": int(exitstatus)})
