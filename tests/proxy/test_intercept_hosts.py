"""`legorl proxy intercept --allow-host`: a named host is passed through to the real origin;
every other host that is not an API the proxy answers is refused with 403, never forwarded.
The origin is a real HTTP server on loopback; the proxy is the real command (forced engine, a
fake shipping in the package, never asked here)."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from proxy_harness import MODEL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _origin() -> Iterator[tuple[int, list[str]]]:
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.path)
            body = b"from the origin"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            return None

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def _intercept(tmp: Path, *extra: str) -> Iterator[int]:
    tmp.mkdir(parents=True)
    (tmp / "script.json").write_text(json.dumps([]))
    port = _free_port()
    log = open(tmp / "intercept.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "legorl.cli.main", "proxy", "intercept", "--model", str(MODEL),
         "--engine", "forced", "--script", str(tmp / "script.json"), "--port", str(port),
         "--out", str(tmp / "turns"), *extra],
        stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "LEGORL_DATA_DIR": str(tmp / "data")},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300  # a loaded CI machine starts it slowly
        while True:
            assert proc.poll() is None, (tmp / "intercept.log").read_text()
            assert time.monotonic() < deadline, "the proxy never listened"
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def test_allow_host_passes_a_named_host_through_and_refuses_the_rest(tmp_path: Path) -> None:
    with _origin() as (origin_port, seen):
        url = f"http://127.0.0.1:{origin_port}/hello"
        with _intercept(tmp_path / "open", "--allow-host", "127.0.0.1") as port:
            through = httpx.get(url, proxy=f"http://127.0.0.1:{port}", timeout=30)
            other = httpx.get(
                f"http://localhost:{origin_port}/other",
                proxy=f"http://127.0.0.1:{port}",
                timeout=30,
            )
        assert (through.status_code, through.text) == (200, "from the origin")
        assert other.status_code == 403  # same origin, a host not named: refused
        # Control: without --allow-host the same request never reaches the origin.
        with _intercept(tmp_path / "closed") as port:
            refused = httpx.get(url, proxy=f"http://127.0.0.1:{port}", timeout=30)
        assert refused.status_code == 403
        assert seen == ["/hello"]
