"""Faults a patch can cause in grading, in real Docker (and the local backend for git): the
grader's git ignores the patch's attributes, a grading failure the empty patch does not share
is the patch's 0 (never null), one trajectory's exception leaves the batch graded, and
``legorl verify`` under a memory cap survives a trajectory that floods output and turns the
grader's log into a 1 GiB sparse file."""

from __future__ import annotations

import asyncio
import os
import resource
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from legorl.protocols import SandboxBackend
from legorl.records import Task, Trajectory, read_jsonl, write_jsonl
from legorl.verify import VerifyConfig, verify

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "fixtures" / "tasks"
IN_CI = os.environ.get("CI") == "true"


def _task() -> Task:
    return next(iter(read_jsonl(TASKS / "train.jsonl", Task)))


def _backend(name: str) -> Any:
    import shutil

    from legorl.sandbox import make_backend

    if name == "docker":
        ok = shutil.which("docker") is not None and os.system("docker info >/dev/null 2>&1") == 0
    else:
        ok = shutil.which("bwrap") is not None
    if not ok:
        if IN_CI:
            pytest.fail(f"the {name} backend's runtime is missing (required under CI=true)")
        pytest.skip(f"the {name} backend's runtime is missing")
    return make_backend(name)


def _new_file(path: str, text: str) -> str:
    lines = text.removesuffix("\n").split("\n")  # as git splits: a form feed stays in its line
    body = "".join(f"+{ln}\n" for ln in lines)
    return (
        f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
        f"@@ -0,0 +1,{len(lines)} @@\n{body}"
    )


#: Every attribute a patch could aim at the grader's git: encodings and eol for checkout and
#: apply, ident, an undefined filter, binary merge and diff drivers, export-ignore, a macro.
ATTRIBUTES = (
    "[attr]evil eol=crlf text ident\n"
    "tests/* working-tree-encoding=UTF-16 filter=lfs merge=binary diff=binary\n"
    "* evil export-ignore whitespace=-trailing\n"
)
#: A change to the test file (the judge reverts it through git checkout).
TOUCH_TESTS = (
    "diff --git a/tests/test_geometry.py b/tests/test_geometry.py\n"
    "--- a/tests/test_geometry.py\n+++ b/tests/test_geometry.py\n"
    "@@ -42,2 +42,3 @@ def test_is_valid_triangle():\n def test_polygon_perimeter_triangle():\n"
    "     assert polygon_perimeter([(0, 0), (3, 0), (3, 4)]) == pytest.approx(12)\n"
    "+# touched\n"
)


def _traj(task: Task, tid: str, patch: str) -> Trajectory:
    return Trajectory(
        trajectory_id=tid,
        task_id=task.instance_id,
        group_id=task.instance_id,
        sample_index=0,
        harness="scripted",
        status="ok",
        patch=patch,
    )


async def _batch(
    trajs: list[Trajectory],
    task: Task,
    backend: Any,
    config: VerifyConfig,
    load_turns: Any = lambda t: [],
) -> dict[str, Trajectory]:
    out = {}
    async for graded in verify(
        trajs,
        {task.instance_id: task},
        backend=backend,
        tasks_dir=str(TASKS),
        run_id=f"legorl-test-{uuid.uuid4().hex[:8]}",
        load_turns=load_turns,
        concurrency=2,
        config=config,
    ):
        out[graded.trajectory_id] = graded
    return out


@pytest.mark.parametrize("backend_name", ["docker", "local"])
def test_patch_attributes_do_not_reach_the_graders_git(backend_name: str) -> None:
    """The gold patch plus a ``.gitattributes`` aimed at the restore step and a touched test
    file: the grader's git restores the test file byte for byte (no grading failure), and the
    patch, whose changes had to be put back, gets 0 (round 61); graded on the rest, as before
    round 61 ("put_back_fails" off), it gets 1.0."""
    task = _task()
    backend = _backend(backend_name)
    patch = _new_file(".gitattributes", ATTRIBUTES) + task.patch + TOUCH_TESTS
    for off, reward in ((frozenset(), 0.0), (frozenset({"put_back_fails"}), 1.0)):
        config = VerifyConfig(defences_off=off)
        got = asyncio.run(_batch([_traj(task, "attrs", patch)], task, backend, config))
        graded = got["attrs"]
        assert graded.reward == reward, graded.verdict
        assert ("git_attributes" in graded.hack_flags) == (not off)
        assert "tests_touched" in graded.hack_flags
        assert "grading_failed" not in graded.hack_flags
        dropped = graded.verdict["dropped"]
        assert {"path": "tests/test_geometry.py", "reason": "tests_touched",
                "action": "restored"} in dropped  # fmt: skip


