"""Grading sandboxes (``start(grading=True)``) and judged commands (``exec(judged=True)``),
attacked from inside on both backends: the judged code must not write anything the judge
later reads or runs, outside the repository and its private tmp. Each defence has a control
that shows the same attack working with the defence switched off."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from sandbox_fixtures import (  # noqa: F401  (fixtures are found by name)
    TASKS_DIR,
    fixture_backend,
    fixture_docker_backend,
    fixture_local_backend,
    run,
    run_id,
    task,
)

from legorl.sandbox.common import JUDGED_DIR_PREFIX, JUDGED_UID_BASE
from legorl.verify import runner
from legorl.verify.tree import GRADE_DIR

# Tries to create a file in each folder named on the command line (a .pth where Python would
# run it at startup); prints what it managed. The folders come from the env's own Python.
_WRITE_PROBE = r"""
import json, os, site, sys, sysconfig
targets = site.getsitepackages()  # the env's (a venv: its own)
targets += site.getsitepackages([sys.base_prefix])  # the Python's own (Debian: dist-packages)
base = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_prefix})
targets += [base["purelib"], base["platlib"], "/usr", "/usr/local/lib", "/etc", "/opt", "/"]
out = {}
for folder in dict.fromkeys(targets):
    if not os.path.isdir(folder):
        continue
    path = os.path.join(folder, "legorl-attack.pth")
    try:
        with open(path, "w") as fh:
            fh.write("import os\n")
        os.unlink(path)
        out[folder] = "written"
    except OSError as exc:
        out[folder] = exc.strerror
