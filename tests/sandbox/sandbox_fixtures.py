"""Shared fixtures of the sandbox tests: real Docker, real bubblewrap, the toy tasks.

A missing component (Docker daemon, bwrap, debootstrap for a first base build) fails the test
under CI=true and skips it elsewhere, with the reason.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
TASKS_DIR = ROOT / "fixtures" / "tasks"
TRAIN = TASKS_DIR / "train.jsonl"
IN_CI = os.environ.get("CI") == "true"
TASK_ID = "legorl-toy__geometry-1"
BACKENDS = ["docker", "local"]


def need(ok: bool, what: str) -> None:
    """Fail under CI, skip elsewhere, when a component the test needs is missing."""
    if ok:
        return
    if IN_CI:
        pytest.fail(f"{what} is missing (required under CI=true)")
    pytest.skip(f"{what} is missing")


def tasks() -> dict[str, Any]:
    from legorl.records import Task, read_jsonl

    return {t.instance_id: t for t in read_jsonl(TRAIN, Task)}


def task(instance_id: str = TASK_ID) -> Any:
    return tasks()[instance_id]


def variant(base: Any, **changes: Any) -> Any:
    """A copy of a task with changed fields (a fresh ``nonce`` env keeps its layers unique)."""
    from legorl.records import EnvRecipe

    env = changes.pop("env", None)
    if env is not None and not isinstance(env, EnvRecipe):
        env = EnvRecipe(**env)
    return replace(base, **changes, **({"env": env} if env is not None else {}))


def docker_ok() -> tuple[bool, str]:
    from legorl.protocols import SandboxError
    from legorl.sandbox.docker_images import DockerConfig, connect

    try:
        connect(DockerConfig())
    except SandboxError as err:
        return False, str(err)
    return True, ""


def bwrap_ok() -> bool:
    if shutil.which("bwrap") is None:
        return False
    probe = subprocess.run(
        ["bwrap", "--unshare-all", "--ro-bind", "/", "/", "--dev", "/dev", "true"],
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0


def make(name: str) -> Any:
    """A backend that works here, or fail/skip; its first task's layers are built."""
    from legorl.sandbox import make_backend

    if name == "docker":
        ok, why = docker_ok()
        need(ok, f"the Docker daemon ({why})")
        if shutil.which("debootstrap") is None:
            # Without debootstrap only an already built base layer can be used.
            from legorl.sandbox.layers import plan

            backend = make_backend("docker")
            base = plan(task())[0]
            need(backend.cache.image(base.tag) is not None, "debootstrap (to build the base layer)")
    else:
        need(bwrap_ok(), "bubblewrap (bwrap with user/network namespaces)")
    backend = make_backend(name)
    backend.cache.ensure(task(), TASKS_DIR)
    return backend


@pytest.fixture(scope="session", name="docker_backend")
def fixture_docker_backend() -> Any:
    return make("docker")


@pytest.fixture(scope="session", name="local_backend")
def fixture_local_backend() -> Any:
    return make("local")


@pytest.fixture(params=BACKENDS, name="backend")
def fixture_backend(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{request.param}_backend")


def run_id() -> str:
    return f"test-{secrets.token_hex(4)}"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# ---- a stand-in proxy and a bystander service on the host ------------------------------------


class _Echo(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"server": self.server.tag, "path": self.path}).encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class HostServer:
    """An HTTP server on all of the host's addresses that says who it is and what it got."""

    def __init__(self, tag: str) -> None:
        self.server = ThreadingHTTPServer(("0.0.0.0", 0), _Echo)
        self.server.tag = tag  # type: ignore[attr-defined]
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module", name="host_servers")
def fixture_host_servers() -> Iterator[tuple[HostServer, HostServer]]:
    proxy, other = HostServer("proxy"), HostServer("other")
    yield proxy, other
    proxy.close()
    other.close()


def host_addresses() -> list[str]:
    """This host's addresses other than loopback (eth0, docker0, …)."""
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    addrs = [a for a in out if ":" not in a]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
            addrs.append(s.getsockname()[0])
        except OSError:
            pass
    return sorted(set(addrs) - {"127.0.0.1"})


PROBE = r"""
import json, socket, sys, urllib.request
out = {}
for spec in sys.argv[1:]:
    host, port = spec.rsplit(":", 1)
    s = socket.socket()
    s.settimeout(3)
    try:
        s.connect((host, int(port)))
        out[spec] = "connected"
    except OSError as exc:
        out[spec] = type(exc).__name__ + ": " + str(exc)
    finally:
        s.close()
try:
    socket.getaddrinfo("pypi.org", 443)
    out["dns pypi.org"] = "resolved"
except OSError as exc:
    out["dns pypi.org"] = type(exc).__name__
print(json.dumps(out))
"""
