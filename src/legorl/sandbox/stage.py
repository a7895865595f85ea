"""The sandbox stage's functions behind ``legorl sandbox build | exec | ls | gc``.

    tasks = task_refs([Path("fixtures/tasks/train.jsonl")])
    for report in build(tasks.values(), backend, level="instance"):
        print(report)
    result = asyncio.run(run_command(backend, tasks["legorl-toy__geometry-1"], ["pytest", "-q"]))

Each takes a backend made by ``legorl.sandbox.make_backend`` and raises ``SandboxError`` (one
line) on failure; the command layer only parses flags and prints.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from legorl.protocols import ExecResult, Limits, SandboxError
from legorl.records import Task
from legorl.sandbox.common import cache_root, last_used
from legorl.sandbox.docker_backend import DockerBackend
from legorl.sandbox.docker_images import LayerReport
from legorl.sandbox.layers import LEVELS, keep_up_to
from legorl.sandbox.local_backend import LocalBackend, gc_local


@dataclass(slots=True)
class TaskRef:
    task: Task
    tasks_dir: Path  # the task file's folder: task.source is relative to it


def task_refs(paths: Iterable[Path], task_format: str | None = None) -> dict[str, TaskRef]:
    """Every task of the files (``legorl.tasks.load_tasks``), by id; a later file wins."""
    from legorl.tasks import TaskError, load_tasks

    out: dict[str, TaskRef] = {}
    for path in paths:
        if not Path(path).exists():
            raise SandboxError(f"--tasks {path}: no such file")
        try:
            for task in load_tasks(path, task_format=task_format):
                out[task.instance_id] = TaskRef(task, Path(path).resolve().parent)
        except TaskError as err:
            raise SandboxError(f"--tasks {err}") from None
    return out


def find_task(tasks: dict[str, TaskRef], instance_id: str, sources: list[Path]) -> TaskRef:
    if instance_id in tasks:
        return tasks[instance_id]
    where = ", ".join(str(p) for p in sources)
    close = sorted(i for i in tasks if instance_id.lower() in i.lower())[:3]
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise SandboxError(f"unknown task id {instance_id!r} ({len(tasks)} tasks in {where}){hint}")


def _ensure(backend: Any, ref: TaskRef, level: str, build: bool | None) -> list[LayerReport]:
    reports: list[LayerReport] = backend.cache.ensure(
        ref.task, ref.tasks_dir, level=level, build=build
    )
    return reports


def build(
    refs: Iterable[TaskRef],
    backend: DockerBackend | LocalBackend,
    *,
    level: str = "instance",
    runtime: bool = False,
    jobs: int = 2,
    build: bool = True,
) -> Iterator[LayerReport]:
    """Build (or find) every task's layers up to ``level``, ``jobs`` tasks at a time; layers
    shared by tasks are built once (the others wait for it). Yields each layer's report once,
    in completion order. ``level="none"`` builds nothing and yields the plan as "planned"."""
    if level not in LEVELS:
        raise SandboxError(f"unknown cache level {level!r} (one of {', '.join(LEVELS)})")
    refs = list(refs)
    if level == "none":
        planned: set[str] = set()
        for ref in refs:
            for layer in _plan(backend, ref):
                if layer.tag not in planned:
                    planned.add(layer.tag)
                    yield LayerReport(layer.kind, layer.tag, layer.name, "planned")
        return
    seen: set[str] = set()
    if refs:
        # The first task alone: its base and env layers are what most tasks share.
        for report in _ensure(backend, refs[0], level, build):
            seen.add(report.tag)
            yield report
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(_ensure, backend, ref, level, build) for ref in refs[1:]]
        try:
            for future in concurrent.futures.as_completed(futures):
                for report in future.result():
                    if report.tag not in seen:
                        seen.add(report.tag)
                        yield report
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    if runtime:
        yield from build_runtime(backend, refs[0] if refs else None, build=build)


def build_runtime(
    backend: DockerBackend | LocalBackend, ref: TaskRef | None, *, build: bool = True
) -> list[LayerReport]:
    if isinstance(backend, LocalBackend):
        _, _, report = backend.cache.runtime(build=build)
        return [report]
    if ref is None:
        raise SandboxError("--runtime needs a task (its base image hosts the copy)")
    base = backend.cache.ensure(ref.task, ref.tasks_dir, level="base", build=build)[0]
    return [r for _, _, r in backend.cache.runtime_volumes(base_tag=base.tag, build=build)]


async def run_command(
    backend: DockerBackend | LocalBackend,
    ref: TaskRef,
    cmd: list[str] | str,
    *,
    run_id: str,
    timeout: float = 600.0,
    limits: Limits | None = None,
    proxy_url: str | None = None,
    runtime: bool = False,
    env: dict[str, str] | None = None,
    on_output: Callable[[bytes], None] | None = None,
    keep_level: str = "instance",
) -> ExecResult:
    """Start a sandbox for the task, run one command, stop it. With ``keep_level`` below
    ``instance``, layers above that level that this call had to build are removed after."""
    before = {r.tag for r in _present(backend, ref)}
    box = await backend.start(
        ref.task,
        str(ref.tasks_dir),
        run_id=run_id,
        proxy_url=proxy_url,
        limits=limits,
        harness_runtime=runtime,
    )
    try:
        return await box.exec(cmd, timeout=timeout, env=env, on_output=on_output)
    finally:
        await box.close()
        if keep_level != "instance":
            plan = _plan(backend, ref)
            kept = {layer.tag for layer in keep_up_to(plan, keep_level)}
            for layer in reversed(plan):
                if layer.tag not in kept and layer.tag not in before:
                    remove_layer(backend, layer.kind, layer.tag)


def _plan(backend: Any, ref: TaskRef) -> list[Any]:
    if isinstance(backend, LocalBackend):
        return backend.cache.plan(ref.task)
    from legorl.sandbox.layers import plan

    return plan(ref.task)


def _present(backend: Any, ref: TaskRef) -> list[LayerReport]:
    """The task's layers that exist now (nothing is built)."""
    out = []
    for layer in _plan(backend, ref):
        if isinstance(backend, LocalBackend):
            present = (cache_root() / "local" / f"{layer.kind}-{layer.key}").is_dir()
            tag = layer.key if layer.kind == "base" else f"local/{layer.kind}:{layer.key}"
            present = present or layer.kind == "base"
        else:
            present = backend.cache.image(layer.tag) is not None
            tag = layer.tag
        if present:
            out.append(LayerReport(layer.kind, tag, layer.name, "cached"))
    return out