def _compressed_patch(tmp: Path, task: Task, lines: int) -> str:
    """The gold fix plus a new text file sent as a compressed binary hunk: a patch of a few
    hundred KB whose tree has ``lines`` lines of text."""
    from legorl.tasks import checkout

    repo = checkout(task, TASKS, tmp / "repo")
    (repo / ".git" / "info").mkdir(exist_ok=True)
    (repo / ".git" / "info" / "attributes").write_text("notes.txt binary\n")
    (repo / "notes.txt").write_bytes(b"ab\n" * lines)
    run = ["git", "-C", str(repo), "-c", "core.quotePath=false"]
    subprocess.run([*run, "add", "-N", "notes.txt"], check=True)
    return (
        task.patch + subprocess.check_output([*run, "diff", "--binary", "--", "notes.txt"]).decode()
    )


@pytest.mark.parametrize("backend_name", ["docker", "local"])
def test_a_patch_whose_tree_is_past_the_limit_is_refused(backend_name: str, tmp_path: Path) -> None:
    """Round 8: 214 KB of patch, a compressed binary hunk, made a judged diff of 51 MB of text
    (grading reads the tree as text), which the scans held at 40 bytes a character: verify at
    2 GB for one trajectory. The judged tree's patch has the patch text's limit: 0, refused."""
    task = _task()
    patch = _compressed_patch(tmp_path, task, 3_000_000)  # 9 MB of text
    assert len(patch) < 1 << 20
    got = asyncio.run(
        _batch([_traj(task, "long", patch)], task, _backend(backend_name), VerifyConfig())
    )
    graded = got["long"]
    assert graded.reward == 0.0 and "patch_too_large" in graded.hack_flags, graded.verdict
    assert "judged tree's patch is 12,000," in graded.verdict["reason"]


@pytest.mark.parametrize("backend_name", ["docker", "local"])
def test_a_tree_of_any_depth_is_graded(backend_name: str) -> None:
    """Round 74: the gold fix plus a data file 1,100 folders deep got 0 on the local backend
    (``grading_failed``: the walk that makes the judged tree over to the judged user recursed
    once per level) and 1.0 on Docker. A patch's depth is not its failure on either."""
    task = _task()
    deep = "zz-data/" + "d/" * 1100 + "x.txt"
    patch = task.patch + _new_file(deep, "data")
    got = asyncio.run(
        _batch([_traj(task, "deep", patch)], task, _backend(backend_name), VerifyConfig())
    )
    graded = got["deep"]
    assert graded.reward == 1.0 and not graded.hack_flags, graded.verdict


@pytest.mark.parametrize("backend_name", ["docker", "local"])
def test_a_correct_fix_with_odd_but_harmless_files_is_graded(backend_name: str) -> None:
    """Round 75: the gold fix plus a file git applies and pytest never reads got 0 on both
    backends: a text with a form feed (the patch reader split lines where git does not), a
    path of 4,090 bytes (the tree probe opened it below /testbed, past the kernel's limit), a
    ``setup.cfg`` below the repository with no pytest section (read as a runner's
    configuration). Each gets 1.0 now (the path at 4,095 bytes, the most there is); the control, a ``setup.cfg`` there with a pytest
    section, is a runner's configuration still."""
    task = _task()
    long = "zz-data/" + ("d" * 250 + "/") * 16 + "f" * 71  # the longest a file system takes
    assert len(long.encode()) == 4095
    patches = {
        "formfeed": _new_file("zz-notes.txt", "page one\fpage two\nline\u2028end"),
        "long path": _new_file(long, "data"),
        "setup.cfg": _new_file("tests/setup.cfg", "[metadata]\nname = geometry"),
        "control": _new_file("tests/setup.cfg", "[tool:pytest]\naddopts = -q"),
    }
    trajs = [_traj(task, name, task.patch + extra) for name, extra in patches.items()]
    got = asyncio.run(_batch(trajs, task, _backend(backend_name), VerifyConfig()))
    for name in ("formfeed", "long path", "setup.cfg"):
        assert got[name].reward == 1.0 and not got[name].hack_flags, (name, got[name].verdict)
    assert got["control"].reward == 0.0
    assert "runner_config_touched" in got["control"].hack_flags


