"""Every `nox -s bench` section that measures in this process runs in its quick mode and
reports figures, so a broken benchmark fails CI instead of hiding until someone runs the bench.

The sections that launch real vLLM servers, a Ray cluster, sandboxes or training runs are left
to `nox -s bench` (`python -m legorl.bench --quick` runs them): their quick runs took about 16
minutes of the suite's test time, and what they drive is tested by the tests of those parts (tests/engines, tests/test_ray_executor.py, tests/verify, tests/sandbox,
tests/train)."""

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


# Sections run by `nox -s bench` only: each launches vLLM, Ray, sandboxes or a training run.
BENCH_ONLY = {
    "vllm", "vllm_failover", "lora", "decode", "ray", "verify", "sandbox", "rollout", "realsuite",
    "train",
}  # fmt: skip


def test_the_sections_left_to_the_bench_exist() -> None:
    assert set(BENCHMARKS) >= BENCH_ONLY


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    # Each section may run on its own test worker.
    [
        pytest.param(n, marks=pytest.mark.xdist_group(f"bench-{n}"))
        for n in BENCHMARKS
        if n not in BENCH_ONLY
    ],
)
def test_every_bench_section_runs_quickly(tmp_path: Path, name: str) -> None:
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
