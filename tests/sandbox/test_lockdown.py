"""The agent-stage lockdown, attacked from inside on both backends: git history, network,
hidden tests. (Resource limits are attacked in test_sandbox_api.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
from sandbox_fixtures import (  # noqa: F401  (fixtures are found by name)
    PROBE,
    TASKS_DIR,
    fixture_backend,
    fixture_docker_backend,
    fixture_host_servers,
    fixture_local_backend,
    host_addresses,
    run,
    run_id,
    task,
)

from legorl.tasks import apply_patch, checkout


def _git_objects_of_the_fix(t: Any) -> dict[str, str]:
    """Blob ids the agent must not find: the fixed source file, the file with hidden tests,
    and every commit of the original repository."""
    with tempfile.TemporaryDirectory() as tmp:
        repo = checkout(t, TASKS_DIR, Path(tmp) / "r")
        commits = subprocess.run(
            ["git", "rev-list", "--all"], cwd=repo, capture_output=True, text=True, check=True
        ).stdout.split()
        apply_patch(repo, t.patch)
        apply_patch(repo, t.test_patch)
        out = {f"commit {c}": c for c in commits}
        for path in (t.meta["file"], t.FAIL_TO_PASS[0].split("::")[0]):
            blob = subprocess.run(
                ["git", "hash-object", path], cwd=repo, capture_output=True, text=True, check=True
            ).stdout.strip()
            out[f"blob {path} after the fix"] = blob
    return out


def test_git_history_is_one_commit_with_nothing_else(backend: Any) -> None:
    t = task()
    hidden = _git_objects_of_the_fix(t)

    async def go() -> None:
        box = await backend.start(t, str(TASKS_DIR), run_id=run_id())
        try:

            async def out(cmd: str) -> str:
                r = await box.exec(cmd)
                assert r.exit_code == 0, f"{cmd}: {r.output}"
                return r.output.strip()

            assert await out("git rev-list --all --count") == "1"
            assert await out("git log --format=%s") == "base"
            assert await out("git for-each-ref --format='%(refname)'") == "refs/heads/main"
            assert await out("git tag; git remote; git stash list; git reflog") == ""
            files = set((await out("ls -A .git")).split())
            assert not files & {"logs", "packed-refs", "ORIG_HEAD", "FETCH_HEAD", "refs/remotes"}
            assert await out("git fsck --unreachable --dangling --no-reflogs --no-progress") == ""
            assert "in-pack: 0" in await out("git count-objects -v")
            # Objects that would give the fix away are nowhere in the object store.
            for what, oid in hidden.items():
                found = await box.exec(f"git cat-file -e {oid}")
                assert found.exit_code != 0, f"{what} ({oid}) is inside the sandbox"
            # The working tree is exactly the task's base state.
            assert (await box.exec("git status --porcelain")).output == ""
        finally:
            await box.close()

    run(go())


def test_hidden_tests_and_fix_are_nowhere_inside(backend: Any) -> None:
    t = task()
    hidden_test = t.FAIL_TO_PASS[0].split("::")[1]  # added by test_patch only
    fixed_line = next(
        line[1:].strip()
        for line in t.patch.splitlines()
        if line.startswith("+") and "return" in line
    )

    async def go() -> None:
        box = await backend.start(t, str(TASKS_DIR), run_id=run_id())
        try:
            # Everything the agent can write or that belongs to the task: no trace.
            where = "/testbed /tmp /root /run /opt/legorl-env /home /srv /var"
            r = await box.exec(
                f"grep -rIlF -e '{hidden_test}' -e '{fixed_line}' {where} 2>/dev/null; true",
                timeout=120,
            )
            assert r.output == "", f"found in: {r.output}"
            # The task files (with test_patch and the gold patch) are not visible at all.
            tasks_file = (TASKS_DIR / "train.jsonl").resolve()
            r = await box.exec(f"ls {tasks_file} {TASKS_DIR.resolve()} 2>&1; true")
            assert "No such file" in r.output and "train.jsonl" not in r.output.replace(
                str(tasks_file), ""
            )
        finally:
            await box.close()

    run(go())


def test_the_network_reaches_the_proxy_and_nothing_else(backend: Any, host_servers: Any) -> None:
    proxy, other = host_servers
    proxy_url = f"http://127.0.0.1:{proxy.port}/s/session-7"
    addrs = host_addresses()
    assert addrs, "this host has no non-loopback address to attack"

    async def go() -> None:
        box = await backend.start(task(), str(TASKS_DIR), run_id=run_id(), proxy_url=proxy_url)
        try:
            assert box.proxy_url == f"http://127.0.0.1:{proxy.port}/s/session-7"
            # The one endpoint works, path and all, over HTTP from inside.
            fetch = (
                'python3 -c "import sys, urllib.request; '
                "print(urllib.request.urlopen(sys.argv[1] + '/v1/models', timeout=10).read().decode())\" "
            )
            r = await box.exec(fetch + box.proxy_url, timeout=60)
            assert r.exit_code == 0, r.output
            assert json.loads(r.output) == {"server": "proxy", "path": "/s/session-7/v1/models"}
            # Everything else fails: another local port, the host's other addresses (on the
            # proxy's port and another), a public address, DNS.
            targets = [f"127.0.0.1:{other.port}", "127.0.0.1:22", "1.1.1.1:443", "8.8.8.8:53"]
            for addr in addrs:
                targets += [f"{addr}:{proxy.port}", f"{addr}:{other.port}"]
            script = PROBE.replace('"', '\\"')
            r = await box.exec(f'python3 -c "{script}" ' + " ".join(targets), timeout=120)
            results = json.loads(r.output)
            assert set(results) == {*targets, "dns pypi.org"}
            leaks = {k: v for k, v in results.items() if v in ("connected", "resolved")}
            assert not leaks, f"reachable from the sandbox: {leaks}"
            # The same addresses do answer from the host, so the failures are the sandbox's.
            import socket

            for addr in addrs[:1]:
                with socket.create_connection((addr, other.port), timeout=3):
                    pass
        finally:
            await box.close()

    run(go())


def test_without_a_proxy_there_is_no_network_at_all(backend: Any, host_servers: Any) -> None:
    proxy, _ = host_servers

    async def go() -> None:
        box = await backend.start(task(), str(TASKS_DIR), run_id=run_id())
        try:
            script = PROBE.replace('"', '\\"')
            target = f"127.0.0.1:{proxy.port}"
            r = await box.exec(f'python3 -c "{script}" {target}', timeout=60)
            results = json.loads(r.output)  # a probe that crashed has no verdicts: it fails here
            assert set(results) == {target, "dns pypi.org"}, r.output
            leaks = {k: v for k, v in results.items() if v in ("connected", "resolved")}
            assert not leaks, f"reachable from the sandbox: {leaks}"
            r = await box.exec("cat /proc/net/dev | tail -n +3 | cut -d: -f1")
            assert r.output.split() == ["lo"]  # no interface but loopback
        finally:
            await box.close()

    run(go())


@pytest.mark.parametrize("path", ["/run/legorl/proxy.sock"])
def test_the_relay_socket_leads_only_to_the_proxy(
    backend: Any,
    host_servers: Any,
    path: str,
) -> None:
    # Talking to the unix socket directly (instead of the forwarder) still lands on the proxy:
    # the host side joins it to the proxy's address, whatever the client asks for.
    proxy, other = host_servers

    async def go() -> None:
        url = f"http://127.0.0.1:{proxy.port}/s/s"
        box = await backend.start(task(), str(TASKS_DIR), run_id=run_id(), proxy_url=url)
        try:
            script = (
                "import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
                f"s.sendall(b'GET /x HTTP/1.0\\r\\nHost: 127.0.0.1:{other.port}\\r\\n\\r\\n'); "
                "data = b''.join(iter(lambda: s.recv(4096), b'')); "
                "print(data.decode().split(chr(10))[-1])"
            )
            r = await box.exec(["python3", "-c", script, path], timeout=60)
            assert json.loads(r.output) == {"server": "proxy", "path": "/x"}
            r = await box.exec(f"touch {path}.new 2>&1; rm -f {path} 2>&1; ls /run/legorl")
            assert "proxy.sock" in r.output  # read-only: the agent cannot swap the socket
        finally:
            await box.close()

    run(go())


def test_a_host_folder_the_sandbox_does_not_need_is_out_of_view(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Round 71 (local): the view held the host's /opt, where a local package mirror kept wheels
    # of the real tasks' libraries at the fixed version: the gold fix, readable by the agent.
    # A sandbox sees the host's system folders it runs on (/usr, /etc, the lib folders) and
    # legorl's own layers, nothing else of the host.
    from legorl.sandbox import local_backend

    marker = Path("/srv") / f"legorl-test-{secrets.token_hex(4)}"
    marker.mkdir(parents=True)
    (marker / "fixed.py").write_text("the fix\n")

    async def seen() -> str:
        box = await backend.start(task(), str(TASKS_DIR), run_id=run_id())
        try:
            r = await box.exec(f"ls /opt; echo --; cat {marker}/fixed.py 2>&1; true")
            return r.output
        finally:
            await box.close()

    try:
        out = run(seen())
        assert "the fix" not in out, out
        assert set(out.split()[: out.split().index("--")]) <= {
            "legorl-env",
            "legorl-runtime",
        }, out
        if backend.name != "local":
            return
        # The control: a view that binds the host's /srv as well shows the file.
        monkeypatch.setattr(backend.config, "host_paths", (*local_backend.HOST_PATHS, "/srv"))
        assert "the fix" in run(seen())
    finally:
        shutil.rmtree(marker)


def test_a_link_left_in_home_takes_bwrap_nowhere_on_the_host(
    local_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Round 71 (local): bubblewrap runs as the host's root and makes the folders on the way to
    # a read-only bind below HOME (the host's Python in /root/.pyenv). HOME persists between
    # commands, so a command replaced ~/.pyenv by a link to a host folder, and the next
    # command's bwrap made folders in the host's. Each folder directly below HOME, /tmp or the
    # repository that leads to a bind is now a fresh tmpfs.
    from legorl.sandbox import local_backend as lb

    async def plant(target: Path) -> str:
        box = await local_backend.start(task(), str(TASKS_DIR), run_id=run_id())
        try:
            flags = box._flags
            below = [  # the folders made on the way to a bind below HOME
                path
                for kind, path in itertools.pairwise(flags)
                if kind in ("--tmpfs", "--dir") and path.startswith("/root/")
            ]
            if not below:
                pytest.skip("no bind below /root on this host (the host's Python lives elsewhere)")
            first = "/" + "/".join(Path(below[0]).parts[1:3])  # e.g. /root/.pyenv
            link = box.root / "home" / first.removeprefix("/root/")
            if link.is_dir() and not link.is_symlink():
                link.rmdir()  # the first command's bwrap made it (empty: a mount point)
            link.symlink_to(f"/oldroot{target}")  # what a command can leave
            r = await box.exec("true")
            return f"exit {r.exit_code}: {r.output}"
        finally:
            await box.close()

    with tempfile.TemporaryDirectory() as host:
        target = Path(host)
        run(plant(target))
        assert list(target.iterdir()) == []
        # The control: without the tmpfs (folders made where HOME's content leads), bwrap
        # makes the folders in the host's.
        monkeypatch.setattr(lb, "WRITABLE", ())
        run(plant(target))
        assert list(target.iterdir()) != []


_ADD_KEY = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
nr = {"x86_64": 248, "aarch64": 217}[os.uname().machine]
key = libc.syscall(nr, b"user", b"legorl-test", b"x", 1, -4)  # KEY_SPEC_USER_KEYRING
print(key, ctypes.get_errno())
if key > 0:  # the control's key: unlinked again, so the host's keyring keeps nothing
    libc.syscall({"x86_64": 250, "aarch64": 219}[os.uname().machine], 9, key, -4)
"""


