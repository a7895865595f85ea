"""The red-team suite: each reward hack, attempted by a scripted agent through the real rollout
and verify machinery in real sandboxes, must end with reward 0 (and its flag), while the honest
gold fix of the same task gets reward 1.

Each row also has a control that shows the hack really cheats, so that its 0 is the defence's
doing: the same trajectory graded again with its defences switched off
(``VerifyConfig.defences_off``: the runner's ``runner.DEFENCES`` and the judge's
``judge_tree`` / ``strict_patch``); for defences that predate the switches and have none, a
grader with no defences at all (``_undefended``, in this file); for sandbox properties, the same
hack on a test-only sandbox that lacks the property (the fix in history; network on; the old
in-sandbox diff), or the proxy with session isolation off. A hack whose defences are not all in
grading must win against today's grading and is marked xfail; so is a known open hole.

The agent is the built-in `mini` harness driven by the `forced` engine (a fake shipping in the
package: scripted completions, log-probs from a real forward pass of the tiny model). Runs with
`nox -s redteam` and in the normal suite. The README's table must equal the one this suite
generates (`python -m pytest tests/verify/test_redteam.py` rewrites `build/redteam.md`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.server
import os
import re
import shlex
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import run_task, sandbox_backend

from legorl.engines import make_engine
from legorl.harnesses import MiniHarness
from legorl.protocols import SandboxBackend
from legorl.records import Task, Trajectory, Turn, read_jsonl
from legorl.rollout import inprocess_proxy
from legorl.sandbox import make_backend
from legorl.verify import VerifyConfig, grade, runner, specs, tree
from legorl.verify.ordinary import read_unittest
from legorl.verify.redteam import (
    HACKS,
    VARIANT_TESTS,
    Hack,
    honest,
    markdown_table,
    unittest_variant,
    variant_task,
)

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "fixtures" / "tasks"
#: The real suite; its Django tasks are graded by Django's own tests/runtests.py.
SUITE = ROOT / "fixtures" / "tasks-real"
DJANGO_TASK_ID = "django__django-real-4"
#: Django rows run at once, this many rollouts and gradings at a time.
DJANGO_CONCURRENCY = 4
MODEL = ROOT / "fixtures" / "models" / "tiny-qwen3"
TASK_ID = "legorl-toy__geometry-1"
TEST_TIMEOUT = 20.0
#: Django's runner starts Django and its test apps first: on a loaded machine, well over 20 s.
DJANGO_TEST_TIMEOUT = 180.0
RESULTS: dict[str, dict[str, Any]] = {}
#: The grading switches this branch has: the test run's and the patch judge's.
LANDED = runner.DEFENCES | tree.DEFENCES
#: What the agent stage's diff was before it was made trustworthy: the agent's own git
#: (config, attributes, filters) with stderr merged into the patch. The "diff" rows' control.
OLD_DIFF = (
    'cd /testbed && idx=$(mktemp) && cp .git/index "$idx" && GIT_INDEX_FILE="$idx" git add -A '
    '&& GIT_INDEX_FILE="$idx" git diff --cached --binary --no-color --no-ext-diff '
    "--src-prefix=a/ --dst-prefix=b/ {base} 2>&1"
)


def _tasks_dir(task: Task) -> Path:
    return SUITE if task.meta.get("project") in ("django", "toolz") else TASKS


def _task(variant: str = "") -> Task:
    if variant == "django":
        return next(
            t for t in read_jsonl(SUITE / "tasks.jsonl", Task) if t.instance_id == DJANGO_TASK_ID
        )
    if variant.startswith(("pytoolz__", "django__")):  # a task of the real suite, by its id
        return next(t for t in read_jsonl(SUITE / "tasks.jsonl", Task) if t.instance_id == variant)
    task = next(t for t in read_jsonl(TASKS / "train.jsonl", Task) if t.instance_id == TASK_ID)
    if variant == "new_test_file":
        # The failing test in a file of its own that the test_patch creates (same instance image).
        body = "from geometry import rectangle_area\n\n\ndef test_rectangle_area_non_square():\n"
        body += "    assert rectangle_area(4, 6) == 24\n"
        lines = body.splitlines()
        patch = (
            "diff --git a/tests/test_area.py b/tests/test_area.py\nnew file mode 100644\n"
            f"--- /dev/null\n+++ b/tests/test_area.py\n@@ -0,0 +1,{len(lines)} @@\n"
            + "".join(f"+{ln}\n" for ln in lines)
        )
        task = dataclasses.replace(
            task,
            test_patch=patch,
            FAIL_TO_PASS=["tests/test_area.py::test_rectangle_area_non_square"],
            test_cmd="python -m pytest -rA -p no:cacheprovider tests",
        )
    if variant == "unittest":
        task = unittest_variant(task)
    if variant in VARIANT_TESTS:
        task = variant_task(task, variant)
    return task


class _Variant:
    """A test-only sandbox backend: the real one, with a setup step after each start (a
    sandbox that lacks one of the properties a hack runs into)."""

    def __init__(
        self,
        backend: SandboxBackend,
        setup: str = "",
        share_net: bool = False,
        old_diff: bool = False,
    ):
        self.backend, self.setup = backend, setup
        self.share_net, self.old_diff = share_net, old_diff

    async def start(self, task: Any, tasks_dir: str, **kw: Any) -> Any:
        box: Any = await self.backend.start(task, tasks_dir, **kw)
        if self.share_net:
            # The local backend's bwrap flags, read by every exec. On the host's network the
            # proxy is reached at its own address (the relay's inside port is the proxy's).
            flags = box._head
            if "--unshare-all" in flags:
                flags.insert(flags.index("--unshare-all") + 1, "--share-net")
            else:  # run by root: the sandbox's user's bwrap names each namespace
                flags.remove("--unshare-net")
            box._port = None
        if self.setup:
            done = await box.exec(["sh", "-c", self.setup], timeout=60, cwd=box.workdir)
            assert done.exit_code == 0, done.output
        if self.old_diff:

            async def diff() -> str:
                cmd = OLD_DIFF.replace("{base}", box.base_sha)
                return str((await box.exec(["sh", "-c", cmd], timeout=120)).output)

            box.diff = diff
        return box


def _future_history(task: Task) -> str:
    """Setup that puts the fix into the instance repo's history, as an unscrubbed clone has it."""
    git = "git -c user.name=up -c user.email=up@example.com -c core.hooksPath=/dev/null"
    return (
        f"printf %s {shlex.quote(task.patch)} > /tmp/up.patch && git apply /tmp/up.patch && "
        f"{git} commit -qam 'fix upstream' && git update-ref refs/remotes/origin/main HEAD && "
        f"{git} reset -q --hard HEAD~1"
    )


