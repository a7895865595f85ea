"""Every `legorl sandbox` example in the README runs as written (from the repository root)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from sandbox_fixtures import (  # noqa: F401  (fixtures are found by name)
    ROOT,
    fixture_docker_backend,
    fixture_local_backend,
)


def _examples() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, re.DOTALL)
    lines = [ln.strip() for block in blocks for ln in block.splitlines()]
    return [ln for ln in lines if ln.startswith("legorl sandbox ")]


def test_readme_sandbox_examples_run(
    docker_backend: object, local_backend: object, tmp_path: Path
) -> None:
    examples = _examples()
    assert len(examples) >= 4, "the README's sandbox section (with `legorl sandbox` examples)"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shim = bindir / "legorl"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m legorl.cli.main "$@"\n')
    shim.chmod(0o755)
    for line in examples:
        result = subprocess.run(
            line,
            shell=True,
            cwd=ROOT,
            capture_output=True,
            timeout=900,
            env={**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"},
        )
        assert result.returncode == 0, f"{line}: {result.stderr.decode()[-2000:]}"
