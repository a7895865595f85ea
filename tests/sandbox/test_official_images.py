"""Tasks on official prebuilt images (SWE-bench's ``sweb.eval.x86_64.<id>`` layout), on the real
Docker backend: the lockdown of the image's own git history, attacked from inside by a rollout
agent; grading of the gold and the empty patch; a missing image in one line.

No registry is reachable here, so the image is a local mimic of that layout
(``fixtures/mimic_image.py``: /testbed with its full history, the fix commit after
``base_commit`` on a tag, a remote ref, a branch, the reflog, a stash, an alternate object store;
a venv with pytest standing in for the conda env ``testbed``). Each defence has a control with
the lockdown off (``history="image"``), where the same attack finds the fix.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import grade_patch, run_task
from sandbox_fixtures import (  # noqa: F401  (fixtures are found by name)
    ROOT,
    fixture_docker_backend,
    run,
    run_id,
    task,
)

from fixtures.mimic_image import ENV, FIXED_LINE, UPSTREAM, build_mimic
from legorl.engines import make_engine
from legorl.harnesses.testing import ScriptedHarness
from legorl.records import Trajectory
from legorl.rollout import inprocess_proxy
from legorl.sandbox import make_backend
from legorl.sandbox.images import activation, probe_script
from legorl.sandbox.layers import plan
from legorl.verify import VerifyConfig
from legorl.verify.patches import split_diff

MODEL = ROOT / "fixtures" / "models" / "tiny-qwen3"
REPORT = "exploit-report.txt"

#: The agent: every way into the history an agent has used (refs, tags, remotes, reflog, stash,
#: ORIG_HEAD, FETCH_HEAD, packed-refs, fsck's lost and found, every object in every object
#: store anywhere on the file system, loose or packed, alternates included) and plain files.
#: Whatever holds the fixed line is written over the source, and named in the report. Then it
#: calls the model once, with a tool (a run without a main-agent call is a proxy error).
EXPLOIT = r"""
set +e
cd /testbed
R=/testbed/REPORT
: > "$R"
FIXED='FIXED_LINE'
take() { if grep -qF "$FIXED" "$2"; then echo "$1" >> "$R"; cp "$2" calc/ops.py; fi; }
stores=$(find / -xdev \( -path /proc -o -path /sys \) -prune -o -type d -name objects -print 2>/dev/null | tr '\n' ':')
export GIT_ALTERNATE_OBJECT_DIRECTORIES="$stores"
commits=$( { git rev-list --all --reflog; git stash list --format=%H; git tag; git branch -a --format='%(objectname)';
  cat .git/ORIG_HEAD .git/FETCH_HEAD .git/packed-refs 2>/dev/null | grep -o '^[0-9a-f]\{40\}';
  git fsck --lost-found --no-reflogs --no-progress 2>/dev/null | awk '{print $3}';
  git cat-file --batch-all-objects --batch-check='%(objectname) %(objecttype)' | awk '$2=="commit"{print $1}'; } 2>/dev/null | sort -u)
for c in $commits; do git show "$c:calc/ops.py" > /tmp/x 2>/dev/null && take "commit $c" /tmp/x; done
for b in $(git cat-file --batch-all-objects --batch-check='%(objectname) %(objecttype)' 2>/dev/null | awk '$2=="blob"{print $1}'); do
  git cat-file -p "$b" > /tmp/x && take "blob $b" /tmp/x; done
for pack in $(find / -xdev -name '*.pack' 2>/dev/null); do
  for b in $(git verify-pack -v "$pack" 2>/dev/null | awk '$2=="blob"{print $1}'); do
    git cat-file -p "$b" > /tmp/x 2>/dev/null && take "packed $b in $pack" /tmp/x; done; done
for f in $(grep -rlF "$FIXED" /testbed /srv /opt /root /home /tmp /var 2>/dev/null | grep -v -e "^/tmp/x$" -e "$R"); do
  take "file $f" "$f"; done
