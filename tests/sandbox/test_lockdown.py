"""The agent-stage lockdown, attacked from inside on both backends: git history, network,
hidden tests. (Resource limits are attacked in test_sandbox_api.py.)"""

from __future__ import annotations

import json
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
