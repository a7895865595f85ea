"""Harness adapters: each runs one agent harness, unmodified, inside a sandbox against a proxy
session, and classifies how it ended. Chosen by short name:

    from legorl.harnesses import make_harness
    harness = make_harness("mini", max_turns=12)
    run = await harness.run(sandbox, task.problem_statement, model="tiny", timeout=600)

Adding a harness is one small class (the ``Harness`` Protocol in ``legorl.protocols``): its
``name``, the ``api`` it speaks and whether it ``streams``, what it ``requires`` installed (for
``legorl check``), whether it ``needs_runtime``, and ``async run(...)``; then one line in
``HARNESSES``. Nothing about a harness lives anywhere else. A class outside legorl is named as
``module:Class`` (``--harness my_pkg.agents:MyHarness``). A harness reaches its proxy
session only through ``sandbox.proxy_url``, the session's capability route: it never builds a
URL from a session id. A harness whose main system prompt is fixed declares it as
``main_system``, and the rollout binds the session's main agent to it when the session opens.

Inside a sandbox the harness binaries come from its harness runtime: the sandbox's
``runtime_env`` (extra environment, e.g. a PATH with the runtime's bin folder) and
``openhands_python`` (the Python 3.12 venv with the OpenHands SDK, or None without the
runtime, when the host's own install is used).

The test double ``legorl.harnesses.testing:ScriptedHarness`` ships in the package but is not
registered.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from legorl.protocols import ApiShape, ExecResult, Harness, HarnessRun, Requirement, Sandbox
from legorl.registry import Registry

HERE = Path(__file__).resolve().parent
SCRATCH = "/tmp/legorl-harness"  # inside the sandbox, outside the repository (never in a patch)

#: Quiet, offline settings every harness gets.
OFFLINE_ENV = {
    "DISABLE_TELEMETRY": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_AUTOUPDATER": "1",
    "OPENCODE_DISABLE_MODELS_FETCH": "1",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "HOME": f"{SCRATCH}/home",
}


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _env(sandbox: Sandbox, extra: dict[str, str]) -> dict[str, str]:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", **OFFLINE_ENV}
    env.update(sandbox.runtime_env)
    env.update(extra)
    return env


def _classify_limits(result: ExecResult) -> str | None:
    if result.timed_out or result.killed_by in ("timeout", "wall"):
        return "timeout"
    if result.killed_by is not None:
        return "agent_error"  # the agent's own commands ran into a resource limit
    return None


def _run_record(result: ExecResult, status: str, started: float) -> HarnessRun:
    evidence = _tail(result.output)
    if result.killed_by:
        evidence = f"{evidence}\n[killed: {result.killed_by}]".strip()
    return HarnessRun(
        status=status,
        exit_code=result.exit_code,
        log_tail=evidence,
        duration_s=time.monotonic() - started,
    )


@dataclass(slots=True, kw_only=True)
class MiniHarness:
    """The built-in minimal agent (`mini_agent.py`), copied into the sandbox, run with python3."""

    name: ClassVar[str] = "mini"
    api: ClassVar[ApiShape] = "openai_chat"
    streams: ClassVar[bool] = False
    requires: ClassVar[Requirement] = Requirement(
        binary="python3", install="install python3 (the built-in agent runs with it)"
    )
    needs_runtime: ClassVar[bool] = False  # copies itself in; the sandbox's python3 runs it
    max_turns: int = 12
    max_tokens: int = 512
    temperature: float = 1.0
    seed: int | None = None
    compact_tokens: int = 0  # compact the context past this many prompt tokens (0: never)
    command_timeout: float = 60.0

    @property
    def main_system(self) -> str:
        """The agent's system prompt, bound to its session when the session opens."""
        from legorl.harnesses.mini_agent import SYSTEM

        return SYSTEM

    async def run(self, sandbox: Sandbox, prompt: str, *, model: str, timeout: float) -> HarnessRun:
        started = time.monotonic()
        await sandbox.write_file(f"{SCRATCH}/mini_agent.py", (HERE / "mini_agent.py").read_bytes())
        await sandbox.write_file(f"{SCRATCH}/task.md", prompt.encode())
        if sandbox.proxy_url is None:
            raise ValueError("the mini harness needs a sandbox started with a proxy_url")
        cmd = [
            "python3",
            f"{SCRATCH}/mini_agent.py",
            "--base-url",
            f"{sandbox.proxy_url}/v1",
            "--task",
            f"{SCRATCH}/task.md",
            "--cwd",
            sandbox.workdir,
            "--model",
            model,
            "--max-turns",
            str(self.max_turns),
            "--max-tokens",
            str(self.max_tokens),
            "--temperature",
            str(self.temperature),
            "--compact-tokens",
            str(self.compact_tokens),
            "--command-timeout",
            str(self.command_timeout),
        ]
        if self.seed is not None:
            cmd += ["--seed", str(self.seed)]
        result = await sandbox.exec(
            cmd, timeout=timeout, cwd=sandbox.workdir, env=_env(sandbox, {})
        )
        status = _classify_limits(result) or {0: "ok", 3: "agent_error", 4: "proxy_error"}.get(
            result.exit_code if result.exit_code is not None else -1, "harness_crash"
        )
        return _run_record(result, status, started)


