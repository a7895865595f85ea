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


# Sections that start a real vLLM server run in the vLLM group (tests/conftest.py).
VLLM = {"vllm", "vllm_failover", "decode", "lora"}
# A section with a test of its own, which checks its figures more closely, is run there.
OWN_TEST = {"decode": "tests/bench/test_bench_decode.py"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    # Each section may run on its own test worker.
    [
        pytest.param(n, marks=pytest.mark.xdist_group("vllm" if n in VLLM else f"bench-{n}"))
        for n in BENCHMARKS
    ],
)
def test_every_bench_section_runs_quickly(tmp_path: Path, name: str) -> None:
    if name in OWN_TEST:
        assert (Path(__file__).parents[2] / OWN_TEST[name]).is_file()
        return
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "legorl.bench", "--quick", "--only", name, "--out", str(out)],
        capture_output=True,
        timeout=1800,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    report = json.loads(out.read_text())
    if "skipped" in report[name] and os.environ.get("CI") != "true":
        return  # say, no vLLM here; under CI=true every section must measure
    figures = _numbers(report[name])
    assert figures, f"bench section {name} reported no figure"
    assert all(math.isfinite(x) for x in figures), (name, report[name])
