"""Gemini CLI (npm @google/gemini-cli, the real binary) against the real `legorl proxy` command
over HTTP: a tool round trip through `serve` at ``/s/{session}/v1beta/…`` (the `forced` engine,
a fake shipping in the package, scripts the completions; log-probs come from the tiny model),
and the same through `legorl proxy intercept` with HTTPS_PROXY and the proxy's CA, its API host
(generativelanguage.googleapis.com) unchanged. Under CI=true a missing binary fails the test.
"""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path

import httpx
from test_harness_e2e import _assert_round_trip, _need, _run, _script, _turns, legorl_proxy

from legorl.harnesses.gemini_cli import classify, environment, settings


def _gemini(tmp: Path) -> tuple[str, Path, Path]:
    gemini = _need(shutil.which("gemini"), "Gemini CLI (npm @google/gemini-cli)")
    work, home = tmp / "work", tmp / "home"
    work.mkdir()
    (home / ".gemini").mkdir(parents=True)
    (home / ".gemini" / "settings.json").write_text(json.dumps(settings(max_turns=10)))
    return gemini, work, home


def _command(gemini: str) -> list[str]:
    prompt = "legorl-e2e: write the file"
    return [gemini, "-p", prompt, "--yolo", "--output-format", "json", "--model", "gemini-2.5-pro"]


def test_gemini_cli_tool_round_trip(tmp_path: Path) -> None:
    gemini, work, home = _gemini(tmp_path)
    script = _script(
        "run_shell_command",
        {"command": "echo hello-from-gemini > out.txt && cat out.txt"},
        "hello-from-gemini",
        "The file was written.",
    )
    with legorl_proxy(tmp_path, "serve", script) as (port, out, _):
        base = f"http://127.0.0.1:{port}/s/gm"
        stdout = _run(_command(gemini), work, {"HOME": str(home), **environment(base)}, 400)
        turns = _turns(out, "gm")
    assert classify(0, stdout) == "ok"
    assert (work / "out.txt").read_text() == "hello-from-gemini\n"
    _assert_round_trip(turns, script, 1, 2)
    assert all(t.api == "gemini" and t.requested_model == "gemini-2.5-pro" for t in turns)
    main = [t for t in turns if not t.flags.aux]
    # Gemini CLI sends the call back with our id and its arguments re-printed its own way.
    assert main[1].flags.realigned >= 1


def test_gemini_cli_through_intercept(tmp_path: Path) -> None:
    gemini, work, home = _gemini(tmp_path)
    script = _script(
        "run_shell_command",
        {"command": "echo intercepted > out.txt && cat out.txt"},
        "intercepted",
        "Done through the proxy.",
    )
    with legorl_proxy(tmp_path, "intercept", script) as (port, out, data):
        ca = data / "mitmproxy" / "mitmproxy-ca-cert.pem"
        # mitmproxy starts slowly on a loaded machine: wait for it to listen, then for its CA.
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                time.sleep(0.5)
                continue
            if ca.exists():
                break
            time.sleep(0.2)
        refused = httpx.get("http://example.com/", proxy=f"http://127.0.0.1:{port}", timeout=30)
        assert refused.status_code == 403
        env = {
            "HOME": str(home),
            "HTTPS_PROXY": f"http://127.0.0.1:{port}",
            "NODE_EXTRA_CA_CERTS": str(ca),
            "GEMINI_API_KEY": "intercepted-session",
        }
        stdout = _run(_command(gemini), work, env, 400)
        turns = _turns(out, "intercepted-session")
    assert classify(0, stdout) == "ok"
    assert (work / "out.txt").read_text() == "intercepted\n"
    _assert_round_trip(turns, script, 1, 2)
