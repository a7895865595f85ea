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


def _echo_server() -> socket.socket:
    """A TCP server that echoes b"pong:" + each read, on every connection it accepts."""
    server = socket.create_server(("127.0.0.1", 0), backlog=64)

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(b"pong:" + data)

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return server


def _answered(path: Path, n: int) -> list[bool]:
    """Open ``n`` connections through the relay at ``path``, all held open; whether each one
    is answered."""
    clients, out = [], []
    for _ in range(n):
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.settimeout(10)
        client.connect(str(path))
        clients.append(client)
        try:
            client.sendall(b"ping")
            out.append(client.recv(100) == b"pong:ping")
        except OSError:
            out.append(False)
    for client in clients:
        client.close()
    return out


def test_a_sandbox_holds_at_most_its_share_of_connections(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Round 72: the relay joined every connection a sandbox opened; one sandbox held 19,500,
    # which took every file the rollout process may open (other sandboxes' commands and new
    # sandboxes failed), and unfinished request bodies on 40 of them held 1.3 GB of the
    # proxy's memory, outside the sandbox's cgroup. Past MAX_CONNECTIONS held at once, a new
    # connection is closed as it comes; one let go makes room again.
    monkeypatch.setattr(relay, "_GRACE", 0.3)
    server = _echo_server()
    port = server.getsockname()[1]
    r = relay.open_relay(tmp_path / "proxy.sock", f"http://127.0.0.1:{port}/v1")
    try:
        cap = relay.MAX_CONNECTIONS
        answered = _answered(tmp_path / "proxy.sock", cap + 4)
        assert answered == [True] * cap + [False] * 4, answered
        deadline = time.monotonic() + 10
        while relay._live and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _answered(tmp_path / "proxy.sock", 1) == [True]  # room again
        # The control: with no cap, every connection is joined.
        monkeypatch.setattr(relay, "MAX_CONNECTIONS", 1 << 20)
        assert _answered(tmp_path / "proxy.sock", cap + 4) == [True] * (cap + 4)
    finally:
        r.close()
        server.close()
