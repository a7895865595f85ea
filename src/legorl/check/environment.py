"""Tasks, harnesses, the sandbox backend and the disk."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

from legorl.check.config import SANDBOXES
from legorl.check.results import CheckResult, _fail, _pass, _short, _skip
from legorl.protocols import ConfigError

# --------------------------------------------------------------------------------------------
# Tasks, harnesses, sandbox, disk
# --------------------------------------------------------------------------------------------


def check_tasks(tasks: str | None, task_format: str | None = None) -> CheckResult:
    from legorl.tasks import TaskError, load_tasks

    name = "tasks"
    if not tasks:
        return _skip(name, "no task file configured (--tasks)")
    fix = (
        "fix the line and field named; tasks are legorl/task@1 records or SWE-bench rows "
        "(instance_id, repo, base_commit, problem_statement, test_patch, FAIL_TO_PASS, …)"
    )
    try:
        loaded = load_tasks(tasks, task_format=task_format)
    except TaskError as exc:
        return _fail(name, str(exc), fix)
    if not loaded:
        return _fail(name, f"{tasks}: no tasks", "add at least one task")
    counts = Counter(t.instance_id for t in loaded)
    dupes = sorted(iid for iid, n in counts.items() if n > 1)
    if dupes:
        return _fail(name, f"duplicate instance_id(s): {', '.join(dupes[:5])}", "make ids unique")
    base = Path(tasks).parent
    missing = [t.instance_id for t in loaded if t.source and not (base / t.source).exists()]
    if missing:
        return _fail(
            name,
            f"{len(missing)} task(s) name a repository that does not exist, e.g. {missing[0]}",
            "put the bundles beside the task file (source is relative to its folder)",
        )
    no_source = sum(1 for t in loaded if not t.source and not t.image)
    repos = len({t.repo for t in loaded})
    note = f"; {no_source} without source or image" if no_source else ""
    return _pass(name, f"{len(loaded)} tasks from {repos} repositories, all valid{note}")


def _version(cmd: list[str], timeout: float = 60) -> tuple[int | None, str]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, _short(exc)
    out = (proc.stdout.strip() or proc.stderr.strip()).splitlines()
    if not out:
        return proc.returncode, ""
    # A version is the last line printed; an error is best told by its first.
    return proc.returncode, out[-1] if proc.returncode == 0 else out[0]


def check_harness(name: str, sandbox: str = "local", path: str | None = None) -> CheckResult:
    """Is harness ``name`` installed where the run will start it? ``path`` overrides PATH. What
    to look for is the harness class's own ``requires``."""
    from legorl.harnesses import HARNESSES, default_venv_python

    label = f"harness: {name}"
    try:
        cls = HARNESSES.resolve(name)
    except ConfigError as exc:
        return _fail(label, str(exc), f"use one of {HARNESSES.names()}")
    if sandbox == "docker":
        return _skip(label, "runs from the sandbox image's harness-runtime layer, not the host")
    need = cls.requires
    if need.binary is not None:
        found = shutil.which(need.binary, path=path)
        if found is None:
            return _fail(label, f"{need.binary} is not on PATH", need.install)
        code, version = _version([found, "--version"])
        if code != 0:
            return _fail(label, f"{found} --version failed: {version}", need.install)
        return _pass(label, f"{found}: {version}")
    venvs = ("openhands", "miniswe")
    python = default_venv_python(need.python) if need.python in venvs else (need.python or "")
    found = python if os.path.isabs(python) else shutil.which(python, path=path)
    if not found or not os.path.exists(found):
        return _fail(
            label, f"no Python at {python or '(none named)'} for {need.module}", need.install
        )
    probe = (
        "import importlib.util, sys; "
        f"sys.exit(0 if importlib.util.find_spec({need.module!r}) else 3)"
    )
    code, out = _version([found, "-c", probe])
    if code != 0:
        return _fail(
            label, f"{found} cannot import {need.module}{': ' + out if out else ''}", need.install
        )
    return _pass(label, f"{need.module} importable from {found}")


def check_sandbox(
    backend: str,
    *,
    docker_host: str | None = None,
    images: list[str] | None = None,
    tasks: str | None = None,
    task_format: str | None = None,
) -> CheckResult:
    name = f"sandbox: {backend}"
    if backend == "none":
        return _skip("sandbox", "no sandbox configured")
    if backend == "local":
        fix = "apt-get install bubblewrap, and allow unprivileged user namespaces"
        found = shutil.which("bwrap")
        if found is None:
            return _fail(name, "bubblewrap (bwrap) is not on PATH", fix)
        code, out = _version([found, "--ro-bind", "/", "/", "--unshare-all", "true"], timeout=30)
        if code != 0:
            return _fail(name, f"bwrap cannot start a sandbox: {out}", fix)
        return _pass(name, f"{found} starts an isolated sandbox")
    if backend != "docker":
        return _fail(
            name, f"unknown sandbox backend {backend!r}", f"use one of {', '.join(SANDBOXES)}"
        )
    return check_docker(
        docker_host=docker_host, images=images or [], tasks=tasks, task_format=task_format
    )


