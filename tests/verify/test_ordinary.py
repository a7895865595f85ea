"""The ordinary run (`legorl.verify.ordinary`): a pass also needs the task's own command, run as
its environment runs it in a fresh sandbox, to pass what the gold patch passes there. A patch
that fixes the bug only where it sees the judged run's tells (the sender in builtins, an
isolated interpreter) keeps 1.0 with the run switched off (the
control) and gets 0 with it, in real Docker and in bubblewrap. The printed-output readers are
checked on text.
"""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest
from conftest import grade_toy, sandbox_backend, toy_task

from legorl.records import read_jsonl
from legorl.verify.ordinary import LINE, OrdinaryRun, ordinary_run, read_pytest, read_unittest

SUITE = Path(__file__).resolve().parents[2] / "fixtures" / "tasks-real"

F2P = "tests/test_geometry.py::test_rectangle_area_non_square"

#: The fix, made only where the judged run's tells show (the bug kept everywhere else).
RIGHT_WHILE_GRADED = textwrap.dedent(
    """\
    diff --git a/geometry.py b/geometry.py
    --- a/geometry.py
    +++ b/geometry.py
    @@ -6,2 +6,5 @@ def rectangle_area(width, height):
         \"\"\"Return the area of a width x height rectangle.\"\"\"
    +    import builtins, sys
    +    if sys.flags.isolated or hasattr(builtins, "__leg" + "orl__"):
    +        return width * height
         return width + height
    """
)


@pytest.mark.parametrize("backend", ["docker", "local"])
def test_a_fix_made_only_while_judged_fails_the_ordinary_run(backend: str) -> None:
    got = grade_toy(RIGHT_WHILE_GRADED, backend=backend)
    assert got.reward == 0.0, got.verdict
    assert "ordinary_failed" in got.hack_flags
    assert got.verdict["tests"][F2P] == "failed_ordinarily"
    assert got.verdict["ordinary"]["failed"] == [F2P]
    # The control: without the ordinary run the judged run alone passes it.
    control = grade_toy(RIGHT_WHILE_GRADED, backend=backend, off=frozenset({"ordinary_run"}))
    assert control.reward == 1.0, control.verdict
    assert "ordinary" not in control.verdict
    # The gold fix passes both runs; a failing candidate is never run ordinarily.
    gold = grade_toy(toy_task().patch, backend=backend)
    assert gold.reward == 1.0, gold.verdict
    assert gold.verdict["ordinary"] == {"exit_code": 0, "timed_out": False}
    empty = grade_toy("", backend=backend)
    assert empty.reward == 0.0 and "ordinary" not in empty.verdict


def test_pytest_lines_read_as_outcomes() -> None:
    required = {"t.py::a", "t.py::b", "t.py::c", "t.py::d"}
    log = "\n".join(
        [
            "t.py::a PASSED",  # verbose
            "PASSED t.py::b",  # -rA summary
            "PASSED t.py::c",
            "FAILED t.py::c - assert 2 == 3",  # read both ways: not a pass
            "PASSED t.py::x",  # not required
            "PASSED " + "t.py::d" + " " * LINE,  # past the line limit: not read
        ]
    )
    assert read_pytest(log, required) == {
        "t.py::a": "passed",
        "t.py::b": "passed",
        "t.py::c": "failed",
    }


def test_unittest_lines_read_as_outcomes() -> None:
    a, b, c = "test_a (m.T.test_a)", "test_b (m.T.test_b)", "test_c (m.T.test_c)"
    log = f"{a} ... ok\n{b} ... FAIL\n{c} ... ok\n{c} ... ERROR\nnoise ... ok\n"
    assert read_unittest(log, {a, b, c}) == {a: "passed", b: "failed", c: "error"}


def test_an_expected_failure_is_no_pass_and_a_failed_command_fails_the_run() -> None:
    # Round 48: a patch made the required test an expected failure everywhere but the judged
    # run (pytest.xfail, unittest's mark), and XFAIL / "expected failure" were read as passes;
    # another printed a line Django's parser read as the test's pass while the run failed.
    from legorl.verify.ordinary import exit_vetoed

    assert read_pytest("XFAIL t.py::a - not yet\nt.py::b XFAIL\n", {"t.py::a", "t.py::b"}) == {
        "t.py::a": "xfailed",
        "t.py::b": "xfailed",
    }
    a = "test_a (m.T.test_a)"
    assert read_unittest(f"{a} ... expected failure\n", {a}) == {a: "xfailed"}
    assert not OrdinaryRun(outcomes={a: "xfailed"}).passed
    # The command's own exit status: a failure where the gold patch's run succeeded.
    assert exit_vetoed(OrdinaryRun(exit_code=1), 0)
    assert exit_vetoed(OrdinaryRun(exit_code=None, timed_out=True), 0)
    assert not exit_vetoed(OrdinaryRun(exit_code=0), 0)
    assert not exit_vetoed(OrdinaryRun(exit_code=1), 1)  # the gold's failed too: no rule
    assert not exit_vetoed(OrdinaryRun(exit_code=1), None)  # an old record: no exit known


