"""The gemini-cli harness: `legorl check` knows its binary, its install line and its API (the
proxy probe answers Gemini's shape, streamed and not, and records a Turn), and its exit
classification reads Gemini CLI's real exit codes and JSON report."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from legorl.check import CheckResult, RunConfig, check_engine, check_harness, check_proxy
from legorl.harnesses import HARNESSES, make_harness
from legorl.harnesses.gemini_cli import NPM_PACKAGE, TURN_LIMIT_EXIT, classify, report

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "fixtures" / "models" / "tiny-qwen3"

# Tails of Gemini CLI 0.61.0's real output (--output-format json), trimmed.
OK = """YOLO mode is enabled. All tool calls will be automatically approved.
Ripgrep is not available. Falling back to GrepTool.
{
  "session_id": "6b3ff06b",
  "response": "The file was written.",
  "stats": {"models": {}}
}"""
API_ERROR = """Error when talking to Gemini API Full report available at: /tmp/gemini-client-error.json
  status: 400
}
{
  "session_id": "3ac13c89-d10a-4bbe-9fe1-4a1f955cab99",
  "error": {
    "type": "Error",
    "message": "{\\"error\\":{\\"code\\":400,\\"message\\":\\"the episode's budget is spent\\"}}",
    "code": 400
  }
}"""
API_ERROR_EXIT = 144  # what 0.61.0 exits with when the API answered an error


def test_check_says_how_to_install_gemini_cli(tmp_path: Path) -> None:
    missing = check_harness("gemini-cli", path=str(tmp_path))
    assert (missing.status, missing.reason) == ("fail", "gemini is not on PATH")
    assert (
        missing.fix == "npm install -g @google/gemini-cli@0.61.0" == f"npm install -g {NPM_PACKAGE}"
    )
    cls = HARNESSES["gemini-cli"]
    assert (cls.api, cls.streams, cls.needs_runtime) == ("gemini", True, True)
    assert make_harness("gemini-cli", max_turns=3).max_turns == 3  # type: ignore[attr-defined]


def test_the_proxy_probe_answers_gemini() -> None:
    streamed = RunConfig(model=str(MODEL), engine="forced", harnesses=["gemini-cli"])
    plain = RunConfig(model=str(MODEL), engine="forced", harnesses=[], apis=["gemini"])

    async def go() -> list[CheckResult]:
        _, engine = await check_engine(streamed)
        try:
            return [*await check_proxy(streamed, engine), *await check_proxy(plain, engine)]
        finally:
            await engine.close()

    results = asyncio.run(go())
    assert [(r.name, r.status) for r in results] == [
        ("proxy: gemini (gemini-cli)", "pass"),
        ("proxy: gemini", "pass"),
    ], results
    assert results[0].reason.startswith(
        "streaming /v1beta/models/legorl-check:streamGenerateContent?alt=sse answered"
    )
    assert results[1].reason.startswith("non-streaming /v1beta/models/legorl-check:generateContent")


def test_exit_classification() -> None:
    assert report(OK) == {
        "session_id": "6b3ff06b",
        "response": "The file was written.",
        "stats": {"models": {}},
    }
    assert classify(0, OK) == "ok"
    assert classify(API_ERROR_EXIT, API_ERROR) == "proxy_error"
    assert classify(TURN_LIMIT_EXIT, "Reached max session turns") == "agent_error"
    assert classify(41, "Invalid auth method selected.") == "harness_crash"
    assert classify(0, "no report at all") == "harness_crash"
    broken = OK.replace('"stats"', "stats")  # a report that does not parse is no report
    assert report(broken) is None or "response" not in (report(broken) or {})
    assert json.loads(OK[OK.index("{") :])["response"] == "The file was written."