print(json.dumps(out))
"""


async def _start(backend: Any, **kw: Any) -> Any:
    return await backend.start(task(), str(TASKS_DIR), run_id=run_id(), **kw)


async def _ok(box: Any, cmd: str | list[str], **kw: Any) -> str:
    r = await box.exec(cmd, **kw)
    assert r.exit_code == 0, f"{cmd}: {r.output}"
    return str(r.output)


async def _probe(box: Any, judged: bool) -> dict[str, str]:
    out = await _ok(box, ["python", "-c", _WRITE_PROBE], judged=judged)
    return dict(json.loads(out.strip().splitlines()[-1]))


def test_nothing_outside_the_repository_and_tmp_is_writable(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def go() -> None:
        box = await _start(backend, grading=True)
        try:
            judged = await _probe(box, judged=True)
            root = await _probe(box, judged=False)  # the root file system is read-only to root
            # The repository and the private tmp are writable to the judged user.
            await _ok(box, 'touch /testbed/new.py "$TMPDIR/x" "$HOME/y"', judged=True)
        finally:
            await box.close()
        site = [f for f in judged if "-packages" in f]
        # The env's and the Python's own; a local judged command sees no host Python's
        # site-packages at all (`memory_root.host_files`).
        own = 1 if backend.name == "local" else 2
        assert any("legorl-env" in f for f in site) and len(site) >= own, judged
        assert {"/usr", "/etc", "/opt", "/"} <= set(judged)
        assert not {f for f, v in judged.items() if v == "written"}, judged
        assert not {f for f, v in root.items() if v == "written"}, root

        # Control: in an agent sandbox, root writes the sandbox's root (both backends) and the
        # env's site-packages (Docker; the local env layer is bound read-only there too). Run
        # by root, a local agent's command is the sandbox's own user: the control takes the
        # user namespace of a backend run by another user, where the command is root.
        if backend.name == "local":
            from legorl.sandbox import local_backend

            monkeypatch.setattr(local_backend.os, "geteuid", lambda: 1000)
        agent = await _start(backend)
        try:
            control = await _probe(agent, judged=False)
        finally:
            await agent.close()
        assert control["/"] == "written", control
        if backend.name == "docker":
            assert control["/opt/legorl-env/lib/python3.11/site-packages"] == "written", control

    run(go())


def test_the_judged_user_has_no_privilege_and_fresh_private_folders(backend: Any) -> None:
    script = (
        "id -u; id -g; id -G; grep -E '^(Cap(Inh|Prm|Eff|Amb)|NoNewPrivs):' /proc/self/status; "
        'for d in "$HOME" "$TMPDIR" "$PYTHONPYCACHEPREFIX"; do '
        'echo "$d $(stat -c %u:%g:%a "$d") [$(ls -A "$d")]"; done'
    )

    async def go() -> None:
        box = await _start(backend, grading=True)
        try:
            first = (await _ok(box, script, judged=True)).splitlines()
            second = (await _ok(box, script, judged=True)).splitlines()
            as_root = await _ok(box, "id -u")
        finally:
            await box.close()
        uid = str(box.judged_uid)
        assert box.judged_uid >= JUDGED_UID_BASE
        assert first[:3] == [uid, uid, uid], first
        caps = dict(line.split(":\t") for line in first[3:8])
        assert caps == {
            "CapInh": "0" * 16,
            "CapPrm": "0" * 16,
            "CapEff": "0" * 16,
            "CapAmb": "0" * 16,
            "NoNewPrivs": "1",
        }, caps
        folders = [line.split()[0] for line in first[8:]]
        assert len(folders) == 3 and len(set(folders)) == 3
        for line in first[8:]:
            path, mode, listing = line.split()
            assert path.startswith(f"/tmp/{JUDGED_DIR_PREFIX}"), line
            assert mode == f"{uid}:{uid}:700" and listing == "[]", line
        # Each judged command gets new ones.
        assert not set(folders) & {line.split()[0] for line in second[8:]}
        assert as_root.strip() == "0"  # control: the same sandbox's root phase is root

    run(go())


def test_the_graders_private_files_in_tmp_stay_private(backend: Any) -> None:
    async def go() -> None:
        box = await _start(backend, grading=True)
        try:
            await _ok(
                box,
                "mkdir -m 0700 /tmp/grader && echo oracle > /tmp/grader/expected && "
                "(umask 077 && echo oracle > /tmp/expected.txt) && "
                "mkdir -m 0755 /tmp/shared && echo runner > /tmp/shared/runner.py",
            )
            attack = await box.exec(
                "cat /tmp/grader/expected; ls /tmp/grader; cat /tmp/expected.txt; "
                "rm -rf /tmp/grader /tmp/expected.txt; mv /tmp/grader /tmp/mine; "
                "cat /tmp/shared/runner.py",
                judged=True,
            )
            still = await _ok(box, "cat /tmp/grader/expected /tmp/expected.txt")
        finally:
            await box.close()
        assert "oracle" not in attack.output, attack.output
        refused = [
            line
            for line in attack.output.splitlines()
            if line.endswith(("Permission denied", "Operation not permitted"))
        ]
        assert len(refused) == 6, attack.output  # 3 reads, 2 removals, 1 rename
        assert still == "oracle\noracle\n"  # neither removed nor renamed
        # Control: what root left readable (0755/0644) the judged command reads: the failures
        # above are the modes', not an unreachable /tmp.
        assert "runner" in attack.output

    run(go())


_PLANT = r"""
import os, py_compile
os.chdir("/testbed")
with open("mod.py", "w") as fh:
    fh.write("print('stale')\n")
py_compile.compile("mod.py", doraise=True)
st = os.stat("mod.py")
with open("mod.py", "w") as fh:
    fh.write("print('fresh')\n")  # same size; the stamp is put back below