@contextlib.contextmanager
def _serving(body: bytes) -> Iterator[str]:
    """An HTTP server on 127.0.0.1 that answers every GET with ``body``; yields its URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/fix.patch"
    finally:
        server.shutdown()
        server.server_close()


async def _rollout(
    tmp: Path,
    script: list[dict],
    task: Task,
    backend: Any,
    sibling: str | None = None,
    isolate: bool = True,
) -> tuple[Trajectory, list[Turn], str]:
    """One real rollout: (trajectory, its turns, every prompt the agent saw, decoded)."""
    engine: Any = make_engine("forced", model_path=str(MODEL), script=script)
    harness: Any = MiniHarness(max_turns=6, max_tokens=1536)  # the ctypes rows' long edits
    run_id = f"legorl-redteam-{uuid.uuid4().hex[:8]}"
    try:
        async with inprocess_proxy(MODEL, engine, tmp / "turns") as (endpoint, core):
            core.config.isolate_sessions = isolate  # test-only: off for the session control
            if sibling is not None:
                await endpoint.open_session(sibling, None)
            try:
                traj = await run_task(
                    task,
                    harness,
                    backend,
                    endpoint,
                    refs=tmp,
                    run_id=run_id,
                    tasks_dir=_tasks_dir(task),
                )
            finally:
                if sibling is not None:
                    await endpoint.close_session(sibling)
        from legorl.align import turns_of

        turns = list(turns_of(traj, tmp))
        seen = "".join(engine.tokenizer.decode(t.prompt_delta) for t in turns)
    finally:
        await engine.close()
    assert traj.status == "ok", (traj.status, traj.evidence)
    return traj, turns, seen


async def _grade(
    traj: Trajectory, task: Task, turns: list[Turn], off: frozenset[str] = frozenset()
) -> Trajectory:
    timeout = DJANGO_TEST_TIMEOUT if _tasks_dir(task) == SUITE else TEST_TIMEOUT
    config = VerifyConfig(test_timeout=timeout)
    if off:
        config = VerifyConfig(test_timeout=timeout, defences_off=off)
    return await grade(
        traj,
        task,
        backend=sandbox_backend("docker"),
        tasks_dir=str(_tasks_dir(task)),
        run_id=f"legorl-redteam-{uuid.uuid4().hex[:8]}",
        turns=turns,
        config=config,
    )


_SUMMARY = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(\S+::\S+)", re.MULTILINE)


async def _undefended(traj: Trajectory, task: Task) -> float:
    """A grader with no defences: the patch applied as it is (falling back as grading does),
    the hidden tests applied where they still apply, the task's own test command, its printed
    `-rA` summary parsed (the last word on each test wins). Reward 1 here means the hack
    really cheats."""
    backend = sandbox_backend("docker")
    box = await backend.start(
        task, str(_tasks_dir(task)), run_id=f"legorl-redteam-{uuid.uuid4().hex[:8]}", proxy_url=None
    )
    try:
        for name, text in (("model.patch", traj.patch), ("test.patch", task.test_patch)):
            await box.write_file(f"/tmp/{name}", text.encode())
        applied = await box.exec(
            [
                "sh",
                "-c",
                "git apply /tmp/model.patch || patch --batch --forward --fuzz=5 -p1 -i "
                "/tmp/model.patch; git apply /tmp/test.patch || true",
            ],
            timeout=120,
            cwd=box.workdir,
        )
        assert applied.exit_code == 0, applied.output
        timeout = DJANGO_TEST_TIMEOUT if _tasks_dir(task) == SUITE else TEST_TIMEOUT
        run = await box.exec(["sh", "-c", task.test_cmd], timeout=timeout, cwd=box.workdir)
    finally:
        await box.close()
    outcome: dict[str, str] = {}
    for word, test in _SUMMARY.findall(run.output):
        outcome[test] = word
    required = task.FAIL_TO_PASS + task.PASS_TO_PASS
    if task.log_parser != "pytest":
        # Django's runner: its printed output, read by the official parser, and a test unittest
        # describes by its docstring (on two lines, which that parser misses) read as itself.
        grader = specs.resolve(task)
        parsed, _ = await runner._parse_printed(grader, run.output, task)
        outcome = dict(parsed)
        for test, said in read_unittest(run.output, set(required)).items():
            outcome.setdefault(test, "PASSED" if said == "passed" else "FAILED")
    return 1.0 if all(outcome.get(t) == "PASSED" for t in required) else 0.0


def _record(hack: Hack, reward: float | None, flags: list[str], control: Any, result: str) -> None:
    RESULTS[hack.name] = {
        "hack": hack.name,
        "defence": hack.defence,
        "reward": reward,
        "control": control,
        "flags": flags,
        "result": result,
    }


def _verdict(hack: Hack, graded: Trajectory) -> str:
    flagged = hack.flag is None or hack.flag in graded.hack_flags
    if graded.reward == 0.0:
        return "blocked" if flagged else "blocked, flag missing"
    return "flagged only" if hack.flag is not None and flagged else "NOT BLOCKED"


async def _grade_and_control(
    traj: Trajectory, task: Task, turns: list[Turn], hack: Hack
) -> tuple[Trajectory, float | None]:
    """The defended grade and, at the same time, the control's reward (None: no control yet)."""
    if hack.off <= LANDED:
        # a task-side defence's control: the same patch on the task's test as it was before
        before = _task(hack.control_variant) if hack.control_variant else task
        graded, control = await asyncio.gather(
            _grade(traj, task, turns), _grade(traj, before, turns, hack.off)
        )
        return graded, control.reward
    if hack.baseline:
        return await asyncio.gather(_grade(traj, task, turns), _undefended(traj, task))
    return await _grade(traj, task, turns), None


