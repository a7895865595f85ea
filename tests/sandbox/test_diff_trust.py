"""The rollout's patch is what the tree really changed, whatever the agent did to git: on both
backends an agent stage plants a hostile ``.git/config`` and ``~/.gitconfig`` (external diff,
textconv, a clean filter, diff prefixes, hooks, fsmonitor, ``core.attributesFile``), a
``.gitattributes`` with filters and ``-diff``, and noise on stderr; ``diff()`` must still give
well-formed text that applies to the base commit, reproduces the tree's bytes, and grades
(the fix is in it) with reward 1 in a fresh grading sandbox. The control
runs the old in-sandbox diff on the same tree, which the agent fools.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from conftest import grade_patch
from sandbox_fixtures import (  # noqa: F401  (fixtures are found by name)
    TASKS_DIR,
    fixture_backend,
    fixture_docker_backend,
    fixture_local_backend,
    run,
    run_id,
    task,
)

from legorl.tasks import checkout
from legorl.verify.patches import parse_strict

EVIL = "#!/bin/sh\necho NOISE-ON-STDERR >&2\ncat\necho '# forged by the agent'\n"
HOSTILE = """\
[diff]
\texternal = /testbed/evil.sh
\tnoprefix = true
\tmnemonicPrefix = true
[diff "evil"]
\ttextconv = /testbed/evil.sh
[filter "evil"]
\tclean = /testbed/evil.sh
\tsmudge = cat
\trequired = true
[core]
\tattributesFile = /testbed/.evil-attributes
\thooksPath = /testbed/.evil-hooks
\tfsmonitor = /testbed/evil.sh
"""

#: The diff every rollout took before: git run inside the sandbox on the agent's own .git.
OLD_DIFF = (
    'cd /testbed && idx=$(mktemp) && { cp .git/index "$idx" 2>/dev/null || rm -f "$idx"; } && '
    'GIT_INDEX_FILE="$idx" git -c core.hooksPath=/dev/null -c diff.noprefix=false add -A -- . && '
    'GIT_INDEX_FILE="$idx" git -c core.hooksPath=/dev/null -c diff.noprefix=false diff --cached '
    '--binary --no-color --no-ext-diff --src-prefix=a/ --dst-prefix=b/ {base}; rm -f "$idx"'
)


async def _hostile_agent(box: Any) -> None:
    await box.exec("sed -i 's/return width + height/return width * height/' geometry.py")
    await box.write_file("notes.txt", b"plain notes\n")
    await box.write_file("evil.sh", EVIL.encode())
    await box.write_file(".gitattributes", b"*.py filter=evil diff=evil\n*.txt -diff\n")
    await box.write_file(".evil-attributes", b"* filter=evil diff=evil\n")
    await box.write_file(".evil-hooks/post-index-change", EVIL.encode())
    await box.write_file("/root/.gitconfig", HOSTILE.encode())
    setup = "chmod +x evil.sh .evil-hooks/* && cat /root/.gitconfig >> .git/config"
    assert (await box.exec(setup)).exit_code == 0


def _reproduces(patch: str, files: dict[str, bytes]) -> bool:
    """Whether ``patch`` is well-formed text that, applied by a plain `git apply` on the base
    tree, gives exactly ``files``' bytes."""
    from legorl.verify.patches import PatchError

    try:
        parse_strict(patch)
    except PatchError:
        return False
    with tempfile.TemporaryDirectory(prefix="legorl-diff-trust-") as tmp:
        checkout(task(), TASKS_DIR, Path(tmp) / "r")
        env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null"}
        proc = subprocess.run(
            ["git", "apply", "--whitespace=nowarn", "-"],
            input=patch.encode(),
            cwd=Path(tmp) / "r",
            env=env,
            capture_output=True,
            timeout=60,
        )
        if proc.returncode != 0:
            return False
        return all(
            (Path(tmp) / "r" / p).is_file() and (Path(tmp) / "r" / p).read_bytes() == data
            for p, data in files.items()
        )


def test_the_rollout_diff_ignores_what_the_agent_did_to_git(backend: Any) -> None:
    async def go() -> tuple[str, str, dict[str, bytes]]:
        box = await backend.start(task(), str(TASKS_DIR), run_id=run_id())
        try:
            await _hostile_agent(box)
            if backend.name == "docker":  # root in its container: it can replace git itself
                forged = "#!/bin/sh\necho 'diff --git a/x b/x'\n"
                await box.write_file("/usr/local/bin/git", forged.encode())
                await box.exec("chmod +x /usr/local/bin/git")
            patch = await box.diff()
            old = await box.exec(OLD_DIFF.replace("{base}", box.base_sha))
            files = {p: await box.read_file(p) for p in ("geometry.py", "notes.txt", "evil.sh")}
            return patch, old.output, files
        finally:
            await box.close()

    patch, old, files = run(go())
    sections = {d.path: d.text for d in parse_strict(patch)}  # nothing but diff sections
    assert {"geometry.py", "notes.txt", "evil.sh", ".gitattributes"} <= set(sections)
    for path, text in sections.items():
        if "evil" not in path:  # the agent's own scripts say it, nothing else may
            assert "NOISE" not in text and "forged" not in text, path
    assert _reproduces(patch, files)
    # The control: the old diff, run with the agent's git, takes in its noise and filter.
    assert not _reproduces(old, files)
    # The agent's .gitattributes is a change the grader must put back (its git reads no
    # attributes), so the whole patch gets 0; without that file, the rest applies as it is.
    graded = run(_grade(backend, patch))
    assert graded.reward == 0.0 and "git_attributes" in graded.hack_flags, graded.verdict
    rest = "".join(d.text for d in parse_strict(patch) if d.path != ".gitattributes")
    graded = run(_grade(backend, rest))
    assert graded.reward == 1.0 and graded.verdict["patch_apply"] == "git_apply", graded.verdict