os.utime("mod.py", ns=(st.st_atime_ns, st.st_mtime_ns))
print(sorted(os.listdir("__pycache__")))
"""


def test_no_bytecode_cache_is_read_from_the_repository(backend: Any) -> None:
    # A __pycache__/mod.cpython-3XX.pyc that says "stale", planted beside a mod.py of the same
    # size and mtime that says "fresh": Python trusts a cache whose stamp matches its source.
    async def go() -> None:
        box = await _start(backend, grading=True)
        try:
            planted = await _ok(box, ["python", "-c", _PLANT])
            control = await _ok(box, "python -c 'import mod'")  # root, no prefix
            empty = await _ok(box, 'ls -A "$PYTHONPYCACHEPREFIX"', judged=True)
            judged = await _ok(
                box,
                'python -c "import mod" && ls -R "$PYTHONPYCACHEPREFIX" | grep -c "^mod\\."',
                judged=True,
            )
            path = "import sys; sys.path.insert(0, '/testbed'); import mod"
            isolated = await _ok(box, f'python -I -c "{path}"', judged=True)
            isolated_x = await _ok(
                box, f'python -I -X pycache_prefix="$PYTHONPYCACHEPREFIX" -c "{path}"', judged=True
            )
        finally:
            await box.close()
        assert "mod.cpython-3" in planted, planted
        assert control == "stale\n"  # the plant works: without the prefix it is what runs
        assert empty == ""
        assert judged == "fresh\n1\n"  # the source ran, its bytecode went to the prefix
        # -I ignores the environment's prefix (documented on Sandbox): -X pycache_prefix holds.
        assert isolated == "stale\n"
        assert isolated_x == "fresh\n"

    run(go())


def test_sealing_removes_the_repositorys_bytecode_for_the_judged_run(backend: Any) -> None:
    # The grader's judged interpreter (`runner._python`: -I -B, no prefix) reads the
    # environment's own caches; the repository's are gone once grading seals the tree.
    async def go() -> None:
        box = await _start(backend, grading=True)
        try:
            await _ok(box, ["python", "-c", _PLANT])
            before = await _ok(
                box, "python -I -B -c 'import sys; sys.path.insert(0, \".\"); import mod'"
            )
            await _ok(box, f"mkdir -p {GRADE_DIR}")
            await runner._seal(box, GRADE_DIR, None)
            command = runner._python(["-c", "import sys; sys.path.insert(0, '.'); import mod"])
            judged = await _ok(box, command, judged=True)
            left = await _ok(box, "find /testbed -name '*.pyc' | wc -l")
        finally:
            await box.close()
        assert before == "stale\n"  # the plant is what an unsealed run would have read
        assert judged == "fresh\n"
        assert left.strip() == "0"

    run(go())


def test_root_phase_applies_patches_and_chowns_in_a_grading_sandbox(backend: Any) -> None:
    patch = (
        "diff --git a/geometry.py b/geometry.py\n--- a/geometry.py\n+++ b/geometry.py\n"
        "@@ -0,0 +1 @@\n+# graded\n"
    )

    async def go() -> None:
        box = await _start(backend, grading=True)
        try:
            await _ok(box, ["git", "apply", "--unidiff-zero", "-"], stdin=patch.encode())
            head = await _ok(box, "id -u; head -1 geometry.py; git status --porcelain")
            await _ok(box, "echo made > /tmp/owned && chown 123:456 /tmp/owned")
            owner = await _ok(box, "stat -c %u:%g /tmp/owned")
            await _ok(box, "echo judged > /testbed/out.txt", judged=True)
            # After the judged run root still reads and writes the judged user's tree.
            after = await _ok(box, "echo root >> /testbed/out.txt && stat -c %u out.txt")
            content = await box.read_file("out.txt")
        finally:
            await box.close()
        assert head == "0\n# graded\n M geometry.py\n"
        assert owner == "123:456\n"
        assert after == f"{box.judged_uid}\n" and content == b"judged\nroot\n"

    run(go())


def test_a_symlink_in_the_tree_does_not_lend_the_grader_files_to_the_judged(
    backend: Any,
) -> None:
    # The chown before the judged run changes a symlink itself, never what it points at.
    async def go() -> None:
        box = await _start(backend, grading=True)
        try:
            await _ok(
                box,
                "mkdir -m 0700 /tmp/grader && echo oracle > /tmp/grader/expected && "
                "ln -s /tmp/grader /testbed/link && ln -s /tmp/grader/expected /testbed/f",
            )
            attack = await box.exec("cat /testbed/f; ls /testbed/link/", judged=True)
            owner = await _ok(box, "stat -c %u /tmp/grader /tmp/grader/expected")
        finally:
            await box.close()
        assert "oracle" not in attack.output and attack.exit_code != 0, attack.output
        assert owner == "0\n0\n"

    run(go())


@pytest.mark.parametrize("grading", [True, False])
def test_what_a_judged_command_writes_is_capped_in_memory_not_on_disk(
    backend: Any, grading: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A judged command filling /testbed or /tmp fills a size-capped tmpfs its sandbox is
    # charged for, never the disk the judge and the other gradings share, nor its inodes. The
    # caps are made small here; the control is a rollout sandbox, whose repository is on disk.
    from legorl.sandbox import docker_backend, local_backend

    monkeypatch.setattr(docker_backend, "GRADING_REPO_MB", 24)
    monkeypatch.setattr(docker_backend, "GRADING_TMP_MB", 8)
    monkeypatch.setattr(local_backend, "GRADING_REPO_MB", 24)
    monkeypatch.setattr(local_backend, "GRADING_TMP_MB", 8)
    for module in (docker_backend, local_backend):  # and their inode caps (round 30)
        monkeypatch.setattr(module, "GRADING_REPO_INODES", 2_000)
        monkeypatch.setattr(module, "GRADING_TMP_INODES", 500)

    async def go() -> tuple[str, str, str]:
        box = await _start(backend, grading=grading)
        try:
            if grading:
                await box.exec(
                    ["chown", "-R", f"{box.judged_uid}:{box.judged_uid}", box.workdir], timeout=60
                )
            fill = (
                "head -c 64M /dev/zero > fill; echo rc=$?; wc -c < fill; "
                'head -c 64M /dev/zero > "$TMPDIR/fill"; echo tmp=$?; rm -f fill; '
                "mkdir many && i=0; while [ $i -lt 5000 ]; do printf '' 2>/dev/null > many/$i || break; "
                "i=$((i+1)); done; echo files=$i"
            )
            r = await box.exec(["sh", "-c", fill], judged=grading, timeout=120)
            kinds = await box.exec(["sh", "-c", f"stat -f -c %T {box.workdir} /tmp"], timeout=30)
            root = str(getattr(box, "root", ""))
        finally:
            await box.close()
        return r.output, kinds.output, root

    out, kinds, root = run(go())
    lines = out.split()
    if not grading:  # the control: 64 MiB written whole, on disk, and 5,000 files
        assert "rc=0" in lines and "67108864" in lines and "files=5000" in lines, out
        return
    files = int(next(x for x in lines if x.startswith("files="))[6:])
    # The same caps on both backends (round 75: local's one tmpfs for the repository and /tmp
    # held a tree Docker's /testbed did not).
    assert files < 2_000, out
    assert "rc=1" in lines and "No space left" in out, out
    written = int(next(x for x in lines if x.isdigit()))
    assert written <= 24 << 20, written
    assert "tmp=1" in lines, out
    assert kinds.split() == ["tmpfs", "tmpfs"], kinds
    if root:  # local: the private folder's tmpfs mounts unmounted and gone
        assert not Path(root).exists()
        with open("/proc/self/mounts") as fh:
            assert root not in fh.read()


# Raises its own limit as far as it may, then opens files until it cannot.
_FILES_PROBE = r"""
import os, resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
try:
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard * 4, hard * 4))
    raised = "raised"