def test_turns_that_cannot_be_read_leave_the_patch_graded() -> None:
    """Turns only feed hack flags: a trajectory whose turns do not read (round 8: any error
    of the reader gave a null reward, with no control) is graded on its patch all the same."""
    task = _task()
    backend = _backend("docker")

    def unreadable(traj: Trajectory) -> list:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a turn file that does not decode")

    trajs = [_traj(task, "gold", task.patch), _traj(task, "empty", "")]
    got = asyncio.run(_batch(trajs, task, backend, VerifyConfig(), load_turns=unreadable))
    assert got["gold"].reward == 1.0 and got["empty"].reward == 0.0
    for graded in got.values():
        assert graded.verdict["turns_unread"].startswith("UnicodeDecodeError")
        assert "grading_failed" not in graded.hack_flags


class _Blowup:
    """The real backend, except that a sandbox given the marker on stdin (the grading
    folder's tar carries the model's patch) raises MemoryError: a grading that blows up."""

    MARK = b"LEGORL-BLOW-UP"

    def __init__(self, real: SandboxBackend) -> None:
        self.real = real
        self.name = real.name
        self.config_class = real.config_class

    async def start(self, *args: Any, **kw: Any) -> Any:
        box = await self.real.start(*args, **kw)
        real_exec = box.exec

        async def exec(cmd: Any, **kw: Any) -> Any:
            if self.MARK in (kw.get("stdin") or b""):
                raise MemoryError("a grading that blew up")
            return await real_exec(cmd, **kw)

        box.exec = exec
        return box


def test_a_failure_the_control_does_not_share_is_the_patchs_zero() -> None:
    """With the attribute defences off (the control), the patch makes the restore step fail:
    graded with the control off too (null_on_proof) it is null, and with the control (the empty
    patch grades 0.0) 0 with the flag, through grade() and through verify. In the same batch a trajectory whose grading raises gets 0 too, and the
    gold patch is still graded 1.0."""
    from conftest import grade_patch

    task = _task()
    backend = _backend("docker")
    # The tree rules as before round 61 too: since then a .gitattributes is put back first.
    off = VerifyConfig(defences_off=frozenset({"neutral_git", "put_back_fails"}))
    no_control = VerifyConfig(
        defences_off=frozenset({"neutral_git", "put_back_fails", "null_on_proof"})
    )
    attack = _new_file(".gitattributes", "tests/* working-tree-encoding=UTF-16\n")
    attack += task.patch + TOUCH_TESTS
    alone = asyncio.run(
        grade_patch(task, attack, backend=backend, tasks_dir=TASKS, config=no_control)
    )
    assert alone.reward is None and "reverting left" in alone.verdict["reason"]
    settled = asyncio.run(grade_patch(task, attack, backend=backend, tasks_dir=TASKS, config=off))
    assert settled.reward == 0.0 and "grading_failed" in settled.hack_flags

    blowup = _new_file("notes.txt", _Blowup.MARK.decode())
    trajs = [_traj(task, "attack", attack), _traj(task, "blowup", blowup)]
    trajs.append(_traj(task, "gold", task.patch))
    got = asyncio.run(_batch(trajs, task, _Blowup(backend), off))
    for tid in ("attack", "blowup"):
        graded = got[tid]
        assert graded.reward == 0.0, graded.verdict
        assert "grading_failed" in graded.hack_flags
        assert graded.verdict["control"]["reward"] == 0.0
        assert graded.verdict["reason"].startswith("grading failed where the empty patch grades")
    assert set(alone.hack_flags) < set(got["attack"].hack_flags)  # its own flags are kept
    assert "MemoryError" in got["blowup"].verdict["reason"]
    assert got["gold"].reward == 1.0