async def _grade(backend: Any, patch: str) -> Any:
    return await grade_patch(
        task(),
        patch,
        backend=backend,
        tasks_dir=TASKS_DIR,
        run_id=run_id(),
        trajectory_id="diff-trust",
    )


def test_the_probe_sees_what_git_attributes_and_nested_repos_would_hide(tmp_path: Path) -> None:
    from legorl.sandbox import tree_probe

    repo = tmp_path / "repo"
    repo.mkdir()
    git = {"git_dir": str(repo / ".git"), "work_tree": str(repo)}

    def sh(*args: str, data: bytes | None = None) -> str:
        ident = ["-c", "user.name=t", "-c", "user.email=t@t"]
        argv = tree_probe.clean_git(*args, **git)
        at = argv.index("git") + 1
        argv[at:at] = ident
        proc = subprocess.run(argv, cwd=repo, input=data, capture_output=True, check=True)
        return proc.stdout.decode()

    sh("init", "-q")
    (repo / "a.py").write_bytes(b"x = 1\n")
    (repo / "run.sh").write_bytes(b"echo\n")
    sh("add", "-A")
    sh("commit", "-q", "-m", "base")
    base = sh("rev-parse", "HEAD").strip()
    # CRLF under a `text` attribute: git normalises it away; a nested repo: git skips inside.
    (repo / ".gitattributes").write_bytes(b"*.py text\n")
    (repo / "a.py").write_bytes(b"x = 1\r\n")
    env = {"PATH": os.environ["PATH"], "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(tmp_path)}
    subprocess.run(["git", "init", "-q", str(repo / "sub")], env=env, check=True)
    nested = ["git", "-C", str(repo / "sub"), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*nested, "commit", "-q", "--allow-empty", "-m", "x"], env=env, check=True)
    (repo / "sub" / "conftest.py").write_bytes(b"raise SystemExit(0)\n")
    (repo / "run.sh").chmod(0o755)
    (repo / "link").symlink_to("/etc/passwd")
    rows, odd = tree_probe.changes(str(repo), git, base)
    got = {r["path"]: (r["before"] and r["before"][0], r["after"] and r["after"][0]) for r in rows}
    assert "sub/.git/HEAD" in got  # the nested repository's own files are seen too
    got = {p: m for p, m in got.items() if not p.startswith("sub/.git/")}
    assert got == {
        ".gitattributes": (None, "100644"),
        "a.py": ("100644", "100644"),
        "link": (None, "120000"),
        "run.sh": ("100644", "100755"),
        "sub/conftest.py": (None, "100644"),
    }
    assert odd == []
    # The control: git's own account of the same tree misses both.
    sh("add", "-A")
    seen = sh("diff", "--cached", "--name-only", base).split()
    assert "a.py" not in seen and "sub/conftest.py" not in seen


