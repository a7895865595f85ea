"""Materialise a task's repository as a git working tree and apply patches to it.

A task (``legorl.records.Task``) names its repository as a git bundle (``source``, relative to
the task file's folder) and the commit to start from (``base_commit``):

    from legorl.tasks import apply_patch, checkout
    repo = checkout(task, Path("fixtures/tasks"), Path("/tmp/work") / task.instance_id)
    apply_patch(repo, task.test_patch)

Both functions shell out to ``git`` and raise ``TaskError`` (or its ``PatchError``) with git's
own message.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Protocol

__all__ = ["PatchError", "TaskError", "TaskLike", "apply_patch", "checkout"]


class TaskLike(Protocol):
    """The fields of a task record that checkout() reads."""

    @property
    def instance_id(self) -> str: ...
    @property
    def base_commit(self) -> str: ...
    @property
    def source(self) -> str | None: ...


class TaskError(RuntimeError):
    """A task's repository could not be materialised."""


class PatchError(TaskError):
    """``git apply`` rejected a patch."""


def _git(args: list[str], cwd: Path | None = None, stdin: bytes | None = None) -> str | None:
    """Run git; returns None on success, else git's stderr (or stdout when stderr is empty)."""
    try:
        proc = subprocess.run(
            ["git", *args], cwd=cwd, input=stdin, capture_output=True, check=False, timeout=300
        )
    except FileNotFoundError:
        return "git is not installed or not on PATH"
    except subprocess.TimeoutExpired:
        return f"git {args[0]} timed out"
    if proc.returncode == 0:
        return None
    message = proc.stderr or proc.stdout
    return message.decode("utf-8", "replace").strip() or f"git exited with {proc.returncode}"


def checkout(task: TaskLike, tasks_dir: Path, dest: Path) -> Path:
    """Clone the task's bundle into ``dest`` with ``base_commit`` checked out as branch main.

    ``dest`` must not exist or be an empty folder. Returns ``dest``.
    """
    iid = task.instance_id
    if not task.source:
        raise TaskError(f"{iid}: the task names no source repository")
    bundle = Path(tasks_dir) / task.source
    if not bundle.is_file():
        raise TaskError(f"{iid}: repository bundle {bundle} does not exist")
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise TaskError(f"{iid}: checkout destination {dest} exists and is not an empty folder")

    error = _git(["clone", "--quiet", "--no-checkout", "--", str(bundle.resolve()), str(dest)])
    if error:
        raise TaskError(f"{iid}: git clone of {bundle} failed: {error}")
    error = _git(["checkout", "--quiet", "-B", "main", task.base_commit], cwd=dest)
    if error:
        raise TaskError(f"{iid}: cannot check out base_commit {task.base_commit}: {error}")
    return dest


def apply_patch(repo: Path, patch: str) -> None:
    """``git apply`` a unified diff in ``repo``; an empty patch is a no-op."""
    if not patch.strip():
        return
    if not patch.endswith("\n"):
        patch += "\n"  # git apply treats a missing final newline as a corrupt patch
    error = _git(["apply", "--whitespace=nowarn", "-"], cwd=Path(repo), stdin=patch.encode())
    if error:
        raise PatchError(f"git apply failed in {repo}: {error}")


def load_tasks(path: str | Path) -> list[Any]:
    """Task records from a JSONL, JSON or Parquet file of SWE-bench-format instances.

    Plain SWE-bench rows (no ``schema``, ``FAIL_TO_PASS`` as a JSON-encoded string) are
    accepted; any unknown or missing field is a ``TaskError`` naming the file, the instance
    and the field.
    """
    import orjson

    from legorl.records import FieldError, Task, from_dict

    path = Path(path)
    if not path.is_file():
        raise TaskError(f"{path}: no such task file")
    rows: list[tuple[str, Any]] = []  # (where, row)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        for lineno, raw in enumerate(path.read_bytes().splitlines(), 1):
            if raw.strip():
                try:
                    rows.append((f"{path}:{lineno}", orjson.loads(raw)))
                except orjson.JSONDecodeError as exc:
                    raise TaskError(f"{path}:{lineno}: malformed JSON: {exc}") from None
    elif suffix == ".json":
        try:
            data = orjson.loads(path.read_bytes())
        except orjson.JSONDecodeError as exc:
            raise TaskError(f"{path}: malformed JSON: {exc}") from None
        if isinstance(data, dict):
            data = data.get("instances", [data])
        if not isinstance(data, list):
            raise TaskError(f"{path}: expected a list of task objects")
        rows = [(f"{path} entry {i + 1}", row) for i, row in enumerate(data)]
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise TaskError(
                f"{path}: reading Parquet needs pyarrow (pip install pyarrow)"
            ) from None
        table = pq.read_table(path)
        rows = [(f"{path} row {i + 1}", row) for i, row in enumerate(table.to_pylist())]
    else:
        raise TaskError(f"{path}: unknown task file type {suffix!r} (use .jsonl, .json, .parquet)")
    tasks = []
    for where, row in rows:
        if not isinstance(row, dict):
            raise TaskError(f"{where}: expected a task object")
        iid = row.get("instance_id", "?")
        row = dict(row)
        row.setdefault("schema", Task.SCHEMA)
        for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
            if isinstance(row.get(key), str):  # Hugging Face SWE-bench stores these as JSON text
                try:
                    row[key] = orjson.loads(row[key])
                except orjson.JSONDecodeError:
                    raise TaskError(f"{where}: instance {iid}: {key}: not a JSON list") from None
        try:
            tasks.append(from_dict(row, Task))
        except FieldError as exc:
            raise TaskError(f"{where}: instance {iid}: {exc}") from None
    return tasks