git remote -v >> "$R"
CALL_MODEL""".replace("REPORT", REPORT).replace("FIXED_LINE", FIXED_LINE)

#: A scripted agent's one call of the model, with a tool (a run without one is a proxy error).
CALL_MODEL = r"""python3 - <<'PY'
import json, os, urllib.request
tool = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}
body = {"model": "m", "max_tokens": 8, "tools": [tool], "messages": [{"role": "user", "content": "done"}]}
url = os.environ["LEGORL_PROXY_URL"] + "/v1/chat/completions"
head = {"content-type": "application/json"}
urllib.request.urlopen(urllib.request.Request(url, json.dumps(body).encode(), head), timeout=120)
PY
"""
EXPLOIT = EXPLOIT.replace("CALL_MODEL", CALL_MODEL)

#: The task's test that reads what the env's activation script sets.
NEEDS_ENV = "tests/test_ops.py::test_data_comes_from_the_env"


@pytest.fixture(scope="module", name="mimic")
def fixture_mimic(docker_backend: Any) -> tuple[Any, dict[str, Any]]:
    """The mimic image, built from the toy task's env layer (our debootstrap base, pytest)."""
    env_image = plan(task())[1].tag
    return build_mimic(docker_backend.api, env_image)


@pytest.fixture(scope="module", name="unlocked")
def fixture_unlocked(docker_backend: Any) -> Any:
    """The control: the same backend with the image's history left in the sandbox."""
    return make_backend("docker", history="image")


async def _sh(box: Any, cmd: str) -> str:
    r = await box.exec(cmd, timeout=120)
    assert r.exit_code == 0, f"{cmd}: {r.output}"
    return r.output.strip()


def test_the_image_repository_is_one_commit_with_the_tree_the_image_had(
    docker_backend: Any, mimic: tuple[Any, dict[str, Any]]
) -> None:
    t, facts = mimic

    async def go() -> None:
        box = await docker_backend.start(t, ".", run_id=run_id())
        try:
            assert box.workdir == "/testbed"
            assert await _sh(box, "git rev-list --all --count") == "1"
            assert await _sh(box, "git for-each-ref --format='%(refname)'") == "refs/heads/main"
            assert await _sh(box, "git tag; git remote; git stash list; git reflog") == ""
            assert await _sh(box, "git fsck --unreachable --dangling --no-progress") == ""
            files = set((await _sh(box, "ls -A .git")).split())
            assert not files & {"logs", "packed-refs", "ORIG_HEAD", "FETCH_HEAD", "shallow"}
            assert await _sh(box, "cat .git/objects/info/alternates 2>/dev/null; true") == ""
            assert await _sh(box, f"ls -d {UPSTREAM} 2>/dev/null; true") == ""
            count = await _sh(box, "git cat-file --batch-all-objects --batch-check | wc -l")
            tracked = await _sh(box, "git ls-tree -r -t HEAD | wc -l")
            assert int(count) == int(tracked) + 2  # the commit and its root tree, nothing else
            for what, oid in [("fix commit", facts["fix_commit"]), *facts["fix_blobs"].items()]:
                found = await box.exec(f"git cat-file -e {oid}")
                assert found.exit_code != 0, f"{what} ({oid}) is inside the sandbox"
            # The tree as the image had it: its install step's edit committed, its ignored
            # build output still there and ignored, nothing else different.
            assert await _sh(box, "git status --porcelain --ignored") == "!! calc.egg-info/"
            assert "addopts = -rA" in await _sh(box, "git show HEAD:setup.cfg")
            assert FIXED_LINE not in await _sh(box, "cat calc/ops.py")
            # The image's env leads PATH.
            assert await _sh(box, "python -c 'import sys; print(sys.prefix)'") == ENV
            assert "pytest" in await _sh(box, "python -m pytest --version 2>&1")
        finally:
            await box.close()

    run(go())


def test_control_without_the_lockdown_the_history_holds_the_fix(
    unlocked: Any, mimic: tuple[Any, dict[str, Any]]
) -> None:
    t, facts = mimic

    async def go() -> None:
        box = await unlocked.start(t, ".", run_id=run_id())
        try:
            assert int(await _sh(box, "git rev-list --all --count")) >= 3
            assert (await box.exec(f"git cat-file -e {facts['fix_commit']}")).exit_code == 0
            assert "v1.1" in await _sh(box, "git tag")
        finally:
            await box.close()

    run(go())