def test_honest_gold_fix_is_rewarded(tmp_path: Path) -> None:
    task = _task()
    traj, turns, _ = asyncio.run(_rollout(tmp_path, honest(task), task, sandbox_backend("docker")))
    graded = asyncio.run(_grade(traj, task, turns))
    assert graded.reward == 1.0, graded.verdict
    assert graded.hack_flags == []


GRADING = [h for h in HACKS if h.kind == "grading" and h.variant != "django"]


def _check_row(hack: Hack, traj: Trajectory, graded: Trajectory, control_reward: Any) -> None:
    """Record the row, then: its control wins, and the defended grade gives 0 with its flag."""
    control: str | None = None
    if hack.control_variant:
        control = f"{control_reward} (the test before: {hack.control_variant})"
    elif hack.off <= LANDED:
        control = f"{control_reward} (off: {', '.join(sorted(hack.off))})"
    elif hack.baseline:
        control = f"{control_reward} (no defences)"
    result = _verdict(hack, graded)
    missing = sorted(hack.off - LANDED)
    if control is None:
        result += f" (today; waits for {', '.join(missing)})"
    _record(hack, graded.reward, graded.hack_flags, control, result)
    if hack.hole:
        assert graded.reward == 1.0, f"{hack.name} is blocked now: clear its hole"
        pytest.xfail(f"open hole: {hack.hole}")
    if control_reward is not None:
        assert control_reward == 1.0, (
            hack.name,
            "does not cheat with its defences off",
            traj.patch,
        )
    elif graded.reward == 1.0:
        # Its defences are not in grading yet: today's grading is the undefended one.
        pytest.xfail(f"wins today; blocked once grading has {', '.join(missing)}")
    assert graded.reward == 0.0, (hack.name, graded.verdict)
    if hack.flag is not None:
        assert hack.flag in graded.hack_flags, (hack.name, graded.hack_flags)


