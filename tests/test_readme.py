"""Every runnable `legorl` example in the README runs as written."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def _examples() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, re.DOTALL)
    lines = [ln.strip() for block in blocks for ln in block.splitlines()]
    return [ln for ln in lines if ln.startswith(("legorl cat", "cat tests/"))]


def test_readme_cat_examples_run(tmp_path: Path) -> None:
    examples = _examples()
    assert len(examples) >= 2
    shutil.copytree(ROOT / "tests" / "data", tmp_path / "tests" / "data")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shim = bindir / "legorl"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m legorl.cli.main "$@"\n')
    shim.chmod(0o755)
    for line in examples:
        result = subprocess.run(
            line,
            shell=True,
            cwd=tmp_path,
            capture_output=True,
            timeout=60,
            env={"PATH": f"{bindir}:/usr/bin:/bin"},
        )
        assert result.returncode == 0, f"{line}: {result.stderr.decode()}"
    assert (tmp_path / "turns.jsonl").read_text().count("legorl/turn@1") == 2
    assert (tmp_path / "copy.jsonl").read_bytes() == (ROOT / "tests/data/golden.jsonl").read_bytes()