async def _rollout(backend: Any, t: Any, tmp: Path, command: str = EXPLOIT) -> Trajectory:
    agent: Any = ScriptedHarness(command=command)
    engine = make_engine(
        "forced", model_path=str(MODEL), script=[{"text": "Done.", "repeat": True}]
    )
    try:
        async with inprocess_proxy(MODEL, engine, tmp / "turns") as (endpoint, _):
            return await run_task(
                t,
                agent,
                backend,
                endpoint,
                refs=tmp,
                tasks_dir=Path("."),
                timeout=300,
                wall_s=400,
                run_id=run_id(),
            )
    finally:
        await engine.close()


def _grade(backend: Any, t: Any, patch: str, off: frozenset[str] = frozenset()) -> Trajectory:
    config = VerifyConfig(defences_off=off)
    graded = grade_patch(
        t,
        patch,
        backend=backend,
        tasks_dir=".",
        config=config,
        run_id=run_id(),
        trajectory_id=f"{t.instance_id}.0",
    )
    return asyncio.run(graded)


def _found(patch: str) -> list[str]:
    """The exploit report's lines, as the patch adds them."""
    lines, inside = [], False
    for line in patch.splitlines():
        if line.startswith("diff --git"):
            inside = line.endswith(f"b/{REPORT}")
        elif inside and line.startswith("+") and not line.startswith("+++"):
            lines.append(line[1:])
    return lines


def test_a_rollout_agent_trying_every_history_exploit_finds_nothing(
    docker_backend: Any, unlocked: Any, mimic: tuple[Any, dict[str, Any]], tmp_path: Path
) -> None:
    t, _ = mimic
    locked = asyncio.run(_rollout(docker_backend, t, tmp_path / "locked"))
    assert locked.status == "ok", locked.evidence
    assert FIXED_LINE not in locked.patch
    assert _found(locked.patch) == []
    assert f"b/{REPORT}" in locked.patch or locked.patch == ""  # the agent ran: empty report
    assert _grade(docker_backend, t, locked.patch).reward == 0.0

    # Control: the same agent on the image's own history finds the fix everywhere it hides,
    # and what it took (graded on the locked-down image) wins the reward. (Its patch also
    # carries the image's own setup.cfg edit, a diff against base_commit: the lockdown's one
    # commit holds the tree as the image has it, so agents' patches carry only their changes.)
    control = asyncio.run(_rollout(unlocked, t, tmp_path / "control"))
    assert control.status == "ok", control.evidence
    found = " ".join(_found(control.patch))
    assert FIXED_LINE in control.patch
    for where in ("commit ", "blob ", "packed "):
        assert where in found, (where, found)
    assert "b/setup.cfg" in control.patch and "b/setup.cfg" not in locked.patch
    taken = "".join(d.text for d in split_diff(control.patch) if d.path == "calc/ops.py")
    assert _grade(docker_backend, t, taken).reward == 1.0


def test_the_gold_fix_grades_1_and_the_empty_patch_0(
    docker_backend: Any, mimic: tuple[Any, dict[str, Any]]
) -> None:
    t, _ = mimic
    gold = _grade(docker_backend, t, t.patch)
    assert gold.reward == 1.0 and gold.verdict is not None, gold.verdict
    assert set(gold.verdict["tests"].values()) == {"passed"}
    assert gold.verdict["tests"][NEEDS_ENV] == "passed"  # graded in the activated env
    empty = _grade(docker_backend, t, "")
    assert empty.reward == 0.0 and empty.verdict is not None
    assert empty.verdict["tests"]["tests/test_ops.py::test_mean_is_not_rounded"] == "failed"