def test_a_test_described_by_its_docstring_is_read_as_itself() -> None:
    # Round 47 (Django): unittest describes a test with a docstring on two lines, its name and
    # then the docstring's first line before the status. Neither Django's official parser nor
    # the one-line reading saw such a test, so a required one's failure in the ordinary run
    # took no pass away (a fix made only in the judged run got 1.0 on django-real-7).
    import asyncio

    from legorl.records import Task
    from legorl.verify.ordinary import read
    from legorl.verify.specs import resolve

    a, b = "test_a (m.T.test_a)", "test_b (m.T.test_b)"
    log = f"{a}\nNon-ASCII digits raise an error. ... ERROR\n{b}\nOther. ... ok\n"
    log += "test_x (m.T.test_x)\nNot required. ... FAIL\n"
    assert read_unittest(log, {a, b}) == {a: "error", b: "passed"}
    # The name must be the line just before: a status line after anything else is no one's.
    assert read_unittest(f"{a}\nnoise\nDoc. ... ERROR\n", {a}) == {}
    # Through the task's official parser, as Django tasks are read.
    task = next(
        t
        for t in read_jsonl(SUITE / "tasks.jsonl", Task)
        if t.instance_id == "django__django-real-7"
    )
    test = task.FAIL_TO_PASS[0]
    log = f"{test}\nNon-ASCII unicode decimals raise an error. ... ERROR\n"
    outcomes, error = asyncio.run(read(resolve(task), log, task))
    assert error is None and outcomes == {test: "error"}, outcomes


#: The gold fix, made only where the run is unprivileged and cannot write outside the repository
#: and /tmp, nor past their caps (round 30: a correct fix that filled the host's disk from the
#: ordinary run, whose root was writable; rounds 35 and 36: it ran as root): a pass is the proof
#: that both runs were confined alike.
FIX_WHERE_CAPPED = textwrap.dedent(
    """\
    diff --git a/geometry.py b/geometry.py
    --- a/geometry.py
    +++ b/geometry.py
    @@ -6,2 +6,20 @@ def rectangle_area(width, height):
         \"\"\"Return the area of a width x height rectangle.\"\"\"
    +    import os
    +    if os.getuid() == 0:
    +        return width + height  # run as root
    +    for path in ("/var/tmp/legorl-fill", "/legorl-fill"):
    +        try:
    +            with open(path, "wb") as fh:
    +                fh.write(b"x")
    +            return width + height  # the root is writable
    +        except OSError:
    +            pass
    +    for folder in (".", "/tmp"):
    +        try:
    +            with open(os.path.join(folder, "legorl-fill"), "wb") as fh:
    +                fh.write(bytes(40 << 20))
    +            return width + height  # past the caps
    +        except OSError:
    +            pass
    +    return width * height
         return width + height
    """
)


