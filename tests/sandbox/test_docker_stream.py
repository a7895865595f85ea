"""How the Docker sandbox reads a command's output stream, against a FAKE Docker API: a socket
pair stands in for dockerd's hijacked exec stream, and a scripted ``exec_inspect`` for its exec
state. On a busy host dockerd can answer the start before the process runs, and deliver output
after it reports the process ended; these orders are hard to force on a real daemon, so they
are scripted here. The real daemon runs the same reader in ``test_sandbox_api.py`` and
``test_gc.py``."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from legorl.sandbox.common import OutputCap
from legorl.sandbox.docker_backend import DockerSandbox


def frame(data: bytes) -> bytes:
    return bytes([1, 0, 0, 0]) + struct.pack(">I", len(data)) + data


def read_stream(
    state: Callable[[float], dict[str, Any]], feed: Callable[[socket.socket], None]
) -> tuple[str, float]:
    """(the output read, seconds taken) for a command whose exec state at t seconds after the
    start is ``state(t)`` and whose stream ``feed`` writes from a thread."""
    ours, theirs = socket.socketpair()
    t0 = time.monotonic()
    api = SimpleNamespace(exec_inspect=lambda _id: state(time.monotonic() - t0))
    backend = SimpleNamespace(api=api, exec_socket=lambda _id: (ours, b""))
    box = DockerSandbox.__new__(DockerSandbox)  # only the reader's two attributes are set
    box.backend, box.api = backend, api
    writer = threading.Thread(target=feed, args=(theirs,), daemon=True)
    writer.start()
    cap = OutputCap(1 << 20)
    box._stream("exec-1", None, cap, None, time.monotonic() + 60)
    seconds = time.monotonic() - t0
    writer.join(5)
    theirs.close()
    return cap.data().decode("utf-8", "replace"), seconds


def test_output_of_a_command_that_starts_late_is_read() -> None:
    # dockerd answered the start, the process runs only 1.5 s later: before that the exec reads
    # as not running with no exit code, which is not an end
    def state(t: float) -> dict[str, Any]:
        if t < 1.5:
            return {"Running": False, "ExitCode": None}
        return {"Running": False, "ExitCode": 0}

    def feed(sock: socket.socket) -> None:
        time.sleep(1.6)
        sock.sendall(frame(b"2\n"))
        sock.close()

    assert read_stream(state, feed)[0] == "2\n"


def test_output_delivered_after_the_end_is_read() -> None:
    # the process has ended at once; its output reaches the stream 0.8 s later
    def feed(sock: socket.socket) -> None:
        time.sleep(0.8)
        sock.sendall(frame(b"late output\n"))
        time.sleep(0.3)
        sock.sendall(frame(b"and more\n"))
        sock.close()

    text, _ = read_stream(lambda _t: {"Running": False, "ExitCode": 0}, feed)
    assert text == "late output\nand more\n"


def test_a_background_child_holding_the_stream_does_not_hold_the_command() -> None:
    # ended after its first line; a child keeps the stream open and says nothing more
    def state(t: float) -> dict[str, Any]:
        return {"Running": t < 0.2, "ExitCode": None if t < 0.2 else 0}

    stop = threading.Event()

    def feed(sock: socket.socket) -> None:
        sock.sendall(frame(b"started\n"))
        stop.wait(30)
        sock.close()

    try:
        text, seconds = read_stream(state, feed)
    finally:
        stop.set()
    assert text == "started\n"
    assert seconds < 30  # ended by the quiet stream, not by the writer closing it