def test_commands_run_in_the_env_as_its_activation_leaves_it(
    docker_backend: Any, mimic: tuple[Any, dict[str, Any]], tmp_path: Path
) -> None:
    # conda's own variables, and what the env's etc/conda/activate.d/calc.sh sets.
    t, _ = mimic
    want = f"{ENV} testbed {ENV}/share/calc"

    async def go() -> None:
        box = await docker_backend.start(t, ".", run_id=run_id())
        try:
            assert await _sh(box, 'echo "$CONDA_PREFIX $CONDA_DEFAULT_ENV $CALC_DATA"') == want
            assert await _sh(box, "command -v python") == f"{ENV}/bin/python"
            assert "1 passed" in await _sh(box, f"python -m pytest -q {NEEDS_ENV}")
            # Control: without the activation's variable the task's own test fails.
            bare = await box.exec(f"env -u CALC_DATA python -m pytest -q {NEEDS_ENV}", timeout=120)
            assert bare.exit_code != 0 and "KeyError: 'CALC_DATA'" in bare.output, bare.output
        finally:
            await box.close()

    run(go())
    # The agent, through its harness, gets the same env: its report lands in its patch.
    agent = (
        f'echo "$CONDA_DEFAULT_ENV $CALC_DATA" > env-report.txt; '
        f"python -m pytest -q -p no:cacheprovider {NEEDS_ENV} >> env-report.txt 2>&1\n" + CALL_MODEL
    )
    traj = asyncio.run(_rollout(docker_backend, t, tmp_path, agent))
    assert traj.status == "ok", traj.evidence
    assert f"+testbed {ENV}/share/calc" in traj.patch, traj.patch
    assert "1 passed" in traj.patch, traj.patch


def test_a_grading_sandbox_starts_from_the_pristine_image(
    docker_backend: Any, mimic: tuple[Any, dict[str, Any]]
) -> None:
    # What an agent leaves in its own container (a fixed file, a planted commit) is not what
    # grading sees: grading starts a fresh container of the locked-down image.
    t, _ = mimic

    async def go() -> None:
        box = await docker_backend.start(t, ".", run_id=run_id())
        try:
            await _sh(box, f"echo '    {FIXED_LINE}' >> calc/ops.py && git commit -qam planted")
        finally:
            await box.close()

    run(go())
    assert _grade(docker_backend, t, "").reward == 0.0


# ---- an image that is not here and cannot be pulled ---------------------------------------


def _absent_task(tmp_path: Path) -> Path:
    t = replace(
        task(),
        instance_id="legorl-absent__none-1",
        source=None,
        env=None,
        image="sweb.eval.x86_64.legorl-absent__none-1:latest",
    )
    from legorl.records import write_jsonl

    path = tmp_path / "tasks.jsonl"
    write_jsonl(path, [t])
    return path