def remove_layer(backend: Any, kind: str, tag: str) -> None:
    if isinstance(backend, LocalBackend):
        key = tag.rpartition(":")[2]
        shutil.rmtree(cache_root() / "local" / f"{kind}-{key}", ignore_errors=True)
        return
    import docker.errors

    with contextlib.suppress(docker.errors.APIError):
        backend.api.remove_image(tag)
    backend.cache.forget(tag)


def listing(backend: DockerBackend | LocalBackend) -> list[dict[str, Any]]:
    """Layers of the cache: kind, tag, name, own size in bytes, created, last use."""
    if isinstance(backend, DockerBackend):
        return backend.cache.layers(volume_sizes=True)
    rows = []
    local = cache_root() / "local"
    for folder in sorted(local.glob("*-*")) if local.is_dir() else []:
        if ".partial-" in folder.name:
            continue
        kind, _, key = folder.name.partition("-")
        tag = f"local/{kind}:{key}"
        size = _du(folder)
        created = folder.stat().st_mtime
        name = ""
        meta = folder / "layer.json"
        if meta.is_file():
            import json

            name = json.loads(meta.read_text()).get("name", "")
        rows.append(
            {
                "kind": kind,
                "tag": tag,
                "name": name or ("harness-runtime" if kind == "runtime" else ""),
                "parent": "",
                "size": size,
                "total": size,
                "created": created,
                "last_used": last_used(tag) or created,
                "id": str(folder),
            }
        )
    return rows


def _du(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def gc(
    backend: DockerBackend | LocalBackend,
    *,
    everything: bool = False,
    budget_gb: float | None = None,
    dry_run: bool = False,
) -> dict[str, list[str]]:
    """Remove what dead runs left (containers, private folders, cgroups), stale images and,
    with a budget, least-recently-used layers. ``everything`` also removes live runs' sandboxes."""
    sandboxes = gc_local(everything=everything, dry_run=dry_run)
    if isinstance(backend, DockerBackend):
        from legorl.sandbox.docker_backend import gc as docker_gc

        out = docker_gc(backend.config, everything=everything, budget_gb=budget_gb, dry_run=dry_run)
        out["sandboxes"] = sandboxes
        return out
    removed: list[str] = []
    if budget_gb is not None:
        budget = int(budget_gb * 1024**3)
        rows = [r for r in listing(backend) if r["kind"] in ("instance", "env")]
        total = sum(r["size"] for r in rows)
        for row in sorted(rows, key=lambda r: r["last_used"]):  # least recently used first
            if total <= budget:
                break
            removed.append(row["tag"])
            total -= row["size"]
            if not dry_run:
                shutil.rmtree(row["id"], ignore_errors=True)
    return {"sandboxes": sandboxes, "images": removed, "containers": [], "volumes": []}


def human_size(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"


def human_age(ts: float | str | None) -> str:
    if not isinstance(ts, int | float) or not ts:
        return "-"
    age = time.time() - ts
    for unit, secs in (("d", 86400), ("h", 3600), ("m", 60)):
        if age >= secs:
            return f"{age / secs:.0f}{unit} ago"
    return "just now"