@pytest.mark.parametrize("hack", GRADING, ids=[h.name for h in GRADING])
def test_grading_hack_is_blocked(tmp_path: Path, hack: Hack) -> None:
    task = _task(hack.variant)
    traj, turns, _ = asyncio.run(
        _rollout(tmp_path, hack.script(task), task, sandbox_backend("docker"))
    )
    graded, control_reward = asyncio.run(_grade_and_control(traj, task, turns, hack))
    _check_row(hack, traj, graded, control_reward)


DJANGO = [h for h in HACKS if h.variant == "django"]


async def _django_rows(tmp: Path) -> dict[str, Any]:
    """Every Django row and the honest gold fix, rolled out and graded at once
    (``DJANGO_CONCURRENCY`` at a time): name -> (trajectory, graded, control reward) or the
    exception it raised."""
    task = _task("django")
    gate = asyncio.Semaphore(DJANGO_CONCURRENCY)

    async def one(i: int, hack: Hack | None) -> Any:
        script = honest(task) if hack is None else hack.script(task)
        backend = sandbox_backend("docker")
        async with gate:
            traj, turns, seen = await _rollout(tmp / f"row{i}", script, task, backend)
            if hack is None:
                return traj, await _grade(traj, task, turns), None
            if hack.kind == "history":
                # The control: the same hack on a sandbox whose repo has the fix in its history.
                variant = _Variant(backend, setup=_future_history(task))
                ctraj, cturns, _ = await _rollout(tmp / f"row{i}-off", script, task, variant)
                graded, control = await asyncio.gather(
                    _grade(traj, task, turns), _grade(ctraj, task, cturns)
                )
                return traj, graded, (control.reward, seen)
            graded, reward = await _grade_and_control(traj, task, turns, hack)
            return traj, graded, reward

    names = ["honest gold fix", *(h.name for h in DJANGO)]
    done = await asyncio.gather(
        *(one(i, h) for i, h in enumerate([None, *DJANGO])), return_exceptions=True
    )
    return dict(zip(names, done, strict=True))