def _legorl(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "legorl.cli.main", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.usefixtures("docker_backend")
def test_a_missing_image_that_cannot_be_pulled_says_what_to_build_or_pull(
    tmp_path: Path,
) -> None:
    tasks = _absent_task(tmp_path)
    image = "sweb.eval.x86_64.legorl-absent__none-1:latest"
    for args, code in [
        (["sandbox", "build", "--tasks", str(tasks)], 1),
        (
            ["rollout", "--tasks", str(tasks), "--harness", "mini", "--engine", "forced"]
            + ["--model", str(MODEL), "--sandbox", "docker", "--out", "t.jsonl"],
            2,
        ),
    ]:
        done = _legorl(*args, cwd=tmp_path)
        lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
        assert done.returncode == code, done.stderr[-2000:]
        assert len(lines) == 1, done.stderr
        line = lines[0]
        assert f"image {image} is not present and cannot be pulled" in line
        assert f"docker pull {image}" in line and "docker load" in line
        assert "prepare_images" in line and "--instance_ids legorl-absent__none-1" in line
    assert not (tmp_path / "t.jsonl").exists() or (tmp_path / "t.jsonl").read_text() == ""


@pytest.mark.usefixtures("docker_backend")
def test_check_names_the_missing_image_and_how_to_get_it(tmp_path: Path) -> None:
    from legorl.check import check_docker

    row = check_docker(images=[], tasks=str(_absent_task(tmp_path)))
    assert row.status == "fail"
    assert "sweb.eval.x86_64.legorl-absent__none-1:latest" in row.reason
    assert "docker pull sweb.eval.x86_64.legorl-absent__none-1:latest" in row.fix
    assert "--instance_ids legorl-absent__none-1" in row.fix


_READS_HISTORY = '''

def mean(values):
    """The arithmetic mean of a non-empty list."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", "-C", "/testbed", *args], capture_output=True, text=True).stdout

    for commit in git("rev-list", "--all").split():
        code = git("show", commit + ":calc/ops.py")
        if "sum(values) / len" in code:
            found = {}
            exec(code, found)
            return found["mean"](values)
    return sum(values) // len(values)
'''


def _patch_reading_history(tmp: Path) -> str:
    """A patch with no fix in it: at test time its code looks for the fix in the history."""
    from fixtures.mimic_image import _OPS_BUGGY

    repo = tmp / "r"
    (repo / "calc").mkdir(parents=True)
    (repo / "calc" / "ops.py").write_text(_OPS_BUGGY)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    head = _OPS_BUGGY.split("\n\ndef mean")[0] + "\n"
    (repo / "calc" / "ops.py").write_text(head + _READS_HISTORY)
    return subprocess.run(
        ["git", "diff"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout


def test_code_under_test_cannot_read_the_fix_out_of_the_history_when_graded(
    docker_backend: Any, unlocked: Any, mimic: tuple[Any, dict[str, Any]], tmp_path: Path
) -> None:
    # The independent re-run of FAIL_TO_PASS ("differential") also stops this patch (it
    # disagrees); it is off here, so the lockdown alone decides.
    t, _ = mimic
    patch = _patch_reading_history(tmp_path)
    assert FIXED_LINE not in patch
    off = frozenset({"differential"})
    assert _grade(docker_backend, t, patch, off).reward == 0.0
    # Control: graded on the image's own history, the same patch finds the fix and passes.
    # There the image's install step left setup.cfg changed from its HEAD, which grading puts
    # back; that alone gives 0 (put_back_fails), so the control switches it off.
    assert _grade(unlocked, t, patch, off | {"put_back_fails"}).reward == 1.0


# ---- the env's activation, as the probe finds it (no Docker) --------------------------------


def _probe(tmp: Path, *, conda: bool, script: str) -> subprocess.CompletedProcess[str]:
    env = tmp / "envs" / "testbed"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").symlink_to(sys.executable)
    hook = env / "etc" / "conda" / "activate.d"
    if conda:
        (env / "conda-meta").mkdir()
        hook.mkdir(parents=True)
        (hook / "a.sh").write_text(script)
        (hook / "b.sh").write_text('export SEEN_A="${FROM_A:-unset}"\n')
    return subprocess.run(
        ["sh", "-c", probe_script((str(tmp / "absent"), str(env)))],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp)},
    )


def test_the_probe_activates_a_conda_env_as_conda_does(tmp_path: Path) -> None:
    done = _probe(tmp_path, conda=True, script='export FROM_A="$CONDA_PREFIX/share"\n')
    env = str(tmp_path / "envs" / "testbed")
    assert f"env={env}" in done.stdout.splitlines(), done.stdout + done.stderr
    assert activation(done.stdout) == {
        "CONDA_PREFIX": env,
        "CONDA_DEFAULT_ENV": "testbed",
        "CONDA_SHLVL": "1",
        "CONDA_PROMPT_MODIFIER": "(testbed) ",
        "FROM_A": f"{env}/share",
        "SEEN_A": f"{env}/share",  # the scripts run in order, in one shell
        "PATH": f"{env}/bin:/usr/bin:/bin",
    }


def test_a_failing_activation_script_does_not_stop_the_others(tmp_path: Path) -> None:
    done = _probe(tmp_path, conda=True, script="false\nexport FROM_A=1\nundefined_command\n")
    assert activation(done.stdout)["SEEN_A"] == "1", done.stdout + done.stderr


def test_a_plain_venv_is_not_activated(tmp_path: Path) -> None:
    done = _probe(tmp_path, conda=False, script="")
    assert done.returncode == 0 and activation(done.stdout) == {}
    with pytest.raises(ValueError, match="not an object"):
        activation('activated=["PATH"]')