def test_the_probe_stores_a_tree_of_many_files_with_a_few_git_processes(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Round 8: a fix plus 70,000 empty files held a grading 16 minutes, one git process per
    stored blob (round 19: 66,000 symlinks, four minutes). Every blob goes through one process;
    the tree is the same, symlinks, executable bits and a path with a newline included."""
    from legorl.sandbox import tree_probe

    repo = tmp_path / "repo"
    repo.mkdir()
    git = {"git_dir": str(repo / ".git"), "work_tree": str(repo), "index": str(tmp_path / "i")}
    ident = ["-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "a.py").write_bytes(b"x = 1\n")
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(repo), *ident, "commit", "-qm", "b"], check=True)
    base = subprocess.check_output(["git", "-C", str(repo), "rev-parse", "HEAD"]).decode().strip()
    (repo / "data").mkdir()
    for i in range(2000):
        (repo / "data" / f"f{i}").write_bytes(b"%d\n" % (i % 7))
    (repo / "a.py").write_bytes(b"x = 2\n")
    (repo / "run.sh").write_bytes(b"echo\n")
    (repo / "run.sh").chmod(0o755)
    (repo / "link").symlink_to("a.py")
    (repo / "links").mkdir()
    for i in range(300):  # round 19: 66,000 symlinks took a git process each
        (repo / "links" / f"l{i}").symlink_to(f"target-{i}")
    (repo / "new\nline").write_bytes(b"odd\n")
    calls = []
    real_run = tree_probe._run
    monkeypatch.setattr(
        tree_probe, "_run", lambda argv, data=None: calls.append(1) or real_run(argv, data)
    )
    rows, _ = tree_probe.changes(str(repo), git, base)
    tree = tree_probe.write_tree(str(repo), git, base, rows)
    assert len(calls) <= 6  # ls-tree, read-tree, one batch of every blob, update-index, ...
    listing = subprocess.check_output(
        tree_probe.clean_git("ls-tree", "-r", "-z", tree, **git)
    ).split(b"\0")
    got = {}
    for item in filter(None, listing):
        meta, _, path = item.partition(b"\t")
        mode, _, sha = meta.decode().split()
        got[path.decode()] = (mode, sha)
    assert len(got) == 2000 + 4 + 300
    assert got["links/l7"] == ("120000", tree_probe.blob_sha(b"target-7"))
    assert got["data/f9"] == ("100644", tree_probe.blob_sha(b"2\n"))
    assert got["run.sh"][0] == "100755" and got["link"] == ("120000", tree_probe.blob_sha(b"a.py"))
    assert got["new\nline"] == ("100644", tree_probe.blob_sha(b"odd\n"))
    assert got["a.py"] == ("100644", tree_probe.blob_sha(b"x = 2\n"))


def _probe_diff(tmp: Path, repo: Path, base: str, tag: str, **opts: bool) -> dict[str, Any]:
    """The rollout's diff probe over ``repo`` against ``base`` (its result, read back)."""
    import json

    from legorl.sandbox import tree_probe

    out = tmp / f"out-{tag}"
    req = {
        "mode": "diff", "root": str(repo), "git_dir": str(repo / ".git"), "base": base,
        "index": str(tmp / f"index-{tag}"), "out": str(out), "respect_ignores": True, **opts,
    }  # fmt: skip
    assert tree_probe.main(json.dumps(req)) == 0
    return dict(json.loads(out.read_text()))


def test_the_rollouts_diff_hands_on_its_patch_and_no_listing(tmp_path: Path) -> None:
    """Round 9: ignored files below long folder names left the patch at 137 bytes but the
    probe's result listed every one of them, and the local backend read it whole (803 MB for
    100,000 files). The rollout's diff asks for no listing; grading's probe still gets one."""

    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "a.py").write_bytes(b"x = 1\n")
    ident = ["-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(repo), *ident, "commit", "-qm", "b"], check=True)
    base = subprocess.check_output(["git", "-C", str(repo), "rev-parse", "HEAD"]).decode().strip()
    (repo / ".gitignore").write_text("*.ign\n")
    deep = repo / ("d" * 200) / ("e" * 200)
    deep.mkdir(parents=True)
    for i in range(300):
        (deep / f"f{i}.ign").write_bytes(b"")
    (repo / "a.py").write_bytes(b"x = 2\n")

    def probe(listing: bool) -> dict[str, Any]:
        got = _probe_diff(tmp_path, repo, base, str(listing), skip_junk=True, listing=listing)
        assert (tmp_path / f"out-{listing}").stat().st_size < (1 << 10 if not listing else 1 << 20)
        return got

    rollout, grading = probe(False), probe(True)
    assert "changes" not in rollout and "odd" not in rollout and "paths" not in rollout
    patch = Path(rollout["patch_file"]).read_text()
    assert "a.py" in patch and "f0.ign" not in patch and ".gitignore" in patch
    assert len(grading["changes"]) == 302 and grading["paths"] == [".gitignore", "a.py"]


def test_the_rollouts_diff_leaves_junk_the_base_tracks_alone(tmp_path: Path) -> None:
    # A repository that commits bytecode: the rollout's diff skips bytecode and caches, and
    # before round 74's report showed every tracked one deleted in every rollout's patch.

    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "pkg" / "__pycache__").mkdir(parents=True)
    (repo / "pkg" / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"\x00tracked")
    (repo / "old.pyc").write_bytes(b"\x00tracked")
    (repo / "a.py").write_bytes(b"x = 1\n")
    ident = ["-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(repo), *ident, "commit", "-qm", "b"], check=True)
    base = subprocess.check_output(["git", "-C", str(repo), "rev-parse", "HEAD"]).decode().strip()
    (repo / "a.py").write_bytes(b"x = 2\n")
    (repo / "new.pyc").write_bytes(b"\x00new")

    def patch(skip_junk: bool) -> str:
        got = _probe_diff(tmp_path, repo, base, str(skip_junk), skip_junk=skip_junk, listing=False)
        return Path(got["patch_file"]).read_text()

    rollout = patch(True)
    assert "a.py" in rollout and ".pyc" not in rollout and "deleted" not in rollout
    # The control: without skipping, the bytecode the agent's tree made is in the patch.
    assert "new.pyc" in patch(False)