except (ValueError, OSError):
    raised = "refused"
fds = []
try:
    for _ in range(3000):
        fds.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
print(hard, raised, len(fds))
"""


@pytest.mark.parametrize("grading", [True, False])
def test_a_grading_sandbox_holds_a_bounded_share_of_the_hosts_open_files(
    backend: Any, grading: bool
) -> None:
    # Round 35: processes of a judged command each holding 19,000 open files filled the host's
    # one open-file table (every other grading and its control then fail). In a grading
    # sandbox no process may hold more than GRADING_OPEN_FILES, root's steps included, and
    # none can raise it; the control is a rollout sandbox, which inherits the host's limit.
    from legorl.sandbox.common import GRADING_OPEN_FILES

    async def go() -> list[list[str]]:
        box = await _start(backend, grading=grading)
        try:
            out = []
            for judged in [True, False] if grading else [False]:
                if judged:
                    await box.exec(
                        ["chown", "-R", f"{box.judged_uid}:{box.judged_uid}", box.workdir],
                        timeout=60,
                    )
                said = await _ok(box, ["python", "-c", _FILES_PROBE], judged=judged, timeout=60)
                out.append(said.split()[-3:])
        finally:
            await box.close()
        return out

    for hard, raised, opened in run(go()):
        if not grading:
            assert int(opened) == 3000, (hard, raised, opened)
            continue
        assert (int(hard), raised) == (GRADING_OPEN_FILES, "refused")
        assert int(opened) < GRADING_OPEN_FILES


def test_a_tree_too_deep_for_rmtree_goes_with_its_sandbox(
    local_backend: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A judged command leaves a 3,000-deep tree in /tmp and /testbed: Python's rmtree
    # recursed once per level and raised RecursionError, which left the folder behind for
    # good and made the next start's gc raise (a later trajectory's grading failed).
    from legorl.sandbox.common import remove_folder
    from legorl.sandbox.local_backend import gc_local

    deep = (
        "import os, sys\n"
        "os.chdir(os.path.expandvars(sys.argv[1]))\n"
        "for _ in range(3000):\n"
        "    os.mkdir('n')\n"
        "    os.chdir('n')\n"
    )

    async def go() -> str:
        box = await _start(local_backend, grading=True)
        try:
            await box.exec(
                ["chown", "-R", f"{box.judged_uid}:{box.judged_uid}", box.workdir], timeout=60
            )
            for where in ("$TMPDIR", box.workdir):
                r = await box.exec(["python", "-c", deep, where], judged=True, timeout=300)
                assert r.exit_code == 0, r.output
        finally:
            await box.close()
        return str(box.root)

    root = run(go())
    assert not Path(root).exists()
    # A dead run's leftover as deep, found by gc (in a state root of its own, away from other
    # tests' gc): removed, and gc does not raise.
    from legorl.sandbox.common import state_root

    monkeypatch.setenv("LEGORL_SANDBOX_STATE", str(tmp_path / "state"))
    left = state_root() / "legorl-deadbeef0000"
    left.mkdir()
    dead = f"{socket.gethostname()}:999999999:0"  # this host, no such process
    (left / "owner.json").write_text(json.dumps({"owner": dead, "run": "x"}))
    fd = os.open(left, os.O_RDONLY)
    for _ in range(3000):
        os.mkdir("n", dir_fd=fd)
        inner = os.open("n", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)
    old = time.time() - 7200
    os.utime(left, (old, old))
    try:
        gc_local()
        assert not left.exists()
    finally:
        remove_folder(left)


@pytest.mark.parametrize("grading", [False, True])
def test_the_judged_command_runs_the_tests(backend: Any, grading: bool) -> None:
    # The toy task's own suite passes as the judged user in either kind of sandbox (pytest
    # writes its cache into the repository and tmp files into TMPDIR).
    async def go() -> None:
        box = await _start(backend, grading=grading)
        try:
            r = await box.exec("python -m pytest -q", judged=True, timeout=120)
        finally:
            await box.close()
        assert r.exit_code == 0 and "passed" in r.output, r.output

    run(go())


#: Puts a key in the judged user's kernel keyring (``put``), or finds, reads and removes it
#: (``get``); prints the call's result and errno, and what it read.
_KEYRING_PROBE = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
calls = {"x86_64": (248, 250), "aarch64": (217, 219)}[os.uname().machine]
add_key, keyctl = calls
USER, desc = -4, sys.argv[2].encode()
libc.syscall.restype = ctypes.c_long
if sys.argv[1] == "put":
    r = libc.syscall(add_key, b"user", desc, b"the expected value", 18, USER)
    print(r, ctypes.get_errno(), "")
else:
    kid = libc.syscall(keyctl, 10, USER, b"user", desc, 0)  # KEYCTL_SEARCH
    err = ctypes.get_errno()
    data = b""
    if kid >= 0:
        buf = ctypes.create_string_buffer(64)
        n = libc.syscall(keyctl, 11, kid, buf, 64)  # KEYCTL_READ
        data = buf.raw[:max(n, 0)]
        libc.syscall(keyctl, 9, kid, USER)  # KEYCTL_UNLINK: the test leaves nothing behind
    print(kid, err, data.decode())
"""


