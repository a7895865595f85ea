"""Gemini CLI (npm ``@google/gemini-cli``) in non-interactive mode against a proxy session:

    legorl rollout --harness gemini-cli --tasks fixtures/tasks/train.jsonl …

It is configured only through its own environment and settings file: ``GOOGLE_GEMINI_BASE_URL``
(the session's route), ``GEMINI_API_KEY``, and ``$HOME/.gemini/settings.json`` choosing the API
key auth type with telemetry, usage statistics, update checks and folder trust off. It calls
``POST …/v1beta/models/{model}:streamGenerateContent?alt=sse`` (`legorl.proxy.wire.gemini`).
Its side calls (chat compression, loop detection, the next-speaker check when enabled) carry
their own system instruction and no tools, so the proxy files them as auxiliary sub-sessions.

Exit classification, from its exit codes and its ``--output-format json`` report: 0 with a
``response`` is ok; 53 (the session's turn limit) is the agent's doing; a report whose error
came back from the API is a proxy error; anything else (41 auth, 52 config, a crash) is the
harness's.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from legorl.harnesses import SCRATCH, _classify_limits, _env, _run_record
from legorl.protocols import ApiShape, HarnessRun, Requirement, Sandbox

#: Its settings file: API-key auth, nothing phoned home, no update checks, no trust prompt.
SETTINGS: dict[str, Any] = {
    "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False},
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
    "security": {"auth": {"selectedType": "gemini-api-key"}, "folderTrust": {"enabled": False}},
}
NPM_PACKAGE = "@google/gemini-cli@0.61.0"  # the version whose traffic the wire module follows
TURN_LIMIT_EXIT = 53  # FatalTurnLimitedError: model.maxSessionTurns reached


def settings(max_turns: int) -> dict[str, Any]:
    return {**SETTINGS, "model": {"maxSessionTurns": max_turns}}


def environment(base_url: str, api_key: str = "sk-legorl") -> dict[str, str]:
    """What points Gemini CLI at a proxy route; HOME must hold ``settings()``."""
    return {"GOOGLE_GEMINI_BASE_URL": base_url, "GEMINI_API_KEY": api_key}


def report(output: str) -> dict[str, Any] | None:
    """The last JSON object in ``output`` that starts a line (the report is pretty-printed)."""
    decoder = json.JSONDecoder()
    start = len(output)
    while (start := output.rfind("{", 0, start)) >= 0:
        if start == 0 or output[start - 1] == "\n":
            try:
                value, _ = decoder.raw_decode(output, start)
            except json.JSONDecodeError:
                continue
            return value if isinstance(value, dict) else None
    return None


def classify(exit_code: int | None, output: str) -> str:
    """The run's status from Gemini CLI's exit code and its JSON report."""
    report_ = report(output)
    if exit_code == 0 and report_ is not None and "response" in report_:
        return "ok"
    if exit_code == TURN_LIMIT_EXIT:
        return "agent_error"
    error = report_.get("error") if report_ is not None else None
    if isinstance(error, dict) and (error.get("code") or "ApiError" in str(error.get("type"))):
        return "proxy_error"
    return "harness_crash"


@dataclass(slots=True, kw_only=True)
class GeminiCliHarness:
    """Gemini CLI's ``-p`` mode with every tool call approved (``--yolo``)."""

    name: ClassVar[str] = "gemini-cli"
    api: ClassVar[ApiShape] = "gemini"
    streams: ClassVar[bool] = True
    requires: ClassVar[Requirement] = Requirement(
        binary="gemini", install=f"npm install -g {NPM_PACKAGE}"
    )
    needs_runtime: ClassVar[bool] = True  # binaries from the sandbox's harness-runtime layer
    max_turns: int = 30

    async def run(self, sandbox: Sandbox, prompt: str, *, model: str, timeout: float) -> HarnessRun:
        started = time.monotonic()
        if sandbox.proxy_url is None:
            raise ValueError("the gemini-cli harness needs a sandbox started with a proxy_url")
        home = f"{SCRATCH}/home"
        await sandbox.write_file(
            f"{home}/.gemini/settings.json", json.dumps(settings(self.max_turns)).encode()
        )
        cmd = ["gemini", "-p", prompt, "--yolo", "--output-format", "json", "--model", model]
        env = _env(sandbox, environment(sandbox.proxy_url))
        result = await sandbox.exec(cmd, timeout=timeout, cwd=sandbox.workdir, env=env)
        status = _classify_limits(result) or classify(result.exit_code, result.output)
        return _run_record(result, status, started)
