"""Real, unmodified harnesses against the real `legorl proxy` command over HTTP.

Claude Code, OpenCode, the OpenHands SDK and Codex CLI each run a tool round trip: the `forced`
engine (a fake that ships in the package: scripted completions, log-probs from a real forward
pass of the tiny model) makes the harness run a shell command that writes a file, then answers.
Claude Code and Codex also run through `legorl proxy intercept` with HTTPS_PROXY and the proxy's
CA, their API host unchanged. Under CI=true a missing harness fails the test; elsewhere it skips.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from proxy_harness import MODEL, ROOT, tokenizer

from legorl.records import Turn, read_jsonl, segment_prompts

IN_CI = os.environ.get("CI") == "true"
HARNESS_ENV = {
    "DISABLE_TELEMETRY": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_AUTOUPDATER": "1",
    "OPENCODE_DISABLE_MODELS_FETCH": "1",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
}


def _need(binary: str | None, what: str) -> str:
    if binary and Path(binary).exists():
        return binary
    message = f"{what} is not installed (.ci/run installs it)"
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def legorl_proxy(tmp: Path, mode: str, script: list[dict]) -> Iterator[tuple[int, Path, Path]]:
    """`legorl proxy serve|intercept` as a subprocess; yields (port, turns dir, data dir)."""
    script_file = tmp / "script.json"
    script_file.write_text(json.dumps(script))
    port, out, data = _free_port(), tmp / "turns", tmp / "data"
    log = open(tmp / f"proxy-{mode}.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "legorl.cli.main",
            "proxy",
            mode,
            "--model",
            str(MODEL),
            "--engine",
            "forced",
            "--script",
            str(script_file),
            "--engine-opt",
            "max_context=200000",
            "--port",
            str(port),
            "--out",
            str(out),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "LEGORL_DATA_DIR": str(data)},
    )
    try:
        # Generous: on a loaded machine loading the model and starting mitmproxy takes minutes.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp / f"proxy-{mode}.log").read_text()
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                time.sleep(0.2)
        yield port, out, data
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def _turns(out: Path, session: str) -> list[Turn]:
    return list(read_jsonl(out / f"{session}.jsonl", Turn))


def _assert_round_trip(turns: list[Turn], script: list[dict], first: int, second: int) -> None:
    """The engine's exact tokens were recorded, and the second call reused them raw."""
    tok = tokenizer()
    main = [t for t in turns if not t.flags.aux]
    assert len(main) == 2, [(t.session, t.output.text) for t in turns]
    for turn, entry in zip(main, (script[first], script[second]), strict=True):
        assert turn.completion_ids == tok.encode(entry["text"]) + [tok.eos_id]
        assert len(turn.completion_logprobs) == len(turn.completion_ids)
        assert all(lp <= 0 for lp in turn.completion_logprobs)
    assert [t.segment for t in main] == [0, 0]
    (_, p0), (_, p1) = segment_prompts(main)
    raw = p0 + main[0].completion_ids
    assert p1[: len(raw)] == raw, "the second prompt does not hold the first completion's tokens"
    assert main[1].prompt_offset == len(raw)


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 240) -> str:
    # PWD too: OpenCode takes its project folder from it, not from the process's cwd.
    env = {**os.environ, **HARNESS_ENV, "PWD": str(cwd), **env}
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, timeout=timeout, text=True)
    assert result.returncode == 0, (
        f"{cmd[0]} exited {result.returncode}:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    )
    return result.stdout


def _script(tool: str, args: dict, marker: str, finish: str) -> list[dict]:
    call = json.dumps({"name": tool, "arguments": args})
    return [
        {"match": "Generate a title", "text": "Write a file", "repeat": True},
        {"match": "legorl-e2e", "text": f"<tool_call>\n{call}\n</tool_call>"},
        {"match": marker, "text": finish, "repeat": True},
    ]


def test_claude_code_tool_round_trip(tmp_path: Path) -> None:
    claude = _need(shutil.which("claude"), "Claude Code (npm @anthropic-ai/claude-code)")
    work = tmp_path / "work"
    work.mkdir()
    script = _script(
        "Bash",
        {
            "command": "echo hello-from-claude > out.txt && cat out.txt",
            "description": "write a file",
        },
        "hello-from-claude",
        "The file was written.",
    )
    with legorl_proxy(tmp_path, "serve", script) as (port, out, _):
        stdout = _run(
            [
                claude,
                "-p",
                "legorl-e2e: write the file",
                "--output-format",
                "json",
                "--model",
                "claude-sonnet-4-5",
                "--allowedTools",
                "Bash",
            ],
            work,
            {
                "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}/s/cc",
                "ANTHROPIC_API_KEY": "sk-legorl",
            },
        )
        turns = _turns(out, "cc")
    assert json.loads(stdout)["result"] == "The file was written."
    assert (work / "out.txt").read_text() == "hello-from-claude\n"
    _assert_round_trip(turns, script, 1, 2)
    assert all(t.api == "anthropic" for t in turns)
    assert [t for t in turns if not t.flags.aux][1].flags.realigned >= 1


def test_claude_code_through_intercept(tmp_path: Path) -> None:
    claude = _need(shutil.which("claude"), "Claude Code (npm @anthropic-ai/claude-code)")
    work = tmp_path / "work"
    work.mkdir()
    script = _script(
        "Bash",
        {"command": "echo intercepted > out.txt && cat out.txt", "description": "write a file"},
        "intercepted",
        "Done through the proxy.",
    )
    with legorl_proxy(tmp_path, "intercept", script) as (port, out, data):
        ca = data / "mitmproxy" / "mitmproxy-ca-cert.pem"
        deadline = time.monotonic() + 30
        while not ca.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        # Other hosts are refused, never forwarded.
        refused = httpx.get("http://example.com/", proxy=f"http://127.0.0.1:{port}", timeout=30)
        assert refused.status_code == 403
        stdout = _run(
            [
                claude,
                "-p",
                "legorl-e2e: write the file",
                "--output-format",
                "json",
                "--model",
                "claude-sonnet-4-5",
                "--allowedTools",
                "Bash",
            ],
            work,
            {
                "HTTPS_PROXY": f"http://127.0.0.1:{port}",
                "NODE_EXTRA_CA_CERTS": str(ca),
                "ANTHROPIC_API_KEY": "intercepted-session",
            },
            timeout=150,
        )
        turns = _turns(out, "intercepted-session")
    assert json.loads(stdout)["result"] == "Done through the proxy."
    assert (work / "out.txt").read_text() == "intercepted\n"
    _assert_round_trip(turns, script, 1, 2)


def test_opencode_tool_round_trip_with_aux_title_call(tmp_path: Path) -> None:
    opencode = _need(shutil.which("opencode"), "OpenCode (npm opencode-ai)")
    work = tmp_path / "work"
    work.mkdir()
    script = _script(
        "bash",
        {
            "command": "echo hello-from-opencode > out.txt && cat out.txt",
            "description": "write a file",
        },
        "hello-from-opencode",
        "The file was written.",
    )
    with legorl_proxy(tmp_path, "serve", script) as (port, out, _):
        (work / "opencode.json").write_text(
            json.dumps(
                {
                    "$schema": "https://opencode.ai/config.json",
                    "provider": {
                        "legorl": {
                            "npm": "@ai-sdk/openai-compatible",
                            "name": "legorl",
                            "options": {
                                "baseURL": f"http://127.0.0.1:{port}/s/oc/v1",
                                "apiKey": "sk-legorl",
                            },
                            "models": {
                                "tiny": {
                                    "name": "tiny",
                                    "limit": {"context": 200000, "output": 4096},
                                }
                            },
                        }
                    },
                    "model": "legorl/tiny",
                }
            )
        )
        stdout = _run(
            [opencode, "run", "--model", "legorl/tiny", "legorl-e2e: write the file"],
            work,
            {"OPENCODE_CONFIG": str(work / "opencode.json")},
        )
        turns = _turns(out, "oc")
    assert "The file was written." in stdout
    assert (work / "out.txt").read_text() == "hello-from-opencode\n"
    aux = [t for t in turns if t.flags.aux]
    assert len(aux) == 1 and aux[0].output.text == "Write a file"
    assert aux[0].parent_session == "oc" and aux[0].session.startswith("oc~aux-")
    _assert_round_trip(turns, script, 1, 2)
    assert all(t.api == "openai_chat" for t in turns)


def _openhands_python() -> str | None:
    env = os.environ.get("LEGORL_OPENHANDS_PYTHON")
    return env or str(ROOT / ".venv-openhands" / "bin" / "python")


def test_openhands_sdk_tool_round_trip(tmp_path: Path) -> None:
    python = _need(_openhands_python(), "the OpenHands SDK venv (Python 3.12)")
    work = tmp_path / "work"
    work.mkdir()
    script = _script(
        "terminal", {"command": "echo hello-from-openhands > out.txt"}, "hello-from-openhands", ""
    )
    finish = json.dumps({"name": "finish", "arguments": {"message": "The file was written."}})
    script[2]["text"] = f"<tool_call>\n{finish}\n</tool_call>"
    # OpenHands' terminal tool echoes nothing for a redirect: match its tool result instead.
    script[2]["match"] = "<tool_response>"
    with legorl_proxy(tmp_path, "serve", script) as (port, out, _):
        stdout = _run(
            [
                python,
                str(ROOT / "src/legorl/harnesses/openhands_driver.py"),
                f"http://127.0.0.1:{port}/s/oh/v1",
                str(work),
                "legorl-e2e: write the file",
            ],
            work,
            {},
        )
        turns = _turns(out, "oh")
    assert "openhands-run: finished" in stdout
    assert (work / "out.txt").read_text() == "hello-from-openhands\n"
    _assert_round_trip(turns, script, 1, 2)
    assert turns[-1].output.tool_calls[0].name == "finish"


def _codex(work: Path, home: Path, base_url: str, env: dict[str, str], timeout: int = 240) -> str:
    """`codex exec` with the harness's own config.toml; returns its --json event lines."""
    from legorl.harnesses.codex import codex_config

    codex = _need(shutil.which("codex"), "Codex CLI (npm @openai/codex)")
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(codex_config(base_url, "tiny"))
    return _run(
        [
            "sh",
            "-c",
            'exec "$0" exec --strict-config --skip-git-repo-check --ephemeral --json "$@" </dev/null',
            codex,
            "legorl-e2e: write the file",
        ],
        work,
        {"CODEX_HOME": str(home), "HOME": str(home.parent), **env},
        timeout=timeout,
    )


def _wait_healthy(port: int, seconds: float = 240) -> None:
    """Codex retries a refused connection only once (its config here): on a loaded machine the
    proxy may still be loading when `legorl_proxy` yields, so wait until it answers."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    pytest.fail(f"the proxy on port {port} did not become healthy in {seconds:.0f} s")


def _codex_events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_codex_tool_round_trip_on_the_responses_api(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    call = {"name": "exec_command", "arguments": {"cmd": "echo hello-from-codex > out.txt"}}
    script: list[dict] = [
        {
            "match": "legorl-e2e",
            "text": f"<think>\nWrite it.\n</think>\n\n<tool_call>\n{json.dumps(call)}\n</tool_call>",
        },
        # Codex's tool output says how the command exited: match that, then answer.
        {"match": "Process exited with code 0", "text": "The file was written.", "repeat": True},
    ]
    with legorl_proxy(tmp_path, "serve", script) as (port, out, _):
        _wait_healthy(port)
        stdout = _codex(
            work,
            tmp_path / "home" / ".codex",
            f"http://127.0.0.1:{port}/s/cx/v1",
            {"LEGORL_API_KEY": "sk-legorl"},
        )
        turns = _turns(out, "cx")
    events = _codex_events(stdout)
    assert events[-1]["type"] == "turn.completed"
    assert [e["item"]["text"] for e in events if e.get("item", {}).get("type") == "agent_message"]
    assert (work / "out.txt").read_text() == "hello-from-codex\n"
    _assert_round_trip(turns, script, 0, 1)
    assert all(t.api == "responses" and t.requested_model == "tiny" for t in turns)
    # Codex sent the reasoning item back, and it was the model's own text.
    assert turns[0].output.thinking == "Write it."
    assert not [t for t in turns if t.flags.aux]  # exec mode makes no title or summary calls


def test_codex_through_intercept_with_its_builtin_provider(tmp_path: Path) -> None:
    """Codex's own OpenAI provider, its base URL untouched: it honours HTTPS_PROXY and takes the
    proxy's CA from SSL_CERT_FILE (no pinning). It first tries a WebSocket to
    wss://api.openai.com/v1/responses, gets 404 and falls back to HTTPS by itself."""
    codex = _need(shutil.which("codex"), "Codex CLI (npm @openai/codex)")
    work, home = tmp_path / "work", tmp_path / "home" / ".codex"
    work.mkdir()
    home.mkdir(parents=True)
    (home / "config.toml").write_text(
        'model = "tiny"\napproval_policy = "never"\nsandbox_mode = "danger-full-access"\n'
        'check_for_update_on_startup = false\nweb_search = "disabled"\n'
        "[analytics]\nenabled = false\n[features]\nplugins = false\n"
    )
    env = {"CODEX_HOME": str(home), "HOME": str(home.parent)}
    # The session is the API key, saved the way Codex saves one.
    login = subprocess.run(
        [codex, "login", "--with-api-key"],
        input="intercepted-codex",
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert login.returncode == 0, login.stderr
    call = {"name": "exec_command", "arguments": {"cmd": "echo intercepted > out.txt"}}
    script: list[dict] = [
        {"match": "legorl-e2e", "text": f"<tool_call>\n{json.dumps(call)}\n</tool_call>"},
        {"match": "Process exited with code 0", "text": "Done through the proxy.", "repeat": True},
    ]
    with legorl_proxy(tmp_path, "intercept", script) as (port, out, data):
        ca = data / "mitmproxy" / "mitmproxy-ca-cert.pem"
        # Other hosts are refused; that answer also says the proxy is up (it may load slowly).
        deadline, refused = time.monotonic() + 240, None
        while refused is None and time.monotonic() < deadline:
            try:
                refused = httpx.get("http://example.com/", proxy=f"http://127.0.0.1:{port}")
            except httpx.HTTPError:
                time.sleep(0.5)
        assert refused is not None and refused.status_code == 403
        assert ca.exists()
        stdout = _run(
            [
                "sh",
                "-c",
                'exec "$0" exec --skip-git-repo-check --ephemeral --json "$@" </dev/null',
                codex,
                "legorl-e2e: write the file",
            ],
            work,
            {**env, "HTTPS_PROXY": f"http://127.0.0.1:{port}", "SSL_CERT_FILE": str(ca)},
            timeout=180,
        )
        turns = _turns(out, "intercepted-codex")
    events = _codex_events(stdout)
    assert events[-1]["type"] == "turn.completed"
    assert (work / "out.txt").read_text() == "intercepted\n"
    _assert_round_trip(turns, script, 0, 1)
