"""Load task sets as they are published; materialise a task's repository and patch it.

``load_tasks`` reads SWE-bench, SWE-Gym, SWE-smith and R2E-Gym rows (JSONL, JSON, Parquet or a
``datasets`` folder) and native records, behind every ``--tasks`` option:

    legorl rollout --tasks swe-bench-verified.parquet --task-format swebench …

A task (``legorl.records.Task``) names its repository as a git bundle (``source``, relative to
the task file's folder) and the commit to start from (``base_commit``):

    from legorl.tasks import apply_patch, checkout
    repo = checkout(task, Path("fixtures/tasks"), Path("/tmp/work") / task.instance_id)
    apply_patch(repo, task.test_patch)

Both functions shell out to ``git`` and raise ``TaskError`` (or its ``PatchError``) with git's
own message.
"""

from __future__ import annotations

import datetime as _dt
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "FORMATS",
    "PatchError",
    "TaskError",
    "TaskFormat",
    "TaskLike",
    "apply_patch",
    "checkout",
    "detect_format",
    "load_tasks",
]


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


# --------------------------------------------------------------------------------------------
# Loading task sets as they are published
# --------------------------------------------------------------------------------------------


def _json_text(row: dict[str, Any], key: str, where: str) -> Any:
    """A column Hugging Face stores as JSON text (``FAIL_TO_PASS``…), decoded; others as is."""
    value = row.get(key)
    if not isinstance(value, str):
        return value
    import orjson

    try:
        return orjson.loads(value)
    except orjson.JSONDecodeError:
        raise TaskError(f"{where}: {key}: not valid JSON text") from None


def _image_name(prefix: str, instance_id: str, sep: str) -> str:
    """The Docker Hub name of a SWE-bench-style instance image (``__`` is not legal there)."""
    return f"{prefix}sweb.eval.x86_64.{instance_id.replace('__', sep).lower()}:latest"


def _swebench(row: dict[str, Any], where: str) -> dict[str, Any]:
    out = {k: row[k] for k in _TASK_FIELDS if k in row}
    for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        out[key] = _json_text(row, key, where)
    image = row.get("image") or row.get("image_name")
    out["image"] = image or _image_name("swebench/", row["instance_id"], "_1776_")
    return out


def _swegym(row: dict[str, Any], where: str) -> dict[str, Any]:
    out = _swebench(row, where)
    if not (row.get("image") or row.get("image_name")):
        out["image"] = _image_name("xingyaoww/", row["instance_id"], "_s_")
    out.setdefault("version", "")
    out.setdefault("environment_setup_commit", row["base_commit"])
    return out


def _swesmith(row: dict[str, Any], where: str) -> dict[str, Any]:
    # The bug is already in the repository at base_commit: the set has no test patch.
    out = {k: row[k] for k in _TASK_FIELDS if k in row}
    for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        out[key] = _json_text(row, key, where)
    out["image"] = row["image_name"]
    out.setdefault("test_patch", "")
    out.setdefault("version", "")
    out.setdefault("environment_setup_commit", row["base_commit"])
    return out


def _r2egym(row: dict[str, Any], where: str) -> dict[str, Any]:
    # R2E-Gym publishes only the statuses with the fix applied; every test expected to pass
    # must pass. Its image holds the repository and the tests.
    expected = _json_text(row, "expected_output_json", where)
    if not isinstance(expected, dict):
        raise TaskError(f"{where}: expected_output_json: not an object of test: status")
    commit = str(row["commit_hash"])
    out = {k: row[k] for k in _TASK_FIELDS if k in row}
    out |= {
        "instance_id": row.get("instance_id") or f"{row['repo_name']}__{commit}",
        "repo": row["repo_name"],
        "base_commit": commit,
        "test_patch": "",
        "FAIL_TO_PASS": sorted(n for n, s in expected.items() if str(s).upper() == "PASSED"),
        "PASS_TO_PASS": [],
        "version": "",
        "environment_setup_commit": commit,
        "image": row["docker_image"],
    }
    return out


@dataclass(frozen=True, slots=True)
class TaskFormat:
    """How one published task set's rows become ``Task`` fields."""

    name: str
    needs: tuple[str, ...]  # columns every row must have
    reads: frozenset[str]  # columns it maps; any other column is kept in Task.meta
    convert: Callable[[dict[str, Any], str], dict[str, Any]]


_TASK_FIELDS = [
    "instance_id",
    "repo",
    "base_commit",
    "problem_statement",
    "test_patch",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
    "version",
    "environment_setup_commit",
    "patch",
    "hints_text",
    "created_at",
    "image",
    "env",
    "test_cmd",
    "log_parser",
    "source",
    "split",
]
# SWE-bench's own columns: the first nine Task fields (instance_id … environment_setup_commit).
_SWEBENCH_NEEDS = _TASK_FIELDS[:9]
_COMMON = frozenset(_TASK_FIELDS) | {"image_name"}

FORMATS: dict[str, TaskFormat] = {
    f.name: f
    for f in (
        TaskFormat("swebench", tuple(_SWEBENCH_NEEDS), _COMMON, _swebench),
        TaskFormat("swegym", tuple(_SWEBENCH_NEEDS[:7]), _COMMON, _swegym),
        TaskFormat(
            "swesmith",
            ("instance_id", "repo", "base_commit", "problem_statement", "FAIL_TO_PASS")
            + ("PASS_TO_PASS", "image_name"),
            _COMMON,
            _swesmith,
        ),
        TaskFormat(
            "r2egym",
            ("repo_name", "commit_hash", "docker_image", "problem_statement")
            + ("expected_output_json",),
            _COMMON | {"repo_name", "commit_hash", "docker_image", "expected_output_json"},
            _r2egym,
        ),
    )
}


