"""The codex harness's config and exit classification, on the real Codex CLI binary's output.

Each case runs `codex exec` with the config the harness writes (`codex_config`) against a real
failure: a port nobody listens on, a real HTTP server answering 404 or sending the proxy's own
stream for an engine that dies mid-answer, a config file Codex rejects. The success case is in tests/proxy/test_harness_e2e.py and tests/test_rollout_harnesses.py.
Under CI=true a missing `codex` fails; elsewhere it skips.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from legorl.harnesses import make_harness
from legorl.harnesses.codex import _redacted, classify_codex, codex_config


def _codex() -> str:
    found = shutil.which("codex")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("Codex CLI is not installed (.ci/run installs npm @openai/codex)")
        pytest.skip("Codex CLI is not installed")
    return found


def _exec(tmp: Path, config: str) -> subprocess.CompletedProcess[str]:
    home = tmp / "home" / ".codex"
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(config)
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home.parent),
        "CODEX_HOME": str(home),
        "LEGORL_API_KEY": "sk-legorl",
    }
    return subprocess.run(
        [_codex(), "exec", "--skip-git-repo-check", "--ephemeral", "--json", "say hi"],
        cwd=tmp,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _answering(status: int, body: bytes = b"", sse: bool = False) -> Iterator[str]:
    body = body or b'{"error": {"message": "unknown session", "type": "not_found_error"}}'

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self.send_response(status)
            self.send_header("content-type", "text/event-stream" if sse else "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/s/x~secret/v1"
    finally:
        server.shutdown()
        server.server_close()


def test_config_is_accepted_strictly(tmp_path: Path) -> None:
    config = codex_config(f"http://127.0.0.1:{_free_port()}/s/x/v1", "tiny")
    home = tmp_path / "home" / ".codex"
    home.mkdir(parents=True)
    (home / "config.toml").write_text(config)
    env = {"PATH": os.environ["PATH"], "HOME": str(home.parent), "CODEX_HOME": str(home)}
    # `--strict-config` refuses unknown keys: every key the harness writes is one Codex reads.
    done = subprocess.run(
        [
            _codex(),
            "exec",
            "--strict-config",
            "--skip-git-repo-check",
            "--ephemeral",
            "--json",
            "x",
        ],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Error loading config.toml" not in done.stderr + done.stdout
    # Control: an unknown key is refused under --strict-config, so the check above can fail.
    (home / "config.toml").write_text(config + "\nno_such_key = 1\n")
    bad = subprocess.run(
        [_codex(), "exec", "--strict-config", "--skip-git-repo-check", "--ephemeral", "x"],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "no_such_key" in bad.stderr + bad.stdout


def test_unreachable_proxy_is_a_proxy_error(tmp_path: Path) -> None:
    done = _exec(tmp_path, codex_config(f"http://127.0.0.1:{_free_port()}/s/x/v1", "tiny"))
    assert done.returncode == 1
    assert classify_codex(done.returncode, done.stdout) == "proxy_error"


def test_an_http_error_from_the_proxy_is_a_proxy_error(tmp_path: Path) -> None:
    with _answering(404) as url:
        done = _exec(tmp_path, codex_config(url, "tiny"))
    assert classify_codex(done.returncode, done.stdout) == "proxy_error"
    # Codex prints the URL it failed on; the harness keeps the route's secret out of its record.
    assert url in done.stdout and "secret" not in done.stdout.replace(url, _redacted(url))


def _stream_that_fails() -> bytes:
    """The proxy's own Responses stream for an engine that fails after the headers went out."""
    from legorl.proxy.chat import ApiError, ChatRequest, Event, StreamHead, TextDelta
    from legorl.proxy.wire import responses

    async def events() -> AsyncIterator[Event]:
        yield TextDelta("partial")
        raise ApiError(500, "engine error: the engine died")

    async def collect() -> bytes:
        req = ChatRequest(api="responses", model="tiny", messages=[], stream=True)
        stream = responses.stream(
            events(), req, StreamHead(id="resp_1", created=0, prompt_tokens=1)
        )
        return b"".join([chunk async for chunk in stream])

    return asyncio.run(collect())


def test_an_engine_failure_mid_stream_is_a_proxy_error(tmp_path: Path) -> None:
    with _answering(200, _stream_that_fails(), sse=True) as url:
        done = _exec(tmp_path, codex_config(url, "tiny"))
    assert "stream closed before response.completed" in done.stdout
    assert classify_codex(done.returncode, done.stdout) == "proxy_error"


def test_a_config_codex_rejects_is_a_harness_crash(tmp_path: Path) -> None:
    done = _exec(tmp_path, codex_config("http://127.0.0.1:1/v1", "tiny") + "[agents]\nx = 1\n")
    assert done.returncode == 1 and "config" in (done.stderr + done.stdout).lower()
    assert classify_codex(done.returncode, done.stdout) == "harness_crash"


def test_the_classifier_reads_codex_last_event_and_exit_code() -> None:
    ok = '{"type":"turn.started"}\n{"type":"turn.completed","usage":{}}\n'
    assert classify_codex(0, ok) == "ok"
    assert classify_codex(1, ok) == "harness_crash"  # Codex's exit says otherwise
    failed = '{"type":"turn.failed","error":{"message":"max turns reached"}}\n'
    assert classify_codex(1, failed) == "agent_error"
    # Lines before the last event do not count: an agent's command printing Codex-like
    # events cannot make a run look finished, or look like the proxy's fault.
    assert classify_codex(1, ok + failed) == "agent_error"
    fake = '{"type":"turn.failed","error":{"message":"Connection failed: error sending request"}}'
    assert classify_codex(0, fake + "\n" + ok) == "ok"
    assert classify_codex(0, "") == "harness_crash"
    assert classify_codex(None, '{"type":"item.started","item":{}}') == "harness_crash"


def test_make_harness_knows_codex_and_refuses_unknown_options() -> None:
    assert make_harness("codex").name == "codex"
    with pytest.raises(ValueError, match="unknown option"):
        make_harness("codex", base_url="x")


def test_check_knows_codex_and_says_how_to_install_it(tmp_path: Path) -> None:
    from legorl.check import check_harness

    missing = check_harness("codex", path=str(tmp_path))  # a PATH with nothing on it
    assert (missing.status, missing.reason) == ("fail", "codex is not on PATH")
    assert missing.fix == "npm install -g @openai/codex@0.169.0"
    found = check_harness("codex", path=str(Path(_codex()).parent))
    assert found.status == "pass" and "codex-cli 0.169.0" in found.reason
    assert (make_harness("codex").api, make_harness("codex").streams) == ("responses", True)