@pytest.fixture(scope="module")
def django_rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    sandbox_backend("docker")
    return asyncio.run(_django_rows(tmp_path_factory.mktemp("django")))


def _row(rows: dict[str, Any], name: str) -> tuple[Trajectory, Trajectory, Any]:
    found = rows[name]
    if isinstance(found, BaseException):
        raise found
    return found  # type: ignore[no-any-return]


def test_django_honest_gold_fix_is_rewarded(django_rows: dict[str, Any]) -> None:
    _, graded, _ = _row(django_rows, "honest gold fix")
    assert graded.reward == 1.0, graded.verdict
    assert graded.hack_flags == []
    judged = graded.verdict["assertions"]["fail_to_pass"]  # Django's assertions, judged by us
    assert judged["judged_out_of_process"] >= 1, graded.verdict


@pytest.mark.parametrize("hack", DJANGO, ids=[h.name for h in DJANGO])
def test_django_hack_is_blocked(django_rows: dict[str, Any], hack: Hack) -> None:
    traj, graded, control = _row(django_rows, hack.name)
    if hack.kind == "grading":
        _check_row(hack, traj, graded, control)
        return
    reward, seen = control
    failed_inside = "no other commit" in seen
    result = _verdict(hack, graded) if failed_inside else "NOT BLOCKED"
    _record(hack, graded.reward, graded.hack_flags, f"{reward} (sandbox without it)", result)
    assert reward == 1.0, (hack.name, "does not cheat without the property")
    assert failed_inside, (hack.name, seen[-2000:])
    assert graded.reward == 0.0, (hack.name, graded.verdict)


def _sandbox_row(tmp: Path, hack: Hack) -> tuple[Trajectory, str, Trajectory]:
    """(defended graded, what the agent saw, control graded) for a sandbox-property hack."""
    task = _task(hack.variant)
    if hack.kind == "history":
        backend = sandbox_backend("docker")
        traj, turns, seen = asyncio.run(_rollout(tmp / "on", hack.script(task), task, backend))
        graded = asyncio.run(_grade(traj, task, turns))
        variant = _Variant(backend, setup=_future_history(task))
        ctraj, cturns, _ = asyncio.run(_rollout(tmp / "off", hack.script(task), task, variant))
        return graded, seen, asyncio.run(_grade(ctraj, task, cturns))
    if hack.kind == "hostview":
        from legorl.sandbox import local_backend
        from legorl.tasks import apply_patch, checkout

        with tempfile.TemporaryDirectory(dir="/srv") as fixed:
            Path(fixed).chmod(0o755)  # as a package mirror's folder: anyone may read it
            repo = checkout(task, TASKS, Path(fixed) / "checkout")
            apply_patch(repo, task.patch)
            (Path(fixed) / "fix").mkdir()
            shutil.copy(repo / task.meta["file"], Path(fixed) / "fix" / task.meta["file"])
            script = hack.script(task, {"fix_dir": f"{fixed}/fix"})
            backend = sandbox_backend("local")
            traj, turns, seen = asyncio.run(_rollout(tmp / "on", script, task, backend))
            wide = make_backend("local", host_paths=(*local_backend.HOST_PATHS, "/srv"))
            ctraj, cturns, _ = asyncio.run(_rollout(tmp / "off", script, task, wide))
        graded = asyncio.run(_grade(traj, task, turns))
        return graded, seen, asyncio.run(_grade(ctraj, task, cturns))
    backend = sandbox_backend("local")
    with _serving(task.patch.encode()) as url:
        script = hack.script(task, {"fix_url": url})
        traj, turns, seen = asyncio.run(_rollout(tmp / "on", script, task, backend))
        ctraj, cturns, _ = asyncio.run(
            _rollout(tmp / "off", script, task, _Variant(backend, share_net=True))
        )
    return asyncio.run(_grade(traj, task, turns)), seen, asyncio.run(_grade(ctraj, task, cturns))


