"""The layered, content-hashed cache on both backends: reuse, targeted rebuilds, failed steps,
concurrent builders, prebuilt images, the harness runtime, listing and LRU removal."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sandbox_fixtures import (  # noqa: F401  (fixtures are found by name)
    TASKS_DIR,
    fixture_backend,
    fixture_docker_backend,
    fixture_local_backend,
    need,
    run,
    run_id,
    task,
    variant,
)

from legorl.protocols import SandboxError
from legorl.records import write_jsonl
from legorl.sandbox import stage
from legorl.sandbox.common import BuildError, ImageMissingError, set_last_used


def fresh(setup: list[str] | None = None, **changes: Any) -> Any:
    """A task whose env layer nobody has built yet (a nonce in its setup step)."""
    nonce = secrets.token_hex(6)
    steps = setup if setup is not None else [f"echo {nonce} > /opt/legorl-env/nonce"]
    base = task()
    return variant(
        base,
        env={"python": "3.11", "packages": [], "setup": steps},
        source=str(TASKS_DIR / base.source),
        **changes,
    )


def _drop(backend: Any, reports: list[Any]) -> None:
    for report in reversed(reports):
        if report.action in ("built", "waited") and report.kind in ("env", "instance"):
            stage.remove_layer(backend, report.kind, report.tag)


def test_a_built_instance_is_reused_and_a_changed_recipe_rebuilds_only_above(backend: Any) -> None:
    again = backend.cache.ensure(task(), TASKS_DIR)
    assert [r.action for r in again] == ["cached"] * 3  # nothing rebuilt

    t = fresh()
    first = backend.cache.ensure(t, TASKS_DIR)
    try:
        assert [(r.kind, r.action) for r in first] == [
            ("base", "cached"),  # the base did not change
            ("env", "built"),
            ("instance", "built"),
        ]
        assert [r.action for r in backend.cache.ensure(t, TASKS_DIR)] == ["cached"] * 3
        # A new instance on the same env reuses base and env.
        sibling = variant(t, instance_id="legorl-toy__geometry-1-sibling")
        second = backend.cache.ensure(sibling, TASKS_DIR)
        assert [r.action for r in second] == ["cached", "cached", "built"]
        first.append(second[-1])

        async def probe() -> str:
            box = await backend.start(t, str(TASKS_DIR), run_id=run_id())
            try:
                return (
                    await box.exec("cat /opt/legorl-env/nonce; git log --oneline | wc -l")
                ).output
            finally:
                await box.close()

        assert run(probe()).split()[1] == "1"
    finally:
        _drop(backend, first)


def test_a_failing_build_step_names_the_step_and_its_log(backend: Any) -> None:
    t = fresh(setup=["echo preparing", "echo about to fail; echo boom >&2; exit 7"])
    with pytest.raises(BuildError) as info:
        backend.cache.ensure(t, TASKS_DIR)
    err = info.value
    message = str(err)
    assert "\n" not in message
    assert "env layer" in message and "step 3/3" in message and "exit 7" in message
    assert "boom" in message and err.log_path and Path(err.log_path).is_file()
    assert "about to fail" in err.log_tail and "boom" in err.log_tail
    # Nothing half-built is left under the layer's name.
    with pytest.raises(ImageMissingError):
        backend.cache.ensure(t, TASKS_DIR, build=False)


def test_no_build_refuses_a_missing_layer(backend: Any) -> None:
    t = fresh()
    with pytest.raises(ImageMissingError, match=r"not built and building is off \(--no-build\)"):
        backend.cache.ensure(t, TASKS_DIR, build=False)


def new_instance() -> Any:
    """A task whose instance layer nobody has built (its env is the usual one)."""
    base = task()
    return variant(
        base,
        instance_id=f"{base.instance_id}-{secrets.token_hex(4)}",
        source=str(TASKS_DIR / base.source),
    )


def test_concurrent_builders_of_one_layer_wait_for_one_build(backend: Any, tmp_path: Path) -> None:
    t = new_instance()
    tasks_file = tmp_path / "tasks.jsonl"
    write_jsonl(tasks_file, [t])
    cmd = [sys.executable, "-m", "legorl.cli.main", "sandbox", "build", "--tasks", str(tasks_file)]
    cmd += ["--backend", backend.name, "--json"]
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(3)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    reports = [[json.loads(line) for line in out.splitlines()] for out, _ in outs]
    try:
        for p, (_, err) in zip(procs, outs, strict=True):
            assert p.returncode == 0, err.decode()
        actions = sorted(next(r["action"] for r in rs if r["kind"] == "instance") for rs in reports)
        assert actions.count("built") == 1, actions
        assert set(actions) <= {"built", "waited", "cached"}
    finally:
        instance = backend.cache.ensure(t, TASKS_DIR, build=False)[-1]
        stage.remove_layer(backend, "instance", instance.tag)


def test_a_task_may_stand_on_a_prebuilt_image(docker_backend: Any) -> None:
    base = task()
    env_tag = docker_backend.cache.ensure(base, TASKS_DIR)[1].tag
    on_image = variant(base, image=env_tag, env=None, instance_id="legorl-toy__on-image")
    reports = docker_backend.cache.ensure(on_image, TASKS_DIR)
    try:
        assert [r.kind for r in reports] == ["image", "instance"]

        async def go() -> str:
            box = await docker_backend.start(on_image, str(TASKS_DIR), run_id=run_id())
            try:
                return (await box.exec("python -m pytest -q -p no:cacheprovider | tail -1")).output
            finally:
                await box.close()

        assert "passed" in run(go())
    finally:
        _drop(docker_backend, reports)
    missing = variant(base, image="registry.invalid/legorl/none:1", env=None)
    with pytest.raises(
        BuildError,
        match=r"image registry.invalid/legorl/none:1 is not present and cannot be pulled",
    ):
        docker_backend.cache.ensure(missing, TASKS_DIR)


def test_the_local_backend_refuses_docker_images(local_backend: Any) -> None:
    with pytest.raises(SandboxError, match="builds from env recipes only"):
        local_backend.cache.ensure(variant(task(), image="x/y:1"), TASKS_DIR)


def test_ls_shows_layers_with_sizes_and_use(backend: Any) -> None:
    rows = stage.listing(backend)
    kinds = {r["kind"] for r in rows}
    assert {"env", "instance"} <= kinds
    row = next(r for r in rows if r["kind"] == "instance" and r["name"] == task().instance_id)
    assert row["size"] > 0 and row["last_used"] >= row["created"] - 1


def test_budget_removes_least_recently_used_layers_first(backend: Any) -> None:
    t1, t2 = new_instance(), new_instance()
    built = backend.cache.ensure(t1, TASKS_DIR) + backend.cache.ensure(t2, TASKS_DIR)
    try:
        inst1, inst2 = (r.tag for r in built if r.kind == "instance")
        set_last_used(inst1, 1000.0)  # the oldest use of anything in the cache
        set_last_used(inst2, time.time())
        rows = stage.listing(backend)
        size = {r["tag"]: r["size"] for r in rows}
        total = sum(r["size"] for r in rows if r["kind"] != "runtime")
        out = stage.gc(backend, budget_gb=(total - size[inst1] + 1) / 1024**3)
        assert inst1 in out["images"] and inst2 not in out["images"], out
        left = {r["tag"] for r in stage.listing(backend)}
        assert inst1 not in left and inst2 in left
        assert {r.tag for r in built if r.kind == "env"} <= left  # still used by others
    finally:
        _drop(backend, built)


def test_the_harness_runtime_attaches_without_rebuilding_the_instance(backend: Any) -> None:
    from legorl.sandbox.runtime import RuntimeSources, missing_parts, runtime_layer

    missing = missing_parts(runtime_layer(RuntimeSources.find()).recipe)
    need(not missing, f"harness runtime parts on this host ({', '.join(missing)})")
    instance = backend.cache.ensure(task(), TASKS_DIR)[-1]

    async def go() -> str:
        box = await backend.start(task(), str(TASKS_DIR), run_id=run_id(), harness_runtime=True)
        try:
            assert box.runtime_dir == "/opt/legorl-runtime"
            assert box.openhands_python == "/opt/legorl-runtime/openhands/bin/python"
            assert box.runtime_env["PATH"].split(":")[0] == "/opt/legorl-env/bin"
            assert "/opt/legorl-runtime/bin" in box.runtime_env["PATH"].split(":")
            r = await box.exec(
                "node --version && claude --version && opencode --version && codex --version && "
                "/opt/legorl-runtime/openhands/bin/python -c "
                "'import importlib.util, sys; print(sys.version_info[:2], "
                'importlib.util.find_spec("openhands.sdk") is not None)\' && '
                "ls /opt/legorl-runtime/agent && "
                "(touch /opt/legorl-runtime/bin/x 2>/dev/null && echo writable || echo read-only)",
                timeout=300,
            )
            assert r.exit_code == 0, r.output
            if backend.name == "docker":
                info = backend.api.inspect_container(box.container_id)
                assert info["Config"]["Image"] == instance.tag  # the very same instance image
            return r.output
        finally:
            await box.close()

    out = run(go())
    assert out.startswith("v") and "Claude Code" in out and "(3, 12) True" in out
    assert "codex-cli 0.169" in out
    assert "mini_agent.py" in out and out.strip().endswith("read-only")
    again = backend.cache.ensure(task(), TASKS_DIR)[-1]
    assert again.action == "cached" and again.tag == instance.tag


def test_an_image_removed_behind_our_back_is_rebuilt_at_start(docker_backend: Any) -> None:
    t = new_instance()
    reports = docker_backend.cache.ensure(t, TASKS_DIR)  # known to this backend now
    docker_backend.api.remove_image(reports[-1].tag)  # as a gc elsewhere would

    async def go() -> str:
        box = await docker_backend.start(t, str(TASKS_DIR), run_id=run_id())
        try:
            return (await box.exec("git log --format=%s")).output
        finally:
            await box.close()

    try:
        assert run(go()) == "base\n"
    finally:
        stage.remove_layer(docker_backend, "instance", reports[-1].tag)