def _task_layers(tasks: str | None, task_format: str | None = None) -> tuple[list[Any], str]:
    """The image layers the tasks' sandboxes stand on (``legorl.sandbox.layers.plan``), unique
    and bottom first; empty with a note when they cannot be planned."""
    if not tasks:
        return [], ""
    try:
        from legorl.sandbox.layers import plan
        from legorl.tasks import load_tasks

        layers: dict[str, Any] = {}
        for task in load_tasks(tasks, task_format=task_format, notice=lambda _line: None):
            for layer in plan(task):
                layers.setdefault(layer.tag, layer)
    except ImportError:
        return [], "; task layers not checked (legorl.sandbox.layers is not available)"
    except Exception as exc:  # the tasks check reports a bad task file
        return [], f"; task layers not planned: {_short(exc, 120)}"
    return list(layers.values()), ""


def check_docker(
    *,
    docker_host: str | None = None,
    images: list[str],
    tasks: str | None = None,
    task_format: str | None = None,
) -> CheckResult:
    """Ping the daemon with the Docker SDK, look each configured image up, and, given tasks,
    see which of their sandbox layers (base → env → instance) are present or can be built."""
    name = "sandbox: docker"
    where = docker_host or os.environ.get("DOCKER_HOST") or "the default socket"
    fix = (
        "start the daemon (`sudo systemctl start docker`, or `dockerd &`), point DOCKER_HOST "
        "or docker_host: at it, or use --sandbox local"
    )
    try:
        import docker
        from docker.errors import DockerException, ImageNotFound
    except ImportError:
        return _fail(name, "the docker Python SDK is not installed", "pip install docker")
    try:
        client = (
            docker.DockerClient(base_url=docker_host, timeout=10)
            if docker_host
            else docker.from_env(timeout=10)
        )
        client.ping()
    except Exception as exc:
        return _fail(name, f"cannot reach the Docker daemon at {where}: {_short(exc, 200)}", fix)
    layers, note = _task_layers(tasks, task_format)

    def present(tag: str) -> bool:
        try:
            client.images.get(tag)
        except ImageNotFound:
            return False
        return True

    try:
        version = client.version().get("Version", "?")
        missing = [image for image in images if not present(image)]
        absent = [layer for layer in layers if not present(layer.tag)]
    except DockerException as exc:
        return _fail(name, f"the daemon at {where} failed: {_short(exc, 200)}", fix)
    finally:
        client.close()
    if missing:
        return _fail(
            name,
            f"daemon {version} is up, but {len(missing)} image(s) are missing: "
            f"{', '.join(missing)}",
            "build or load them before the run (`docker image ls` lists what is there; "
            "no registry may be reachable)",
        )
    # Missing layers are built on first use: a base needs debootstrap, a prebuilt image a pull.
    unpullable = [layer.tag for layer in absent if layer.kind == "image"]
    if unpullable:
        from legorl.sandbox.images import build_hint

        return _fail(
            name,
            f"{len(unpullable)} prebuilt task image(s) are not here and must be pulled: "
            f"{', '.join(unpullable[:3])}",
            f"get each before the run, e.g. {unpullable[0]} with {build_hint(unpullable[0])}",
        )
    bases = [layer.tag for layer in absent if layer.kind == "base"]
    if bases and shutil.which("debootstrap") is None:
        return _fail(
            name,
            f"{len(bases)} base layer(s) are not built and debootstrap is not installed",
            "apt-get install debootstrap, or build the layers elsewhere: "
            "legorl sandbox build --tasks …",
        )
    what = f"{len(images)} image(s) present"
    if layers:
        what += f"; task layers: {len(layers) - len(absent)} of {len(layers)} built" + (
            f", {len(absent)} to build on first use" if absent else ""
        )
    return _pass(name, f"daemon {version} at {where}; {what}{note}")


def check_disk(workdir: str, budget_gb: float) -> CheckResult:
    name = "disk"
    path = Path(workdir).resolve()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free / 1e9
    if free < budget_gb:
        return _fail(
            name,
            f"{free:.1f} GB free at {probe}, the budget is {budget_gb:g} GB",
            "free space, point workdir at a bigger disk, or lower disk_budget_gb",
        )
    return _pass(name, f"{free:.1f} GB free at {probe} (budget {budget_gb:g} GB)")
