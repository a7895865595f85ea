"""The command line: table of contents, light start-up, stdin/stdout piping, one-line errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from legorl.records import Metric, read_jsonl, to_json, write_jsonl

STAGES = ["proxy", "sandbox", "rollout", "verify", "align", "train", "loop", "inspect", "check"]


def legorl(*args: str, stdin: bytes = b"", cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "legorl.cli.main", *args],
        input=stdin,
        capture_output=True,
        cwd=cwd,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"},
        timeout=60,
    )


def test_help_lists_every_stage_with_a_description() -> None:
    result = legorl("--help")
    assert result.returncode == 0
    text = result.stdout.decode()
    for stage in STAGES:
        found = re.search(rf"^\W*{stage}\s{{2,}}(\w.{{10,}})$", text, re.MULTILINE)
        assert found, f"{stage} missing from --help, or without a description"


def test_version() -> None:
    from legorl import __version__

    result = legorl("--version")
    assert result.returncode == 0
    assert result.stdout.decode().strip() == f"legorl {__version__}"


def test_help_imports_no_heavy_module() -> None:
    probe = (
        "import sys\n"
        "from legorl.cli.main import app\n"
        "try:\n"
        "    app(['--help'], standalone_mode=False)\n"
        "finally:\n"
        "    heavy = [m for m in ('torch', 'transformers', 'mitmproxy', 'textual', 'docker')"
        " if m in sys.modules]\n"
        "    print('HEAVY', heavy, file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=60)
    assert b"HEAVY []" in result.stderr, result.stderr.decode()


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_has_its_own_help(stage: str) -> None:
    result = legorl(stage, "--help")
    assert result.returncode == 0, result.stderr.decode()
    assert b"not built" not in result.stdout + result.stderr


def test_cat_pipes_stdin_to_stdout(records: list) -> None:
    data = b"".join(to_json(r) + b"\n" for r in records)
    result = legorl("cat", stdin=data)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout == data
    assert result.stderr == b""  # nothing human-facing when all is well


def test_cat_reads_files_and_appends_to_out(tmp_path: Path, records: list) -> None:
    src = tmp_path / "in.jsonl"
    write_jsonl(src, records)
    out = tmp_path / "out.jsonl"
    write_jsonl(out, [Metric(step=0, name="kept", value=1.0)])
    result = legorl("cat", str(src), "--schema", "metric", "--skip-bad", "--out", str(out))
    assert result.returncode == 0
    assert result.stdout == b""
    got = list(read_jsonl(out))
    assert [m.name for m in got] == ["kept", "rollout_trainer_pearson"]
    assert f"skipped {len(records) - 1} bad line(s) in {src}" in result.stderr.decode()


def test_bad_input_is_one_line_naming_file_and_line(tmp_path: Path, records: list) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(to_json(records[1]) + b"\n" + b'{"schema": "legorl/turn@1"}\n')
    out = tmp_path / "out.jsonl"
    result = legorl("cat", str(src), "--out", str(out))
    assert result.returncode == 1
    err = result.stderr.decode().strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith(f"legorl cat: error: {src}:2: ")
    assert "missing required field" in err[0]
    # The good line before the bad one was already written and is kept.
    assert len(list(read_jsonl(out))) == 1


def test_missing_input_file_and_unknown_schema_flag(tmp_path: Path) -> None:
    missing = legorl("cat", str(tmp_path / "nope.jsonl"))
    assert missing.returncode == 1
    assert (
        missing.stderr.decode().strip()
        == f"legorl cat: error: {tmp_path / 'nope.jsonl'}: no such file"
    )
    unknown = legorl("cat", "--schema", "frob")
    assert unknown.returncode == 2
    assert "--schema: unknown record type 'frob'" in unknown.stderr.decode()
