"""Every harness through `legorl proxy intercept`: HTTPS_PROXY plus the proxy's CA, the harness
left on its own API host (api.openai.com), other hosts refused. Qwen Code, mini-swe-agent,
OpenCode and the OpenHands SDK each run a tool round trip scripted by the `forced` engine (a fake
shipping in the package: scripted completions, log-probs from a real forward pass of the tiny
model); Claude Code's is `test_claude_code_through_intercept` beside these. Under CI=true a
missing harness fails the test; elsewhere it skips.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import pytest
from proxy_harness import ROOT
from test_harness_e2e import _assert_round_trip, _need, _run, _script, _turns, legorl_proxy


def _ca_and_refusal(port: int, data: Path) -> Path:
    ca = data / "mitmproxy" / "mitmproxy-ca-cert.pem"
    deadline = time.monotonic() + 60
    while not ca.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    refused = httpx.get("http://example.com/", proxy=f"http://127.0.0.1:{port}", timeout=30)
    assert refused.status_code == 403
    return ca


def _proxy_env(port: int, ca: Path) -> dict[str, str]:
    return {
        "HTTPS_PROXY": f"http://127.0.0.1:{port}",
        "https_proxy": f"http://127.0.0.1:{port}",
        "NODE_EXTRA_CA_CERTS": str(ca),
        "SSL_CERT_FILE": str(ca),
        "REQUESTS_CA_BUNDLE": str(ca),
    }


@pytest.mark.xfail(
    reason=(
        "measured here: Qwen Code 0.24.4 on Node 20.20 with HTTPS_PROXY fails inside its own "
        "HTTP client ('Value of \"this\" must be of DOMException') before any call reaches the "
        "proxy; not yet known whether a newer Node fixes it"
    ),
    strict=False,
)
def test_qwen_code_through_intercept(tmp_path: Path) -> None:
    qwen = _need(shutil.which("qwen"), "Qwen Code (npm @qwen-code/qwen-code)")
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    (home / ".qwen").mkdir(parents=True)
    (home / ".qwen" / "settings.json").write_text(
        json.dumps({"privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False}})
    )
    script = _script(
        "run_shell_command",
        {"command": "echo qwen-intercepted > out.txt && cat out.txt", "description": "write"},
        "qwen-intercepted",
        "Done through the proxy.",
    )
    with legorl_proxy(tmp_path, "intercept", script) as (port, out, data):
        ca = _ca_and_refusal(port, data)
        stdout = _run(
            [qwen, "--auth-type", "openai", "--yolo", "-o", "json", "legorl-e2e: write the file"],
            work,
            {
                **_proxy_env(port, ca),
                "HOME": str(home),
                "OPENAI_API_KEY": "qwen-intercepted",
                "OPENAI_MODEL": "tiny",
                "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1",
            },
            timeout=600,
        )
        turns = _turns(out, "qwen-intercepted")
    assert json.loads(stdout.strip().splitlines()[-1])[-1]["result"] == "Done through the proxy."
    assert (work / "out.txt").read_text() == "qwen-intercepted\n"
    _assert_round_trip(turns, script, 1, 2)


def _miniswe_python() -> str:
    from legorl.harnesses import default_venv_python

    return default_venv_python("miniswe")


def test_mini_swe_agent_through_intercept(tmp_path: Path) -> None:
    python = _need(_miniswe_python(), "the mini-swe-agent venv (.venv-miniswe)")
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    call = json.dumps(
        {"name": "bash", "arguments": {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}}
    )
    script = _script(
        "bash",
        {"command": "echo miniswe-intercepted > out.txt && cat out.txt"},
        "miniswe-intercepted",
        "",
    )
    script[2]["text"] = f"Submitting.\n<tool_call>\n{call}\n</tool_call>"
    config = tmp_path / "miniswe.yaml"
    # No api_base: litellm's openai provider keeps its own host, api.openai.com.
    config.write_text(
        json.dumps(
            {
                "model": {
                    "model_name": "openai/tiny",
                    "cost_tracking": "ignore_errors",
                    "model_kwargs": {"api_key": "miniswe-intercepted"},
                },
                "agent": {"step_limit": 6, "cost_limit": 0},
            }
        )
    )
    trajectory = tmp_path / "traj.json"
    with legorl_proxy(tmp_path, "intercept", script) as (port, out, data):
        ca = _ca_and_refusal(port, data)
        _run(
            [
                python,
                "-m",
                "minisweagent.run.mini",
                "-c",
                "mini.yaml",
                "-c",
                str(config),
                "--yolo",
                "--exit-immediately",
                "-t",
                "legorl-e2e: write the file",
                "-o",
                str(trajectory),
            ],
            work,
            {
                **_proxy_env(port, ca),
                "HOME": str(home),
                "MSWEA_CONFIGURED": "true",
                "MSWEA_SILENT_STARTUP": "1",
                "MSWEA_GLOBAL_CONFIG_DIR": str(home / "mswea"),
            },
        )
        turns = _turns(out, "miniswe-intercepted")
    assert json.loads(trajectory.read_text())["info"]["exit_status"] == "Submitted"
    assert (work / "out.txt").read_text() == "miniswe-intercepted\n"
    _assert_round_trip(turns, script, 1, 2)


def test_opencode_through_intercept(tmp_path: Path) -> None:
    opencode = _need(shutil.which("opencode"), "OpenCode (npm opencode-ai)")
    work = tmp_path / "work"
    work.mkdir()
    script = _script(
        "bash",
        {"command": "echo oc-intercepted > out.txt && cat out.txt", "description": "write"},
        "oc-intercepted",
        "Done through the proxy.",
    )
    # The provider keeps OpenAI's own host; only the proxy and the CA are new.
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "legorl": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "legorl",
                "options": {"baseURL": "https://api.openai.com/v1", "apiKey": "oc-intercepted"},
                "models": {"tiny": {"name": "tiny", "limit": {"context": 200000, "output": 4096}}},
            }
        },
        "model": "legorl/tiny",
    }
    (work / "opencode.json").write_text(json.dumps(config))
    with legorl_proxy(tmp_path, "intercept", script) as (port, out, data):
        ca = _ca_and_refusal(port, data)
        stdout = _run(
            [opencode, "run", "--model", "legorl/tiny", "legorl-e2e: write the file"],
            work,
            {**_proxy_env(port, ca), "OPENCODE_CONFIG": str(work / "opencode.json")},
        )
        turns = _turns(out, "oc-intercepted")
    assert "Done through the proxy." in stdout
    assert (work / "out.txt").read_text() == "oc-intercepted\n"
    _assert_round_trip(turns, script, 1, 2)


def test_openhands_sdk_through_intercept(tmp_path: Path) -> None:
    from test_harness_e2e import _openhands_python

    python = _need(_openhands_python(), "the OpenHands SDK venv (Python 3.12)")
    work = tmp_path / "work"
    work.mkdir()
    script = _script(
        "terminal", {"command": "echo oh-intercepted > out.txt"}, "<tool_response>", ""
    )
    finish = json.dumps({"name": "finish", "arguments": {"message": "Done."}})
    script[2]["text"] = f"<tool_call>\n{finish}\n</tool_call>"
    # The driver takes the API base as it is: here OpenAI's own, reached through the proxy.
    with legorl_proxy(tmp_path, "intercept", script) as (port, out, data):
        ca = _ca_and_refusal(port, data)
        stdout = _run(
            [
                python,
                str(ROOT / "src/legorl/harnesses/openhands_driver.py"),
                "https://api.openai.com/v1",
                str(work),
                "legorl-e2e: write the file",
            ],
            work,
            _proxy_env(port, ca),
        )
        turns = _turns(out, "sk-legorl")
    assert "openhands-run: finished" in stdout
    assert (work / "out.txt").read_text() == "oh-intercepted\n"
    _assert_round_trip(turns, script, 1, 2)
