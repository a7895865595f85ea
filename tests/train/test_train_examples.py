"""The train stage's README examples run as written (from a scratch folder), on the golden
samples in tests/data/train/ (made by the tiny model: `python tests/train/train_helpers.py`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from train_helpers import GOLDEN, ROOT

from legorl.records import Metric, read_jsonl

# Keep in sync with the README's train section.
EXAMPLES = [
    "legorl train tests/data/train/samples.jsonl --model fixtures/models/tiny-qwen3 --dry-run"
    " --metrics runs/fidelity.jsonl",
    "legorl train tests/data/train/samples.jsonl --model fixtures/models/tiny-qwen3"
    " --out runs/ckpt --metrics runs/metrics.jsonl lr=1e-5 correction=tis",
    "legorl train --model runs/ckpt --out runs/ckpt --steps 2 algorithm=grpo"
    " < tests/data/train/samples.jsonl >> runs/metrics.jsonl",
]


def test_examples_run(tmp_path: Path) -> None:
    (tmp_path / "tests" / "data").mkdir(parents=True)
    shutil.copytree(GOLDEN.parent, tmp_path / "tests" / "data" / "train")
    (tmp_path / "fixtures").mkdir()
    (tmp_path / "fixtures" / "models").symlink_to(ROOT / "fixtures" / "models")
    (tmp_path / "runs").mkdir()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shim = bindir / "legorl"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m legorl.cli.main "$@"\n')
    shim.chmod(0o755)
    for line in EXAMPLES:
        result = subprocess.run(
            line,
            shell=True,
            cwd=tmp_path,
            capture_output=True,
            timeout=300,
            env={"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp_path)},
        )
        assert result.returncode == 0, f"{line}: {result.stderr.decode()}"
    fidelity = {m.name: m.value for m in read_jsonl(tmp_path / "runs" / "fidelity.jsonl", Metric)}
    assert fidelity["rollout_trainer_pearson"] > 0.999  # the golden samples match the model
    steps = [m.step for m in read_jsonl(tmp_path / "runs" / "metrics.jsonl", Metric)]
    assert sorted(set(steps)) == [1, 2, 3]  # the second call resumed at step 2
    assert (tmp_path / "runs" / "ckpt" / "optimizer.pt").is_file()