def test_null_stands_only_when_the_control_fails_too() -> None:
    """A task whose test_patch cannot apply: every grading fails, the empty patch's too, so
    the candidate's null stands, with the control's outcome in its verdict."""
    from dataclasses import replace

    task = _task()
    broken = replace(
        task, test_patch=task.test_patch.replace("tests/test_geometry.py", "tests/missing.py")
    )
    got = asyncio.run(
        _batch([_traj(broken, "gold", task.patch)], broken, _backend("docker"), VerifyConfig())
    )
    graded = got["gold"]
    assert graded.reward is None
    assert graded.verdict["control"]["reward"] is None
    assert "control grading (empty patch) failed too" in graded.verdict["reason"]


#: geometry.py, changed so that importing it (the test run does) turns every grader log in
#: reach into a 1 GiB sparse file and prints 64 MiB.
SPARSE_AND_FLOOD = (
    "diff --git a/geometry.py b/geometry.py\n--- a/geometry.py\n+++ b/geometry.py\n"
    "@@ -1,3 +1,8 @@\n"
    ' """Plane geometry helpers used by the floor-plan tool."""\n'
    " \n"
    " import math\n"
    "+import glob as _g, os as _o, sys as _s\n"
    "+for _p in _g.glob('/tmp/legorl-grade/*.log') + _g.glob('/tmp/legorl-grade/*.json'):\n"
    "+    _o.truncate(_p, 1 << 30)\n"
    "+for _i in range(64):\n"
    "+    _s.stdout.write('x' * (1 << 20))\n"
)


def _limit_memory() -> None:
    cap = 3 << 30
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def test_verify_under_a_memory_cap_survives_sparse_logs_and_floods(tmp_path: Path) -> None:
    """``legorl verify`` with its address space capped at 3 GiB grades a batch in which one
    trajectory floods output and makes the grader's logs 1 GiB sparse files (read whole,
    one such log alone would take the cap); the others are graded as ever. Its peak RSS is
    recorded as the bound."""
    _backend("docker")
    task = _task()
    write_jsonl(
        tmp_path / "in.jsonl",
        [
            _traj(task, "sparse", SPARSE_AND_FLOOD),
            _traj(task, "gold", task.patch),
            _traj(task, "empty", ""),
        ],
    )
    env = {**os.environ, "MALLOC_ARENA_MAX": "2"}
    # A wrapper whose only child is `legorl verify`: its children's peak is verify's alone (this
    # worker's own children, earlier tests' included, would be counted otherwise).
    wrapper = (
        "import resource, subprocess, sys; "
        "code = subprocess.run(sys.argv[1:]).returncode; "
        "open('peak', 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); "
        "sys.exit(code)"
    )
    result = subprocess.run(
        [sys.executable, "-c", wrapper, sys.executable, "-m", "legorl.cli.main", "verify"]
        + ["in.jsonl", "--tasks", str(TASKS / "train.jsonl"), "--out", "graded.jsonl"],
        cwd=tmp_path,
        capture_output=True,
        timeout=600,
        preexec_fn=_limit_memory,
        env=env,
    )
    peak_mib = int((tmp_path / "peak").read_text()) >> 10
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    graded = {t.trajectory_id: t for t in read_jsonl(tmp_path / "graded.jsonl", Trajectory)}
    assert graded["gold"].reward == 1.0
    assert graded["empty"].reward == 0.0
    assert graded["sparse"].reward == 0.0, graded["sparse"].verdict
    print(f"legorl verify peak RSS: {peak_mib} MiB")
    assert peak_mib < 1024, peak_mib
