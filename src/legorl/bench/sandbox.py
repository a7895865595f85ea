"""Sandbox figures, side by side in one run (`python -m legorl.bench --only sandbox`).

For each backend that works here (Docker, bubblewrap):

- warm start → first command, p50 and p90 over repeated sandboxes of an already built task,
  without and with the proxy relay, beside the bare baseline (`docker run --rm --network none
  IMAGE true` through the CLI; `bwrap --ro-bind / / true`);
- re-requesting an already built instance from a fresh backend: layers rebuilt and seconds;
- cold build seconds per layer: base (Docker: debootstrap + import; skipped with ``quick``),
  env (a venv with pytest), instance (the one-commit repository), harness runtime (the tools'
  volume; skipped with ``quick``, and when the host lacks a part);
- 16 sandboxes started at once on this machine: failures, left behind, seconds;
- what a grading sandbox (``start(grading=True)``) costs: start → first command against an
  agent sandbox's, and start → first judged command (which chowns the repository and makes
  the judged user's private folders), medians of 5 taken in turns, as extra seconds and ratios.

Layers built for the measurement carry a bench-only nonce in their recipe and are removed after.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

TASK_ID = "legorl-toy__geometry-1"


def _tasks_dir() -> Path:
    here = Path(__file__).resolve()
    for base in (Path.cwd(), *here.parents):
        cand = base / "fixtures" / "tasks"
        if (cand / "train.jsonl").is_file():
            return cand
    raise FileNotFoundError("fixtures/tasks not found (run from the repository)")


def _task(tasks_dir: Path) -> Any:
    from legorl.records import Task, read_jsonl

    return next(t for t in read_jsonl(tasks_dir / "train.jsonl", Task) if t.instance_id == TASK_ID)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


async def _start_to_first(
    backend: Any, task: Any, tasks_dir: Path, n: int, proxy: str | None
) -> dict[str, Any]:
    times: list[float] = []
    closes: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter()
        box = await backend.start(task, str(tasks_dir), run_id="bench", proxy_url=proxy)
        result = await box.exec("true")
        times.append(time.perf_counter() - t0)
        assert result.exit_code == 0, result
        t1 = time.perf_counter()
        await box.close()
        closes.append(time.perf_counter() - t1)
    return {
        "p50_s": _pct(times, 0.5),
        "p90_s": _pct(times, 0.9),
        "close_p50_s": _pct(closes, 0.5),
        "n": n,
    }


async def _grading_cost(backend: Any, task: Any, tasks_dir: Path, n: int = 5) -> dict[str, Any]:
    """Agent start, grading start, grading start with a judged first command, in turns."""
    kinds = {"agent": (False, False), "grading": (True, False), "grading_judged": (True, True)}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(n):
        for kind, (grading, judged) in kinds.items():
            t0 = time.perf_counter()
            box = await backend.start(task, str(tasks_dir), run_id="bench", grading=grading)
            try:
                result = await box.exec("true", judged=judged)
                times[kind].append(time.perf_counter() - t0)
                assert result.exit_code == 0, result
            finally:
                await box.close()
    p50 = {k: _pct(v, 0.5) for k, v in times.items()}
    return {
        "n": n,
        "agent_start_to_first_command_p50_s": p50["agent"],
        "grading_start_to_first_command_p50_s": p50["grading"],
        "grading_start_to_first_judged_command_p50_s": p50["grading_judged"],
        "grading_extra_s": round(p50["grading"] - p50["agent"], 4),
        "grading_judged_extra_s": round(p50["grading_judged"] - p50["agent"], 4),
        "grading_vs_agent_start": round(p50["grading"] / p50["agent"], 3),
        "grading_judged_vs_agent_start": round(p50["grading_judged"] / p50["agent"], 3),
    }


def _baseline(argv: list[str], n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True, timeout=120)
        times.append(time.perf_counter() - t0)
    return _pct(times, 0.5)


async def _concurrent(backend: Any, task: Any, tasks_dir: Path, n: int = 16) -> dict[str, Any]:
    run_id = f"bench-{secrets.token_hex(4)}"

    async def one() -> None:
        box = await backend.start(task, str(tasks_dir), run_id=run_id)
        try:
            result = await box.exec("echo ok")
            if result.output != "ok\n":
                raise RuntimeError(result.output)
        finally:
            await box.close()

    t0 = time.perf_counter()
    results = await asyncio.gather(*[one() for _ in range(n)], return_exceptions=True)
    seconds = time.perf_counter() - t0
    left = _left_behind(backend, run_id)
    return {
        "n": n,
        "failures": sum(isinstance(r, BaseException) for r in results),
        "left_behind": left,
        "seconds": round(seconds, 2),
    }


def _left_behind(backend: Any, run_id: str) -> int:
    if backend.name == "docker":
        return len(backend.api.containers(all=True, filters={"label": f"legorl.run={run_id}"}))
    import json

    from legorl.sandbox.common import state_root

    n = 0
    for folder in state_root().iterdir():
        with contextlib.suppress(OSError, ValueError):
            n += json.loads((folder / "owner.json").read_text()).get("run") == run_id
    return n


def _fresh(task: Any, tasks_dir: Path, **env: Any) -> Any:
    from legorl.records import EnvRecipe

    recipe = EnvRecipe(
        python=task.env.python,
        packages=env.get("packages", list(task.env.packages)),
        setup=[f"echo bench-{secrets.token_hex(6)} > /opt/legorl-env/bench"],
    )
    return replace(task, env=recipe, source=str(tasks_dir / task.source))


def _cold_builds(backend: Any, task: Any, tasks_dir: Path, quick: bool) -> dict[str, Any]:
    from legorl.sandbox import stage

    out: dict[str, Any] = {}
    fresh = _fresh(task, tasks_dir)
    reports = backend.cache.ensure(fresh, tasks_dir)
    try:
        for r in reports:
            if r.action == "built":
                out[f"{r.kind}_s"] = round(r.seconds, 2)
    finally:
        for r in reversed(reports):
            if r.action == "built":
                stage.remove_layer(backend, r.kind, r.tag)
    if backend.name == "docker" and not quick:
        out["base_s"] = _cold_base(backend)
    if not quick:
        out.update(_cold_runtime(backend))
    return out


def _cold_base(backend: Any) -> float | str:
    from legorl.sandbox.common import cache_root
    from legorl.sandbox.layers import Layer, base_layer

    if shutil.which("debootstrap") is None:
        return "skipped: no debootstrap"
    usual = base_layer()
    layer = Layer("base", usual.name, {**usual.recipe, "bench": secrets.token_hex(6)})
    log = cache_root() / "logs" / f"bench-base-{layer.key}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    backend.cache.build_base(layer, log)
    seconds = round(time.perf_counter() - t0, 2)
    backend.api.remove_image(layer.tag)
    return seconds


def _cold_runtime(backend: Any) -> dict[str, Any]:
    from legorl.sandbox.layers import Layer
    from legorl.sandbox.runtime import RuntimeSources, missing_parts, split_layers

    src = RuntimeSources.find()
    tools, _ = split_layers(src)
    missing = missing_parts(tools.recipe)
    if missing:
        return {"runtime_s": f"skipped: missing {', '.join(missing)}"}
    if backend.name == "local":
        import tempfile

        from legorl.sandbox.runtime import local_layout, manifest

        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            local_layout(src, Path(tmp), manifest(src))
        return {"runtime_s": round(time.perf_counter() - t0, 3)}
    from legorl.sandbox.layers import plan

    base = plan(_task(_tasks_dir()))[0].tag
    layer = Layer("runtime", "bench", {**tools.recipe, "bench": secrets.token_hex(6)})
    t0 = time.perf_counter()
    volume, _ = backend.cache.tools_volume(src, layer, base, True)
    seconds = round(time.perf_counter() - t0, 2)
    backend.api.remove_volume(volume, force=True)
    return {"runtime_s": seconds}


def _rerequest(name: str, task: Any, tasks_dir: Path) -> dict[str, Any]:
    from legorl.sandbox import make_backend

    fresh = make_backend(name)  # no in-process memory of what exists
    t0 = time.perf_counter()
    reports = fresh.cache.ensure(task, tasks_dir)  # type: ignore[attr-defined]
    seconds = time.perf_counter() - t0
    return {
        "layers_rebuilt": sum(r.action != "cached" for r in reports),
        "seconds": round(seconds, 4),
    }


def _one_backend(name: str, quick: bool) -> dict[str, Any]:
    from legorl.sandbox import make_backend

    tasks_dir = _tasks_dir()
    task = _task(tasks_dir)
    backend: Any = make_backend(name)
    backend.cache.ensure(task, tasks_dir)  # built once, outside the figures
    n = 5 if quick else 20
    proxy = "http://127.0.0.1:9/s/bench"  # never connected to: only the relay is started

    async def starts() -> dict[str, Any]:
        await _start_to_first(backend, task, tasks_dir, 2, None)  # warm-up
        return {
            "start_to_first_command": await _start_to_first(backend, task, tasks_dir, n, None),
            "start_to_first_command_with_relay": await _start_to_first(
                backend, task, tasks_dir, n, proxy
            ),
            "concurrent_16": await _concurrent(backend, task, tasks_dir),
            "grading_start": await _grading_cost(backend, task, tasks_dir),
        }

    out: dict[str, Any] = asyncio.run(starts())
    if name == "docker":
        from legorl.sandbox.layers import plan

        image = plan(task)[-1].tag
        out["baseline_docker_run_true_p50_s"] = _baseline(
            ["docker", "run", "--rm", "--network", "none", image, "true"], n
        )
    else:
        out["baseline_bwrap_true_p50_s"] = _baseline(
            ["bwrap", "--unshare-all", "--ro-bind", "/", "/", "--dev", "/dev", "true"], n
        )
    out["rerequest_built_instance"] = _rerequest(name, task, tasks_dir)
    out["cold_build"] = _cold_builds(backend, task, tasks_dir, quick)
    return out


def bench_sandbox(quick: bool = False) -> dict[str, Any]:
    """The issue's sandbox figures for each backend that works here, with the targets."""
    from legorl.protocols import SandboxError

    report: dict[str, Any] = {
        "targets": {
            "docker_start_to_first_command_p50_s": "< 0.5",
            "rerequest_layers_rebuilt": 0,
            "rerequest_s": "< 1",
            "concurrent_16_failures": 0,
            "concurrent_16_left_behind": 0,
        }
    }
    for name in ("docker", "local"):
        try:
            report[name] = _one_backend(name, quick)
        except (SandboxError, FileNotFoundError, OSError) as err:
            report[name] = {"error": str(err)}
    docker = report.get("docker", {})
    if "start_to_first_command" in docker:
        report["docker_start_p50_vs_docker_run_true"] = round(
            docker["start_to_first_command"]["p50_s"] / docker["baseline_docker_run_true_p50_s"], 3
        )
    return report