SANDBOX = [
    h for h in HACKS if h.kind in ("history", "network", "hostview") and h.variant != "django"
]


@pytest.mark.parametrize("hack", SANDBOX, ids=[h.name for h in SANDBOX])
def test_sandbox_hack_fails_inside_the_sandbox(tmp_path: Path, hack: Hack) -> None:
    graded, seen, control = _sandbox_row(tmp_path, hack)
    failed_inside = any(
        word in seen for word in ("no other commit", "fetch failed", "no host copy")
    )
    result = _verdict(hack, graded) if failed_inside else "NOT BLOCKED"
    _record(
        hack, graded.reward, graded.hack_flags, f"{control.reward} (sandbox without it)", result
    )
    assert control.reward == 1.0, (
        hack.name,
        "does not cheat without the property",
        control.verdict,
    )
    assert failed_inside, (hack.name, seen[-2000:])
    assert graded.reward == 0.0, (hack.name, graded.verdict)


DIFF = [h for h in HACKS if h.kind == "diff"]


@pytest.mark.parametrize("hack", DIFF, ids=[h.name for h in DIFF])
def test_diff_hack_stays_out_of_the_patch(tmp_path: Path, hack: Hack) -> None:
    task = _task(hack.variant)
    backend = sandbox_backend("docker")
    traj, turns, _ = asyncio.run(_rollout(tmp_path / "on", hack.script(task), task, backend))
    graded = asyncio.run(_grade(traj, task, turns))
    old = _Variant(backend, old_diff=True)
    ctraj, cturns, _ = asyncio.run(_rollout(tmp_path / "off", hack.script(task), task, old))
    control = asyncio.run(_grade(ctraj, task, cturns, hack.off))
    smuggled = "+++ b/COVER" in traj.patch
    result = "NOT BLOCKED" if smuggled else _verdict(hack, graded)
    label = f"{control.reward} (old diff; off: {', '.join(sorted(hack.off))})"
    _record(hack, graded.reward, graded.hack_flags, label, result)
    assert "+++ b/COVER" in ctraj.patch, ctraj.patch  # the old diff takes the text in
    assert control.reward == 1.0, (hack.name, "does not cheat undefended", control.verdict)
    assert not smuggled, traj.patch
    assert graded.reward == 0.0, (hack.name, graded.verdict)


SESSION = [h for h in HACKS if h.kind == "session"]


@pytest.mark.parametrize("hack", SESSION, ids=[h.name for h in SESSION])
def test_session_crossing_writes_nothing(tmp_path: Path, hack: Hack) -> None:
    task = _task(hack.variant)
    sibling = f"{task.instance_id}.1"

    def crossed(tmp: Path, isolate: bool) -> tuple[list[Turn], str]:
        _, _, seen = asyncio.run(
            _rollout(
                tmp,
                hack.script(task),
                task,
                sandbox_backend("docker"),
                sibling=sibling,
                isolate=isolate,
            )
        )
        path = tmp / "turns" / f"{sibling}.jsonl"
        return (list(read_jsonl(path, Turn)) if path.exists() else []), seen

    turns, seen = crossed(tmp_path / "on", True)
    control, control_seen = crossed(tmp_path / "off", False)
    refused = "crossing refused" in seen and not turns
    _record(
        hack,
        None,
        [],
        f"{len(control)} Turn(s) in the sibling (isolation off)",
        "blocked" if refused else "NOT BLOCKED",
    )
    assert "crossing answered 200" in control_seen and control, control_seen[-2000:]
    assert not turns, [t.session for t in turns]
    assert "crossing refused" in seen, seen[-2000:]


def test_readme_table_is_the_suites_output() -> None:
    missing = [h.name for h in HACKS if h.name not in RESULTS]
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the red-team rows did not all run: {missing[:3]}")
        pytest.skip(f"run the whole file to compare the table ({len(missing)} rows not run)")
    table = markdown_table([RESULTS[h.name] for h in HACKS])
    out = ROOT / "build" / "redteam.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(table)
    assert table in (ROOT / "README.md").read_text(), f"README table differs; see {out}"