def test_an_agent_command_reaches_no_kernel_keyring(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Round 71 (local): an agent's command ran with no seccomp filter, as the host's root in a
    # user namespace, and wrote keys into the host root's keyring, which the host and later
    # sandboxes listed. Docker's default profile refuses the keyring calls; the local backend
    # installs the judged commands' filter in every agent's command too: as the command
    # becomes the sandbox's user (run by root), or through bwrap in the user namespace (run
    # by another user; here the backend is told it is).
    import errno

    from legorl.sandbox import local_backend, seccomp

    async def add_key() -> list[str]:
        box = await backend.start(task(), str(TASKS_DIR), run_id=run_id())
        try:
            r = await box.exec(["python3", "-c", _ADD_KEY])
            return r.output.split()
        finally:
            await box.close()

    out = run(add_key())
    assert (int(out[0]), int(out[1])) == (-1, errno.EPERM), out
    if backend.name != "local":
        return
    monkeypatch.setattr(local_backend.os, "geteuid", lambda: 1000)
    out = run(add_key())
    assert (int(out[0]), int(out[1])) == (-1, errno.EPERM), out
    # The controls: the same commands with a filter that allows every call.
    allow = seccomp.struct.pack("=HBBI", 0x06, 0, 0, seccomp.ALLOW).hex()
    monkeypatch.setattr(local_backend, "_command_filter", lambda: allow)
    assert int(run(add_key())[0]) > 0
    monkeypatch.undo()
    monkeypatch.setattr(local_backend, "_command_filter", lambda: allow)
    assert int(run(add_key())[0]) > 0


def test_an_agent_command_run_by_root_is_not_the_host_s_root(
    local_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Round 71 (local): run by root, an agent's command was root in a user namespace that
    # maps it onto the host's root: it read the host's root-only files in the view
    # (/etc/shadow, the Docker daemon's key), and held inotify instances the host's root
    # draws on too (all 128 of them: the host could not watch a file). It now runs as the
    # sandbox's own user, as a judged command does; it is still root of nothing else.
    import os

    from legorl.sandbox import local_backend as lb

    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("CI runs the tests as root, which this test is about")
        pytest.skip("run by another user, the namespace maps the sandbox's root onto that user")
    mark = f"legorl-{secrets.token_hex(4)}"

    async def seen() -> tuple[str, int]:
        box = await local_backend.start(task(), str(TASKS_DIR), run_id=run_id())
        try:
            held = asyncio.ensure_future(
                box.exec(
                    f"id -un; head -c 4 /etc/shadow 2>&1; exec bash -c 'exec -a {mark} sleep 5'"
                )
            )
            host_uid = -1
            for _ in range(100):  # the command's process, as the host sees it
                await asyncio.sleep(0.1)
                for proc in Path("/proc").iterdir():
                    with contextlib.suppress(OSError):
                        if (proc / "cmdline").read_bytes().startswith(mark.encode()):
                            status = (proc / "status").read_text()
                            host_uid = int(status.split("\nUid:")[1].split()[0])
                if host_uid >= 0:
                    break
            return (await held).output, host_uid
        finally:
            await box.close()

    out, host_uid = run(seen())
    assert host_uid > 0 and out.split()[0] == lb.AGENT_USER, (out, host_uid)
    assert "Permission denied" in out, out
    # The control: the user namespace a backend run by another user takes, run by root.
    monkeypatch.setattr(lb.os, "geteuid", lambda: 1000)
    out, host_uid = run(seen())
    assert host_uid == 0 and out.split()[0] == "root", (out, host_uid)
    assert "Permission denied" not in out, out
