"""The real-suite grading-time section in its quick mode, on both backends: every graded gold
patch resolves, so each figure is a full grading and not an early refusal."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def _backends_present() -> None:
    docker = shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True)
    if not (docker and docker.returncode == 0 and shutil.which("bwrap")):
        if os.environ.get("CI") == "true":
            pytest.fail("Docker and bubblewrap are both needed (.ci/run sets them up)")
        pytest.skip("needs Docker and bubblewrap")


@pytest.mark.fixtures
@pytest.mark.slow
def test_realsuite_section_grades_gold_patches_on_both_backends() -> None:
    from legorl.bench.realsuite import BACKENDS, bench_realsuite

    _backends_present()
    report = bench_realsuite(quick=True)
    assert report["tasks"] == 2
    assert report["bare_test_cmd"]["median_s"] > 0
    for name in BACKENDS:
        assert report[name]["resolved"] == report["tasks"], (name, report[name])
        assert 0 < report[name]["median_s"] <= report[name]["max_s"]