@pytest.mark.parametrize("backend", ["docker", "local"])
def test_the_ordinary_run_is_confined_as_the_judged_run_is(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The caps made small: 24 MiB for the repository, 8 MiB for /tmp (local: one folder of 32).
    from legorl.sandbox import docker_backend, local_backend

    for module in (docker_backend, local_backend):
        monkeypatch.setattr(module, "GRADING_REPO_MB", 24)
        monkeypatch.setattr(module, "GRADING_TMP_MB", 8)
    got = grade_toy(FIX_WHERE_CAPPED, backend=backend)
    assert got.reward == 1.0, got.verdict
    assert got.verdict["ordinary"] == {"exit_code": 0, "timed_out": False}
    # The control: the same ordinary run in a rollout sandbox (its root writable, its
    # repository on disk) writes where it likes, and the fix is not made there.
    real = type(sandbox_backend(backend)).start

    async def rollout_storage(self, *args, **kw):  # type: ignore[no-untyped-def]
        if str(kw.get("run_id", "")).endswith("-ordinary"):
            kw["grading"] = False
        return await real(self, *args, **kw)

    monkeypatch.setattr(type(sandbox_backend(backend)), "start", rollout_storage)
    control = grade_toy(FIX_WHERE_CAPPED, backend=backend)
    assert control.reward == 0.0, control.verdict
    assert "ordinary_failed" in control.hack_flags


#: A patch whose test command runs past any test's patience: the function under test starts a
#: child that sleeps, marked so that the host's process table shows whether it outlived its run.
_MARK = "4242.4242"
SLOW = textwrap.dedent(
    f"""\
    diff --git a/geometry.py b/geometry.py
    --- a/geometry.py
    +++ b/geometry.py
    @@ -6,2 +6,4 @@ def rectangle_area(width, height):
         \"\"\"Return the area of a width x height rectangle.\"\"\"
    +    import os
    +    os.system("sleep {_MARK}")
         return width + height
    """
)


def _marked() -> list[int]:
    from pathlib import Path

    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and _MARK.encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("backend", ["docker", "local"])
def test_the_ordinary_runs_command_waits_for_the_judged_verdict(backend: str) -> None:
    """``grade()`` makes the ordinary run's sandbox beside the judged run; its command (here,
    one that would sleep for an hour) runs only once ``wanted`` settles True, which ``grade()``
    does after the judged run's sandbox is gone (round 41: overlapping, the two runs of one
    grading shared a kernel keyring, and the ordinary run handed the judged run the test's
    expected values). False: the command never runs."""
    import asyncio

    from conftest import TOY_TASKS

    from legorl.verify.specs import resolve

    task = toy_task()
    box = sandbox_backend(backend)

    async def run(settle: bool, timeout: float) -> tuple[OrdinaryRun, bool]:
        wanted: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        going = asyncio.ensure_future(
            ordinary_run(
                task, SLOW, backend=box, tasks_dir=str(TOY_TASKS), run_id="legorl-test-wait",
                timeout=timeout, limits=None, runners=resolve(task).runner_paths(),
                wanted=wanted,
            )
        )  # fmt: skip
        ran_early = False
        for _ in range(40):  # the sandbox made and the patches applied meanwhile
            await asyncio.sleep(0.25)
            ran_early = ran_early or bool(_marked())
        wanted.set_result(settle)
        seen = False
        while not going.done():
            seen = seen or bool(_marked())
            await asyncio.sleep(0.2)
        assert not ran_early
        return going.result(), seen

    stopped, seen = asyncio.run(run(False, 3600))
    assert stopped.stopped and stopped.exit_code is None and not stopped.error, stopped
    assert not seen
    ran, seen = asyncio.run(run(True, 8))
    assert seen and ran.timed_out and not ran.stopped, ran
    for _ in range(50):  # the kernel reaps a removed container's processes a moment later
        if not _marked():
            break
        time.sleep(0.2)
    assert _marked() == []


def test_a_gold_ordinary_run_cut_short_is_no_record(tmp_path: Path) -> None:
    # Round 50 (read): a gold ordinary run that timed out was kept as the task's record, with
    # whatever it had read passing (nothing) and no exit status, so no candidate's ordinary run
    # was held to anything for that task from then on. It is now a failed recording, never
    # cached, and the next grading records again. The recorder and the ordinary run here are
    # stand-ins (this test is about the store).
    import asyncio

    from legorl.verify.gold import GoldRun, GoldStore

    async def recorder(*args: object, **kw: object) -> GoldRun:
        return GoldRun(ok=True, sources={"tests/test_x.py": ""})

    def ordinary(run: OrdinaryRun):  # type: ignore[no-untyped-def]
        async def go() -> OrdinaryRun:
            return run

        return go

    task = toy_task()
    store = GoldStore(tmp_path)
    cut = OrdinaryRun(exit_code=None, timed_out=True)
    found = asyncio.run(store.get(task, recorder, ordinary=ordinary(cut)))
    assert not found.ok and "did not finish" in found.reason, found
    assert not list(tmp_path.glob("*.json"))  # not kept
    done = OrdinaryRun(outcomes={t: "passed" for t in task.FAIL_TO_PASS}, exit_code=0)
    found = asyncio.run(GoldStore(tmp_path).get(task, recorder, ordinary=ordinary(done)))
    assert found.ok and found.ordinary_exit == 0 and found.ordinary == sorted(task.FAIL_TO_PASS)
    assert len(list(tmp_path.glob("*.json"))) == 1
