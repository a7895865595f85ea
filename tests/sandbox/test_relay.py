"""The relay that joins a sandbox's unix socket to the proxy's TCP port: bytes pass both ways,
and a connection the sandbox closes is closed upstream too and forgotten, even when the upstream
side would keep it open (HTTP keep-alive)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from legorl.sandbox import relay


def _keepalive_server() -> tuple[socket.socket, list[str]]:
    """A TCP server that answers each read with b"pong:" + what it read and never closes a
    connection, not even after its peer's end of file (which it notes as "eof")."""
    server = socket.create_server(("127.0.0.1", 0))
    seen: list[str] = []
    held: list[socket.socket] = []

    def serve() -> None:
        conn, _ = server.accept()
        held.append(conn)
        while data := conn.recv(65536):
            conn.sendall(b"pong:" + data)
        seen.append("eof")

    threading.Thread(target=serve, daemon=True).start()
    return server, seen


def test_relay_passes_bytes_and_lets_go_of_a_connection_the_sandbox_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay, "_GRACE", 0.3)
    server, seen = _keepalive_server()
    port = server.getsockname()[1]
    r = relay.open_relay(tmp_path / "proxy.sock", f"http://127.0.0.1:{port}/v1")
    try:
        assert r.inside_url == f"http://127.0.0.1:{port}/v1"
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(str(tmp_path / "proxy.sock"))
        client.sendall(b"ping")
        assert client.recv(100) == b"pong:ping"
        deadline = time.monotonic() + 10
        while not relay._live and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(relay._live) == 1  # the connection is held while it is open
        client.close()
        # upstream is told (end of file) and, as it keeps its end open, the relay closes it
        # after the grace period rather than holding the connection for ever
        while (relay._live or not seen) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == ["eof"] and not relay._live
    finally:
        r.close()
        server.close()
