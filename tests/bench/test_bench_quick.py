"""Every `nox -s bench` section runs in its quick mode and reports figures, so a broken
benchmark fails CI instead of hiding until someone runs the full bench."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from legorl.bench import BENCHMARKS


def _numbers(value: object) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in _numbers(v)]
    return []


@pytest.mark.slow
def test_every_bench_section_runs_quickly(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "legorl.bench", "--quick", "--out", str(out)],
        capture_output=True,
        timeout=1800,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    report = json.loads(out.read_text())
    for name in BENCHMARKS:
        if "skipped" in report[name] and os.environ.get("CI") != "true":
            continue  # say, no vLLM here; under CI=true every section must measure
        figures = _numbers(report[name])
        assert figures, f"bench section {name} reported no figure"
        assert all(math.isfinite(x) for x in figures), (name, report[name])
