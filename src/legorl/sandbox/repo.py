"""The instance layer's repository: the task's tree at ``base_commit`` as a fresh one-commit repo.

    sha = scrubbed_repo(task, Path("fixtures/tasks"), Path("/tmp/x"))

The agent must not find the fix in history, so nothing of the original repository's git data
survives: the working tree is checked out from the bundle, its ``.git`` is dropped, and a new
repository commits that tree once, with a fixed author and date (the same tree always gives the
same commit). There are no other commits, tags, remotes, reflogs, packed refs, hooks or loose
objects beyond that commit's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from legorl.protocols import SandboxError
from legorl.tasks import TaskError, checkout

_IDENTITY = {
    "GIT_AUTHOR_NAME": "legorl",
    "GIT_AUTHOR_EMAIL": "legorl@localhost",
    "GIT_COMMITTER_NAME": "legorl",
    "GIT_COMMITTER_EMAIL": "legorl@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
}


def _git(args: list[str], cwd: Path, home: str) -> str:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": home,  # no user config (signing, hooks, templates) leaks in
        "GIT_CONFIG_NOSYSTEM": "1",
        **_IDENTITY,
    }
    proc = subprocess.run(
        ["git", "-c", "core.hooksPath=/dev/null", "-c", "commit.gpgsign=false", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        raise SandboxError(f"git {args[0]} failed in {cwd}: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout.strip()


def scrubbed_repo(task: Any, tasks_dir: Path, dest: Path) -> str:
    """Fill the empty folder ``dest``; returns the one commit's sha."""
    dest = Path(dest)
    with tempfile.TemporaryDirectory(prefix="legorl-repo-") as tmp:
        try:
            checkout(task, Path(tasks_dir), dest)
        except TaskError as err:
            raise SandboxError(str(err)) from None
        shutil.rmtree(dest / ".git")
        _git(["init", "-q", "--template=", "-b", "main", "."], dest, tmp)
        _git(["config", "user.name", "legorl"], dest, tmp)
        _git(["config", "user.email", "legorl@localhost"], dest, tmp)
        # -f: the tree is exactly the tracked files of base_commit, ignored patterns included.
        _git(["add", "-A", "-f", "."], dest, tmp)
        _git(["commit", "-q", "--no-verify", "-m", "base"], dest, tmp)
        sha = _git(["rev-parse", "HEAD"], dest, tmp)
    git_dir = dest / ".git"
    for leftover in ("logs", "hooks", "COMMIT_EDITMSG", "description", "ORIG_HEAD"):
        path = git_dir / leftover
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    return sha