def test_judged_commands_of_two_sandboxes_share_no_kernel_keyring(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Round 41 (local backend): the judged user of every sandbox is one host uid, and the
    # kernel keeps one user keyring per uid, which no namespace separates and which outlives
    # the sandbox. One grading's ordinary run put the test's expected values there, and the
    # judged run read them. Docker's default seccomp profile refuses the key calls; the local
    # backend's judged commands get a filter that does the same (`sandbox/seccomp.py`). Here
    # the two sandboxes share one judged uid (as every sandbox did then; each has its own now,
    # the next test), so that the filter alone stands between them.
    import errno
    import secrets

    from legorl.sandbox import common, docker_backend, local_backend, seccomp

    desc = f"legorl-test-{secrets.token_hex(4)}"
    shared = common.JUDGED_UID_BASE + 11
    for module in (docker_backend, local_backend):
        monkeypatch.setattr(module, "judged_uid", lambda: shared)

    async def go() -> tuple[list[str], list[str]]:
        one = await _start(backend, grading=True)
        two = await _start(backend, grading=True)
        try:
            put = await _ok(one, ["python", "-c", _KEYRING_PROBE, "put", desc], judged=True)
            got = await _ok(two, ["python", "-c", _KEYRING_PROBE, "get", desc], judged=True)
        finally:
            await one.close()
            await two.close()
        return put.split(" ", 2), got.split(" ", 2)

    put, got = run(go())
    assert (int(put[0]), int(put[1])) == (-1, errno.EPERM), put
    assert int(got[0]) == -1 and got[2].strip() == "", got
    if backend.name != "local":
        return
    # The control: the local backend's judged commands with a filter that allows every call.
    allow = seccomp.struct.pack("=HBBI", 0x06, 0, 0, seccomp.ALLOW).hex()
    monkeypatch.setattr(local_backend, "_command_filter", lambda: allow)
    put, got = run(go())
    assert int(put[0]) > 0, put
    assert got[2].strip() == "the expected value", got


def test_the_command_filter_is_known_per_machine_and_refused_elsewhere() -> None:
    from legorl.sandbox import seccomp

    for machine in seccomp.ABIS:
        program = seccomp.command_filter(machine)
        assert len(program) % 8 == 0 and len(program) // 8 <= 48
    with pytest.raises(ValueError, match="riscv64"):
        seccomp.command_filter("riscv64")


#: ``unshare`` of the namespaces a judged command could make, in a child (the parent carries on
#: whatever it gets), then a child process the usual way: prints the children's exit codes.
_USERNS_PROBE = r"""
import ctypes, os, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
def child(flags):
    pid = os.fork()
    if pid == 0:
        os._exit(0 if libc.unshare(flags) == 0 else ctypes.get_errno())
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
user = child(0x10000000)  # CLONE_NEWUSER
full = child(0x10000000 | 0x40000000 | 0x00020000)  # with CLONE_NEWNET and CLONE_NEWNS
spawned = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True)
print(user, full, spawned.stdout.strip())
"""


def test_a_judged_command_makes_no_user_namespace(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Round 67 (local backend): a judged command made user, network and mount namespaces and
    # mounted a tmpfs, where Docker's default profile refused it. A user namespace gives the
    # judged user every capability over namespaces of its own, each a way into more of the
    # kernel; the local backend's filter refuses it as Docker does (`sandbox/seccomp.py`), and
    # child processes are still made the usual way.
    import errno

    from legorl.sandbox import local_backend, seccomp

    async def go() -> list[str]:
        box = await _start(backend, grading=True)
        try:
            out = await _ok(box, ["python", "-c", _USERNS_PROBE], judged=True)
        finally:
            await box.close()
        return out.split()

    user, full, spawned = run(go())
    assert (int(user), int(full)) == (errno.EPERM, errno.EPERM), (user, full)
    assert spawned == "42"
    if backend.name != "local":
        return
    # The control: the local backend's judged commands with a filter that allows every call.
    allow = seccomp.struct.pack("=HBBI", 0x06, 0, 0, seccomp.ALLOW).hex()
    monkeypatch.setattr(local_backend, "_command_filter", lambda: allow)
    user, full, spawned = run(go())
    assert (int(user), int(full), spawned) == (0, 0, "42")


#: Opens inotify instances: ``hold N S`` holds N for S seconds; ``count`` opens as many as the
#: kernel lets its user have and prints how many.
_INOTIFY_PROBE = r"""
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
fds = []
while sys.argv[1] == "count" or len(fds) < int(sys.argv[2]):
    fd = libc.inotify_init1(0)
    if fd < 0:
        break
    fds.append(fd)
print(len(fds), flush=True)
if sys.argv[1] == "hold":
    time.sleep(float(sys.argv[3]))
"""


def test_judged_commands_of_two_sandboxes_share_no_per_user_count(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Round 42 (Docker): every sandbox's judged user was one host uid, and the kernel counts
    # some things per user whatever the namespaces (inotify instances, processes, pipe
    # buffers): one passing trajectory's ordinary run, which holds the tests as written,
    # signalled their expected values to another trajectory's judged run by holding a number
    # of inotify instances. Each sandbox now has a uid of its own.
    import asyncio

    from legorl.sandbox import common, docker_backend, local_backend

    most = int(Path("/proc/sys/fs/inotify/max_user_instances").read_text())

    async def go() -> tuple[int, int]:
        one = await _start(backend, grading=True)
        two = await _start(backend, grading=True)
        try:
            holding = asyncio.Event()  # set when the holder prints how many it holds
            loop = asyncio.get_running_loop()  # Docker's output comes on the exec's thread
            hold = asyncio.ensure_future(
                one.exec(
                    ["python", "-c", _INOTIFY_PROBE, "hold", "100", "20"],
                    judged=True,
                    on_output=lambda chunk: loop.call_soon_threadsafe(holding.set),
                )
            )
            await asyncio.wait_for(holding.wait(), 60)
            counted = await _ok(two, ["python", "-c", _INOTIFY_PROBE, "count"], judged=True)
            held = (await hold).output
        finally:
            await one.close()
            await two.close()
        return int(held.split()[0]), int(counted.split()[-1])

    held, counted = run(go())
    assert held == 100 and counted == most, (held, counted)
    # The control: the two sandboxes with one judged uid between them, as before.
    shared = common.JUDGED_UID_BASE + 7
    for module in (docker_backend, local_backend):
        monkeypatch.setattr(module, "judged_uid", lambda: shared)
    held, counted = run(go())
    assert held == 100 and counted <= most - 100, (held, counted)


# "hold": takes a POSIX read lock and a shared flock on each file a sandbox's judged code can
# open that the host (or the image, or Docker: its init) provides, prints, and sleeps. "look": asks, per file,
# whether a lock of another process conflicts (F_GETLK for a write lock, a non-blocking
# exclusive flock), and prints them as JSON.
_LOCK_PROBE = r"""
import errno, fcntl, json, os, struct, sys, time
files = ["/usr/lib/os-release", "/etc/passwd", os.path.realpath(sys.executable), os.__file__,
         os.path.join(sys.prefix, "pyvenv.cfg"), "/dev/null", "/dev/urandom", "/sbin/docker-init"]
files = [f for f in files if os.path.exists(f)]
spot = struct.pack("hhqqi4x", fcntl.F_RDLCK, 0, 1 << 40, 1, 0)
fds = {f: os.open(f, os.O_RDONLY) for f in files}
if sys.argv[1] == "hold":
    for fd in fds.values():
        fcntl.fcntl(fd, fcntl.F_SETLK, spot)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    print("held", len(fds), flush=True)
    time.sleep(float(sys.argv[2]))
else:
    out = {}
    for f, fd in fds.items():
        ask = struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, 0, 0, 0)
        posix = struct.unpack("hhqqi4x", fcntl.fcntl(fd, fcntl.F_GETLK, ask))[0] != fcntl.F_UNLCK
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            flocked = False
        except OSError as exc:
            assert exc.errno == errno.EWOULDBLOCK, exc
            flocked = True
        out[f] = [posix, flocked]
    print(json.dumps(out))
"""


def test_judged_commands_of_two_sandboxes_share_no_lockable_file(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Round 43 (local backend): every sandbox bound the host's folders read-only, and a bind
    # keeps the inode, which locks belong to. One trajectory's judged run held read locks on
    # /usr/lib/os-release at offsets spelling the expected values; another's judged run read
    # them back with F_GETLK. A local judged command now sees its root (a tmpfs copy) through
    # overlays of its sandbox's own, with device nodes of its own (`sandbox/view.py`); a Docker
    # grading container's image folders are overlays of its own too (`memory_root.py`).
    import asyncio

    from legorl.sandbox import local_backend
    from legorl.sandbox.common import mount_points

    roots: list[str] = []

    async def go(same: bool) -> dict[str, list[bool]]:
        one = await _start(backend, grading=True)
        two = one if same else await _start(backend, grading=True)
        # A local sandbox's folder; a Docker grading container's, which holds its view
        roots.extend(str(getattr(box, "root", None) or box._folder) for box in (one, two))
        try:
            holding = asyncio.Event()  # set when the holder says it holds
            loop = asyncio.get_running_loop()  # Docker's output comes on the exec's thread
            hold = asyncio.ensure_future(
                one.exec(
                    ["python", "-c", _LOCK_PROBE, "hold", "20"],
                    judged=True,
                    on_output=lambda chunk: loop.call_soon_threadsafe(holding.set),
                )
            )
            await asyncio.wait_for(holding.wait(), 60)
            seen = await _ok(two, ["python", "-c", _LOCK_PROBE, "look"], judged=True)
            held = (await hold).output.split()
            assert held[0] == "held" and int(held[1]) >= 7, held
        finally:
            await one.close()
            if not same:
                await two.close()
        return dict(json.loads(seen.strip().splitlines()[-1]))

    seen = run(go(same=False))
    assert len(seen) >= 7 and not any(any(v) for v in seen.values()), seen
    # The views' mounts went with their sandboxes.
    assert not [p for p in mount_points() if any(p.startswith(r) for r in roots)]
    # The control: two judged commands of one sandbox see each other's locks on every file.
    seen = run(go(same=True))
    assert len(seen) >= 7 and all(all(v) for v in seen.values()), seen
    if backend.name != "local":
        return
    # And the local backend's sandboxes with the host's folders bound as they are, as before.
    monkeypatch.setattr(local_backend, "mount_view", lambda root: None)
    seen = run(go(same=False))
    assert len(seen) >= 7 and all(all(v) for v in seen.values()), seen


_ZOMBIES = (
    "import os\n"
    "states = []\n"
    "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
    "    try:\n"
    "        states.append(open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0])\n"
    "    except OSError:\n"
    "        pass\n"
    "print('zombies', states.count('Z'))\n"
)


def test_a_docker_grading_container_reaps_what_its_judged_commands_orphan(
    docker_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A grading container's first process is legorl's own reaper, not Docker's init (a host
    # file bound into every container, which two containers' judged code could both lock).
    import asyncio

    from legorl.sandbox import docker_backend as module

    async def go() -> str:
        box = await _start(docker_backend, grading=True)
        try:
            # A grandchild orphaned at once, which exits a moment later.
            await _ok(box, ["sh", "-c", "(sleep 1 &) ; exit 0"], judged=True)
            await asyncio.sleep(4)
            return await _ok(box, ["python3", "-c", _ZOMBIES])
        finally:
            await box.close()

    assert run(go()).split() == ["zombies", "0"]
    # The control: `sleep` as the first process, which never waits for the orphans it gets.
    monkeypatch.setattr(module, "_REAPER", ["sleep"])
    assert run(go()).split() == ["zombies", "1"]


def test_a_folder_no_overlay_can_name_is_refused_by_name(tmp_path: Path) -> None:
    # An overlay's lower folder cannot hold ':' or ',' (the mount's own separators): such a
    # folder (a LEGORL_MEMORY_ROOTS that names one) is refused with its name, before any mount
    # is made.
    from legorl.protocols import SandboxError
    from legorl.sandbox import view

    found = view.View(tmp_path)
    odd = tmp_path / "a:b"
    odd.mkdir()
    with pytest.raises(SandboxError, match=f"{odd}.*':'"):
        found.ro_bind(str(odd), "/opt/ab")
    assert [p.name for p in tmp_path.iterdir()] == ["a:b"]  # nothing made
