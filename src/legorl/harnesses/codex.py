"""Codex CLI (npm ``@openai/codex``) in ``codex exec`` mode, unmodified, against a proxy session.

    harness = make_harness("codex")
    run = await harness.run(sandbox, task.problem_statement, model="tiny", timeout=600)

Codex ignores ``OPENAI_BASE_URL`` for anything but its built-in provider, so the harness writes
its own ``config.toml`` under the scratch HOME (``$CODEX_HOME``): a custom model provider whose
``base_url`` is the session's route, ``wire_api = "responses"`` and an ``env_key`` holding a
dummy key (no login). The same file switches off what would reach other hosts (update checks,
analytics, plugin sync, web search) and what a one-shot agent does not need (goals, shell
snapshots, more than one agent thread), bounds Codex's retries, and lets commands run without
approval: the legorl sandbox is the sandbox. Codex's ``--json`` event stream says how the run
ended.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from legorl.harnesses import SCRATCH, _classify_limits, _env, _run_record
from legorl.protocols import ApiShape, HarnessRun, Requirement, Sandbox

CODEX_HOME = f"{SCRATCH}/home/.codex"
API_KEY_ENV = "LEGORL_API_KEY"
# Codex's words (0.169, measured) for a call the proxy did not answer: nothing listening, an HTTP
# error status, or a stream that ended without response.completed (the proxy's `error` event).
_PROXY_FAILURES = ("Connection failed", "unexpected status", "stream disconnected")


def codex_config(base_url: str, model: str, *, retries: int = 1) -> str:
    """``$CODEX_HOME/config.toml`` pointing Codex at ``base_url`` (ending in ``/v1``)."""
    q = json.dumps  # a JSON string is a valid TOML basic string
    return f"""\
model = {q(model)}
model_provider = "legorl"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false
web_search = "disabled"

[analytics]
enabled = false

[features]
plugins = false
goals = false
shell_snapshot = false
unbounded_connection_retries = false

[agents]
max_threads = 1

[model_providers.legorl]
name = "legorl"
base_url = {q(base_url)}
env_key = "{API_KEY_ENV}"
wire_api = "responses"
request_max_retries = {retries}
stream_max_retries = {retries}
"""


def classify_codex(exit_code: int | None, output: str) -> str:
    """ok / agent_error / proxy_error / harness_crash from ``codex exec --json``'s output.

    Only Codex's last event counts, together with its exit code: whatever lines came before
    (the agent's commands can print JSON too) cannot turn a run that ended otherwise into one
    that looks finished or looks like the proxy's fault."""
    last: dict[str, Any] | None = None
    for line in output.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict) and isinstance(event.get("type"), str):
                last = event
    if last is None:
        return "harness_crash"  # never started a turn: a config it refused, a crash
    if last["type"] == "turn.completed":
        return "ok" if exit_code == 0 else "harness_crash"
    if last["type"] != "turn.failed" or exit_code != 1:
        return "harness_crash"  # died inside a turn
    error = last.get("error")
    message = str(error.get("message", "")) if isinstance(error, dict) else ""
    if any(words in message for words in _PROXY_FAILURES):
        return "proxy_error"
    return "agent_error"


@dataclass(slots=True, kw_only=True)
class CodexHarness:
    """Codex CLI's ``exec`` mode with a custom Responses provider pointing at the proxy."""

    name: ClassVar[str] = "codex"
    api: ClassVar[ApiShape] = "responses"
    streams: ClassVar[bool] = True
    requires: ClassVar[Requirement] = Requirement(
        binary="codex", install="npm install -g @openai/codex@0.169.0"
    )
    needs_runtime: ClassVar[bool] = True  # binaries from the sandbox's harness-runtime layer
    retries: int = 1  # Codex's own request and stream retries

    async def run(self, sandbox: Sandbox, prompt: str, *, model: str, timeout: float) -> HarnessRun:
        started = time.monotonic()
        if sandbox.proxy_url is None:
            raise ValueError("the codex harness needs a sandbox started with a proxy_url")
        config = codex_config(f"{sandbox.proxy_url}/v1", model, retries=self.retries)
        await sandbox.write_file(f"{CODEX_HOME}/config.toml", config.encode())
        args = ["--skip-git-repo-check", "--ephemeral", "--json", "-C", sandbox.workdir, prompt]
        # stdin from /dev/null: exec mode appends a piped stdin to the prompt and waits for it.
        cmd = ["sh", "-c", 'exec codex exec "$@" </dev/null', "codex", *args]
        env = _env(sandbox, {"CODEX_HOME": CODEX_HOME, API_KEY_ENV: "sk-legorl"})
        result = await sandbox.exec(cmd, timeout=timeout, cwd=sandbox.workdir, env=env)
        status = _classify_limits(result) or classify_codex(result.exit_code, result.output)
        run = _run_record(result, status, started)
        # Codex prints the URL it failed on; the route's secret stays out of the record.
        run.log_tail = run.log_tail.replace(sandbox.proxy_url, _redacted(sandbox.proxy_url))
        return run


def _redacted(url: str) -> str:
    head, sep, _ = url.rpartition("~")
    return f"{head}~…" if sep else url