@dataclass(slots=True, kw_only=True)
class ClaudeCodeHarness:
    """Claude Code in print mode, configured only through its environment and flags."""

    name: ClassVar[str] = "claude-code"
    api: ClassVar[ApiShape] = "anthropic"
    streams: ClassVar[bool] = True
    requires: ClassVar[Requirement] = Requirement(
        binary="claude", install="npm install -g @anthropic-ai/claude-code"
    )
    needs_runtime: ClassVar[bool] = True  # binaries from the sandbox's harness-runtime layer
    max_turns: int = 30
    allowed_tools: tuple[str, ...] = ("Bash", "Edit", "Write", "Read", "Glob", "Grep")
    # Claude's own `--tools` (say "Bash,Edit,Read"): only these tools' schemas are sent, which
    # shortens every request; None sends its default set (about 74 KB of schemas)
    tools: str | None = None

    async def run(self, sandbox: Sandbox, prompt: str, *, model: str, timeout: float) -> HarnessRun:
        started = time.monotonic()
        await sandbox.write_file(f"{SCRATCH}/home/.keep", b"")
        cmd = [
            "claude",
            "-p",
            prompt,
            "--output-format",
            "json",
            "--model",
            model,
            "--max-turns",
            str(self.max_turns),
            "--allowedTools",
            *self.allowed_tools,
        ]
        if self.tools is not None:
            cmd += ["--tools", self.tools]
        env = _env(
            sandbox,
            {"ANTHROPIC_BASE_URL": sandbox.proxy_url or "", "ANTHROPIC_API_KEY": "sk-legorl"},
        )
        result = await sandbox.exec(cmd, timeout=timeout, cwd=sandbox.workdir, env=env)
        status = _classify_limits(result)
        if status is None:
            report = _last_json(result.output)
            if report is None:
                status = "harness_crash"
            elif not report.get("is_error"):
                status = "ok"
            elif report.get("api_error_status") or "API Error" in str(report.get("result")):
                status = "proxy_error"
            else:
                status = "agent_error"  # e.g. error_max_turns
        return _run_record(result, status, started)


@dataclass(slots=True, kw_only=True)
class OpenCodeHarness:
    """OpenCode's `run` mode with an openai-compatible provider pointing at the proxy."""

    name: ClassVar[str] = "opencode"
    api: ClassVar[ApiShape] = "openai_chat"
    streams: ClassVar[bool] = True
    requires: ClassVar[Requirement] = Requirement(
        binary="opencode", install="npm install -g opencode-ai"
    )
    needs_runtime: ClassVar[bool] = True  # binaries from the sandbox's harness-runtime layer

    async def run(self, sandbox: Sandbox, prompt: str, *, model: str, timeout: float) -> HarnessRun:
        started = time.monotonic()
        config = {
            "$schema": "https://opencode.ai/config.json",
            "provider": {
                "legorl": {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "legorl",
                    "options": {"baseURL": f"{sandbox.proxy_url}/v1", "apiKey": "sk-legorl"},
                    "models": {
                        model: {"name": model, "limit": {"context": 200000, "output": 8192}}
                    },
                }
            },
            "model": f"legorl/{model}",
        }
        await sandbox.write_file(f"{SCRATCH}/opencode.json", json.dumps(config).encode())
        await sandbox.write_file(f"{SCRATCH}/home/.keep", b"")
        env = _env(sandbox, {"OPENCODE_CONFIG": f"{SCRATCH}/opencode.json", "PWD": sandbox.workdir})
        result = await sandbox.exec(
            ["opencode", "run", "--model", f"legorl/{model}", prompt],
            timeout=timeout,
            cwd=sandbox.workdir,
            env=env,
        )
        status = _classify_limits(result)
        if status is None:
            if result.exit_code == 0:
                status = "ok"
            elif "Cannot connect to API" in result.output or "APIError" in result.output:
                status = "proxy_error"
            else:
                status = "harness_crash"
        return _run_record(result, status, started)


