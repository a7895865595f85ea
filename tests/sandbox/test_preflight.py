"""What a node needs, said before anything starts: the harness-runtime layer is made from the
harnesses a host has, and a harness missing where it must run is a one-line preflight error
(harness, node, install line) with a non-zero exit, before any engine or sandbox starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sandbox_fixtures import need

from legorl.harnesses import HARNESSES
from legorl.sandbox.runtime import (
    PreflightError,
    RuntimeSources,
    check_command,
    harness_preflight,
    manifest,
    node_name,
)

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "fixtures" / "tasks" / "train.jsonl"
MODEL = ROOT / "fixtures" / "models" / "tiny-qwen3"


def _host() -> RuntimeSources:
    return RuntimeSources.find()


def test_a_rollout_of_a_harness_this_host_lacks_fails_before_any_sandbox(tmp_path: Path) -> None:
    empty = tmp_path / "npm-root"
    empty.mkdir()
    env = {**os.environ, "LEGORL_NPM_ROOT": str(empty)}  # no npm harness installed here
    out = tmp_path / "traj.jsonl"
    args = [
        sys.executable, "-m", "legorl.cli.main", "rollout", "--tasks", str(TASKS),
        "--harness", "claude-code", "--limit", "2", "--engine", "forced", "--model", str(MODEL),
        "--script", str(tmp_path / "none.json"), "--sandbox", "local", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "harness claude-code is not installed on node " + node_name() in lines[0]
    assert "npm install -g @anthropic-ai/claude-code" in lines[0]
    # nothing ran: no trajectory file, and the engine's script (missing) was never read
    assert not out.exists() and not list(tmp_path.glob("traj.jsonl.turns/*"))


def test_a_run_needs_only_the_harness_it_uses() -> None:
    host = _host()
    need(host.miniswe_venv is not None, "the mini-swe-agent venv (.ci/run makes it)")
    assert host.miniswe_venv is not None
    only_miniswe = RuntimeSources(miniswe_venv=host.miniswe_venv, agent_dir=host.agent_dir)
    harness_preflight(HARNESSES.resolve("mini-swe-agent"), "docker", src=only_miniswe)
    for name, part in (("openhands-sdk", "openhands venv"), ("opencode", "node")):
        with pytest.raises(PreflightError) as err:
            harness_preflight(HARNESSES.resolve(name), "docker", node="n7", src=only_miniswe)
        line = str(err.value)
        assert f"harness {name} is not installed on node n7" in line and part in line
        assert HARNESSES.resolve(name).requires.install in line
    # the built-in agent brings itself: nothing of the runtime is needed
    harness_preflight(HARNESSES.resolve("mini"), "docker", src=RuntimeSources())


def test_a_local_sandbox_harness_needs_its_executable_on_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from legorl.harnesses.testing import ScriptedHarness

    harness_preflight(ScriptedHarness, "local")  # sh is here
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(PreflightError, match="sh is not on PATH"):
        harness_preflight(ScriptedHarness, "local")
    harness_preflight(ScriptedHarness, "docker")  # the image's own shell, not the host's


def test_the_layer_is_made_and_checked_from_what_the_host_has(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    host = _host()
    need(
        host.package("@anthropic-ai/claude-code") is not None and host.node is not None,
        "Claude Code (.ci/run installs it)",
    )
    # a host with Node and Claude Code, nothing else
    root = tmp_path / "npm"
    (root / "@anthropic-ai").mkdir(parents=True)
    (root / "@anthropic-ai" / "claude-code").symlink_to(host.package("@anthropic-ai/claude-code"))
    src = RuntimeSources(node=host.node, npm_root=root, agent_dir=host.agent_dir)
    recipe = manifest(src)
    line = check_command(recipe)
    assert "bin/claude --version" in line and "bin/node --version" in line
    assert "opencode" not in line and "openhands" not in line and "minisweagent" not in line
    harness_preflight(HARNESSES.resolve("claude-code"), "local", src=src)

    # the local backend builds that layout (it used to refuse: "not installed on this host")
    from legorl.sandbox.local_backend import LocalBackend

    monkeypatch.setenv("LEGORL_NPM_ROOT", str(root))
    monkeypatch.setenv("LEGORL_CACHE", str(tmp_path / "cache"))
    # a host without either harness venv
    monkeypatch.setattr("legorl.sandbox.runtime._find_venv", lambda name: None)
    path, _binds, report = LocalBackend().cache.runtime(build=True)
    assert report.action == "built"
    built = json.loads((path / "root" / "manifest.json").read_text())
    assert built["npm"]["@anthropic-ai/claude-code"] and built["openhands"] is None
    assert (path / "root" / "bin" / "claude").exists()
    assert not (path / "root" / "bin" / "opencode").exists()