def detect_format(columns: Iterable[str]) -> str:
    """The set a row's columns look like: ``legorl`` for native records, else a FORMATS key.

    SWE-Gym rows have SWE-bench's columns; only ``--task-format swegym`` tells them apart.
    """
    cols = set(columns)
    if "schema" in cols:
        return "legorl"
    if {"docker_image", "commit_hash", "repo_name"} <= cols:
        return "r2egym"
    if "image_name" in cols and "test_patch" not in cols:
        return "swesmith"
    return "swebench"


def _plain(value: Any) -> Any:
    """Parquet timestamps as ISO text, so every field and meta value is JSON (JSON rows have
    none, so only the columnar readers pay for this walk)."""
    if isinstance(value, _dt.date):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _read_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, row) for every row of a task file or a ``datasets`` folder."""
    import orjson

    if path.is_dir():
        yield from _read_dataset_dir(path)
        return
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        for lineno, raw in enumerate(path.read_bytes().splitlines(), 1):
            if raw.strip():
                try:
                    yield f"{path}:{lineno}", orjson.loads(raw)
                except orjson.JSONDecodeError as exc:
                    raise TaskError(f"{path}:{lineno}: malformed JSON: {exc}") from None
    elif suffix == ".json":
        try:
            data = orjson.loads(path.read_bytes())
        except orjson.JSONDecodeError as exc:
            raise TaskError(f"{path}: malformed JSON: {exc}") from None
        if isinstance(data, dict) and isinstance(data.get("rows"), list):
            # the Hugging Face dataset viewer's /rows answer: {"rows": [{"row_idx", "row"}]}
            data = [r["row"] if isinstance(r, dict) and "row" in r else r for r in data["rows"]]
        elif isinstance(data, dict):
            data = data.get("instances", [data])
        if not isinstance(data, list):
            raise TaskError(f"{path}: expected a list of task objects")
        for i, row in enumerate(data):
            yield f"{path}[{i}]", row
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise TaskError(
                f"{path}: reading Parquet needs pyarrow (pip install pyarrow)"
            ) from None
        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path}[{i}]", _plain(row)
    else:
        raise TaskError(
            f"{path}: unknown task file type {suffix!r} "
            "(use .jsonl, .json, .parquet or a datasets save_to_disk folder)"
        )


def _read_dataset_dir(path: Path) -> Iterator[tuple[str, Any]]:
    if not ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
        raise TaskError(f"{path}: a folder, but not one written by datasets' save_to_disk")
    try:
        import datasets
    except ImportError:
        raise TaskError(
            f"{path}: a datasets save_to_disk folder; loading it needs the datasets package "
            "(pip install datasets)"
        ) from None
    loaded = datasets.load_from_disk(str(path))
    splits = loaded.items() if isinstance(loaded, datasets.DatasetDict) else [("", loaded)]
    for split, table in splits:
        name = f"{path}/{split}" if split else str(path)
        for i, row in enumerate(table):
            yield f"{name}[{i}]", _plain(row)


def load_tasks(
    path: str | Path,
    *,
    task_format: str | None = None,
    notice: Callable[[str], None] | None = None,
) -> list[Any]:
    """Task records from a task set as it is published, in file order.

    ``path`` is a JSONL, JSON (a list, ``{"instances": …}`` or the dataset viewer's
    ``{"rows": …}``) or Parquet file, or a folder written by ``datasets``' ``save_to_disk``.
    Rows are native ``legorl/task@1`` records (strict) or rows of a set in ``FORMATS``,
    detected from the columns unless ``task_format`` names one. Columns a set does not map
    are kept in ``Task.meta`` and named once through ``notice`` (default: stderr). A bad row
    is a ``TaskError`` naming the file, the row (line, or ``[index]``) and the field.
    """
    from legorl.records import FieldError, Task, from_dict

    if task_format is not None and task_format not in FORMATS and task_format != "legorl":
        known = ", ".join(["legorl", *FORMATS])
        raise TaskError(f"--task-format {task_format!r}: unknown (known: {known})")
    path = Path(path)
    if not path.exists():
        raise TaskError(f"{path}: no such task file")
    tasks = []
    kept: dict[str, None] = {}  # extra columns, in first-seen order
    fmt_name = task_format
    for where, row in _read_rows(path):
        if not isinstance(row, dict):
            raise TaskError(f"{where}: expected a task object")
        fmt_name = fmt_name or detect_format(row)
        iid = row.get("instance_id", "?")
        try:
            if fmt_name == "legorl":
                tasks.append(from_dict({"schema": Task.SCHEMA, **row}, Task))
                continue
            fmt = FORMATS[fmt_name]
            missing = [k for k in fmt.needs if row.get(k) is None]
            if missing:
                raise TaskError(
                    f"{where}: instance {iid}: {missing[0]}: missing; a {fmt.name} row needs "
                    f"{', '.join(fmt.needs)}"
                )
            fields = fmt.convert(row, f"{where}: instance {iid}")
            extra = {k: v for k, v in row.items() if k not in fmt.reads and k != "meta"}
            kept.update(dict.fromkeys(extra))
            fields["meta"] = {**(row.get("meta") or {}), **extra, "task_format": fmt.name}
            fields["schema"] = Task.SCHEMA
            tasks.append(from_dict(fields, Task))
        except FieldError as exc:
            raise TaskError(f"{where}: instance {iid}: {exc}") from None
    if kept:
        say = notice or (lambda line: print(line, file=sys.stderr))
        say(f"note: {path}: columns kept in Task.meta, not used: {', '.join(kept)}")
    return tasks