@dataclass(slots=True, kw_only=True)
class OpenHandsHarness:
    """The OpenHands SDK agent (terminal + file editor tools) driven by `openhands_driver.py`."""

    name: ClassVar[str] = "openhands-sdk"
    api: ClassVar[ApiShape] = "openai_chat"
    streams: ClassVar[bool] = False
    requires: ClassVar[Requirement] = Requirement(
        python="openhands",
        module="openhands.sdk",
        install=(
            "python3.12 -m venv .venv-openhands && .venv-openhands/bin/pip install "
            "openhands-sdk openhands-tools (or set LEGORL_OPENHANDS_PYTHON)"
        ),
    )
    needs_runtime: ClassVar[bool] = True  # binaries from the sandbox's harness-runtime layer

    async def run(self, sandbox: Sandbox, prompt: str, *, model: str, timeout: float) -> HarnessRun:
        started = time.monotonic()
        driver = f"{SCRATCH}/openhands_driver.py"
        await sandbox.write_file(driver, (HERE / "openhands_driver.py").read_bytes())
        await sandbox.write_file(f"{SCRATCH}/home/.keep", b"")
        python = sandbox.openhands_python or default_openhands_python()
        result = await sandbox.exec(
            [python, driver, f"{sandbox.proxy_url}/v1", sandbox.workdir, prompt],
            timeout=timeout,
            cwd=sandbox.workdir,
            env=_env(sandbox, {}),
        )
        status = _classify_limits(result)
        if status is None:
            if result.exit_code == 0 and "openhands-run: finished" in result.output:
                status = "ok"
            elif "APIConnectionError" in result.output or "ServiceUnavailable" in result.output:
                status = "proxy_error"
            else:
                status = "harness_crash"
        return _run_record(result, status, started)


def default_openhands_python() -> str:
    return default_venv_python("openhands")


def default_venv_python(venv: str) -> str:
    """The host's Python for a harness that lives in its own venv (``openhands``, ``miniswe``):
    ``$LEGORL_<VENV>_PYTHON``, else ``.venv-<venv>/bin/python`` in or above the working folder
    or the package, else Python 3.12 on PATH."""
    env = os.environ.get(f"LEGORL_{venv.upper()}_PYTHON")
    if env:
        return env
    for base in (Path.cwd(), *HERE.parents):
        cand = base / f".venv-{venv}" / "bin" / "python"
        if cand.exists():
            return str(cand)
    return "python3.12"


def _last_json(text: str) -> dict[str, Any] | None:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            return value if isinstance(value, dict) else None
    return None


from legorl.harnesses.codex import CodexHarness  # noqa: E402 - it uses the helpers above

#: Harness classes by short name.
HARNESSES: Registry[Harness] = Registry(
    "harness",
    {
        "mini": MiniHarness,
        "claude-code": ClaudeCodeHarness,
        "opencode": OpenCodeHarness,
        "openhands-sdk": OpenHandsHarness,
        "codex": CodexHarness,
    },
)


def _register_modules() -> None:
    # Harnesses in modules of their own import this package's helpers, so they register here,
    # after those exist.
    from legorl.harnesses.gemini_cli import GeminiCliHarness
    from legorl.harnesses.mini_swe_agent import MiniSweAgentHarness
    from legorl.harnesses.qwen_code import QwenCodeHarness

    for cls in (GeminiCliHarness, QwenCodeHarness, MiniSweAgentHarness):
        HARNESSES.register(cls.name, cls)


_register_modules()


def make_harness(name: str, **config: Any) -> Harness:
    """The harness ``name`` (or ``module:Class``) with ``config`` (its dataclass fields);
    unknown names and keys are ``ConfigError``s."""
    return HARNESSES.build(name, **config)
