"""Qwen Code (npm ``@qwen-code/qwen-code``), unmodified, in headless mode against a proxy session.

    legorl rollout --tasks tasks.jsonl --harness qwen-code --model fixtures/models/tiny-qwen3 …

Configured only through its own environment (``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and
``OPENAI_MODEL`` select its OpenAI-compatible auth) and a ``settings.json`` in its home folder
that turns off usage statistics and auto-update. It runs as ``qwen --auth-type openai --yolo -o json PROMPT``: every
tool call is approved, and the last line of its output is a JSON list of events whose final
``result`` event says how the run ended. Its traffic is OpenAI Chat, streamed (SSE with
``stream_options.include_usage``), one call per turn; it lists no models and makes no auxiliary
calls in headless mode.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from legorl.harnesses import SCRATCH, _classify_limits, _env, _run_record
from legorl.protocols import ApiShape, ExecResult, HarnessRun, Requirement, Sandbox

SETTINGS = {
    "privacy": {"usageStatisticsEnabled": False},
    "general": {"enableAutoUpdate": False},
    "telemetry": {"enabled": False},
}


def result_event(output: str) -> dict[str, Any] | None:
    """The final ``result`` event of ``qwen -o json`` output (None when there is none)."""
    for line in reversed(output.strip().splitlines()):
        line = line.strip()
        if not line.startswith("["):
            continue
        try:
            events = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(events, list):
            for event in reversed(events):
                if isinstance(event, dict) and event.get("type") == "result":
                    return event
        return None
    return None


def classify(result: ExecResult) -> str:
    """ok / agent_error / proxy_error / harness_crash from Qwen Code's own report."""
    status = _classify_limits(result)
    if status is not None:
        return status
    event = result_event(result.output)
    if event is None:
        return "harness_crash"
    if not event.get("is_error") and result.exit_code == 0:
        return "ok"
    text = json.dumps(event.get("error") or event.get("result") or "")
    if "API Error" in text or "Connection error" in text or "status" in text.lower():
        return "proxy_error"
    return "agent_error"  # e.g. the turn limit


@dataclass(slots=True, kw_only=True)
class QwenCodeHarness:
    """Qwen Code headless (``qwen --yolo -o json``), configured only through env and settings."""

    name: ClassVar[str] = "qwen-code"
    api: ClassVar[ApiShape] = "openai_chat"
    streams: ClassVar[bool] = True
    requires: ClassVar[Requirement] = Requirement(
        binary="qwen", install="npm install -g @qwen-code/qwen-code@0.24.4"
    )
    needs_runtime: ClassVar[bool] = True  # binaries from the sandbox's harness-runtime layer
    max_turns: int = 30

    async def run(self, sandbox: Sandbox, prompt: str, *, model: str, timeout: float) -> HarnessRun:
        started = time.monotonic()
        if sandbox.proxy_url is None:
            raise ValueError("the qwen-code harness needs a sandbox started with a proxy_url")
        await sandbox.write_file(
            f"{SCRATCH}/home/.qwen/settings.json", json.dumps(SETTINGS).encode()
        )
        env = _env(
            sandbox,
            {
                "OPENAI_BASE_URL": f"{sandbox.proxy_url}/v1",
                "OPENAI_API_KEY": "sk-legorl",
                "OPENAI_MODEL": model,
                "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1",
            },
        )
        cmd = [
            "qwen",
            "--auth-type",
            "openai",  # chosen by OPENAI_BASE_URL alone otherwise; say it, as intercept needs
            "--yolo",
            "-o",
            "json",
            "--max-session-turns",
            str(self.max_turns),
            prompt,
        ]
        result = await sandbox.exec(cmd, timeout=timeout, cwd=sandbox.workdir, env=env)
        return _run_record(result, classify(result), started)
