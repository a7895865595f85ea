"""The Claude Code plugin: its manifest and command files are well formed, each command's
`!` CLI line is allowed by its own `allowed-tools` and runs as Claude Code would run it, and
Claude Code's own validator accepts the plugin when Claude Code is installed."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from legorl.records import Metric, write_jsonl

PLUGIN = ROOT / "plugins" / "claude-code" / "legorl"
COMMANDS = sorted((PLUGIN / "commands").glob("*.md"))
MODEL = ROOT / "fixtures" / "models" / "tiny-qwen3"


def frontmatter(path: Path) -> tuple[dict, str]:
    text = path.read_text()
    match = re.match(r"^---\n(.*?)\n---\n(.*)$", text, re.DOTALL)
    assert match, f"{path.name}: no YAML frontmatter"
    import yaml

    meta = yaml.safe_load(match.group(1))
    assert isinstance(meta, dict), f"{path.name}: frontmatter is not a mapping"
    return meta, match.group(2)


def bash_lines(body: str) -> list[str]:
    return re.findall(r"!`([^`]+)`", body)


def test_manifest() -> None:
    manifest = json.loads((PLUGIN / ".claude-plugin" / "plugin.json").read_text())
    assert manifest["name"] == "legorl"
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", manifest["name"])
    assert re.fullmatch(r"\d+\.\d+\.\d+", manifest["version"])
    assert manifest["description"] and manifest["author"]["name"]
    # Components live at the plugin root, not inside .claude-plugin/.
    assert sorted(p.name for p in (PLUGIN / ".claude-plugin").iterdir()) == ["plugin.json"]
    assert [p.stem for p in COMMANDS] == ["check", "inspect", "status"]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda p: p.stem)
def test_command_files(command: Path) -> None:
    meta, body = frontmatter(command)
    assert set(meta) <= {"description", "argument-hint", "allowed-tools", "model"}
    assert 10 <= len(meta["description"]) <= 80
    allowed = re.findall(r"Bash\(([^)]*):\*\)", meta["allowed-tools"])
    lines = bash_lines(body)
    assert lines, f"{command.name} runs no CLI line"
    for line in lines:
        assert line.startswith("legorl ")
        assert any(line.startswith(prefix) for prefix in allowed), (line, allowed)
    # Cross references name commands that exist.
    for ref in re.findall(r"/legorl:([a-z-]+)", body):
        assert (PLUGIN / "commands" / f"{ref}.md").is_file(), ref


@pytest.fixture
def shell(tmp_path: Path) -> dict[str, str]:
    """A PATH whose `legorl` is this checkout's, as an installed console script would be."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shim = bindir / "legorl"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m legorl.cli.main "$@"\n')
    shim.chmod(0o755)
    return {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "COLUMNS": "160"}


def run_command(name: str, arguments: str, env: dict[str, str], cwd: Path) -> list[str]:
    """Run a command file's `!` lines with $ARGUMENTS spliced in, as Claude Code does; every
    line must exit 0 (Claude Code fails the command otherwise)."""
    _, body = frontmatter(PLUGIN / "commands" / f"{name}.md")
    outputs = []
    for line in bash_lines(body):
        result = subprocess.run(
            line.replace("$ARGUMENTS", arguments),
            shell=True,
            cwd=cwd,
            env=env,
            capture_output=True,
            timeout=300,
        )
        assert result.returncode == 0, f"{line}: {result.stderr.decode()}"
        outputs.append(result.stdout.decode() + result.stderr.decode())
    return outputs


def test_check_command_runs(tmp_path: Path, shell: dict[str, str]) -> None:
    (good,) = run_command(
        "check", f"--model {MODEL} --engine forced --harness mini --sandbox none", shell, tmp_path
    )
    assert "✓ pass" in good and "checks passed or were skipped" in good
    # A failing run still answers (exit 0 with --exit-zero), with the reason and the fix.
    (bad,) = run_command("check", f"--model {tmp_path}/missing --sandbox none", shell, tmp_path)
    assert "FAIL" in bad and "no such folder" in bad and "check(s) failed" in bad


def test_status_and_inspect_commands_run(
    tmp_path: Path, shell: dict[str, str], records: list
) -> None:
    write_jsonl(tmp_path / "graded.jsonl", [r for r in records if type(r).__name__ == "Trajectory"])
    write_jsonl(
        tmp_path / "metrics.jsonl",
        [Metric(step=i, name="rollout_trainer_pearson", value=v) for i, v in enumerate([1, 0.9])],
    )
    (status,) = run_command("status", "graded.jsonl metrics.jsonl", shell, tmp_path)
    assert "trajectories (1)" in status and "rollout_trainer_pearson" in status
    assert "correlation" in status  # the monitor's alert on the drop to 0.9
    (snapshot,) = run_command("inspect", "graded.jsonl metrics.jsonl", shell, tmp_path)
    assert "legorl-toy__geometry-1" in snapshot


def test_claude_code_validates_the_plugin() -> None:
    if shutil.which("claude") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("Claude Code is not installed (.ci/run installs it)")
        pytest.skip("Claude Code is not installed")
    env = {
        **os.environ,
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    result = subprocess.run(
        ["claude", "plugin", "validate", str(PLUGIN)],
        capture_output=True,
        timeout=120,
        env=env,
    )
    out = result.stdout.decode() + result.stderr.decode()
    assert result.returncode == 0 and "Validation passed" in out, out
