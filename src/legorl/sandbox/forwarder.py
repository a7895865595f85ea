#!/usr/bin/env python3
"""In-sandbox half of the proxy relay: listen on 127.0.0.1:PORT, forward to a unix socket.

    python3 /run/legorl/forwarder.py 8000 /run/legorl/proxy.sock --daemon

Standard library only: it is copied into sandboxes and runs on their python3. A sandbox has no
network of its own; this forwarder and the unix socket bind-mounted from the host are its only
way out, and the host side connects that socket to exactly one address (the proxy's). With
``--daemon`` it returns once it listens (so a caller knows the port is ready) and keeps serving
in the background, detached from the caller's output.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


def _serve_one(client: socket.socket, path: str) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(path)
    except OSError:
        client.close()
        upstream.close()
        return
    back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
    back.start()
    _pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: forwarder.py PORT SOCKET [--daemon]", file=sys.stderr)
        return 2
    port, path = int(argv[0]), argv[1]
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    if "--daemon" in argv[2:]:
        if os.fork() > 0:
            return 0  # listening already: the caller may connect as soon as we return
        os.setsid()
        if os.fork() > 0:
            os._exit(0)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_serve_one, args=(client, path), daemon=True).start()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
