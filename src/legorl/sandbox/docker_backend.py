"""The ``docker`` sandbox backend: the real Docker engine through the ``docker`` SDK.

    from legorl.sandbox import make_backend
    backend = make_backend("docker")
    box = await backend.start(task, "fixtures/tasks", run_id="r1", proxy_url="http://127.0.0.1:8000/s/x")
    result = await box.exec("python -m pytest -q", timeout=120)
    patch = await box.diff()
    await box.close()

Images come from a layered cache (``DockerCache``): ``legorl/base:<key>`` (Debian from
``debootstrap`` + ``docker import``, since no registry is reachable here), ``legorl/env:<key>``
(a venv at /opt/legorl-env with the task's packages and setup steps), ``legorl/instance:<key>``
(the repository at /testbed with one commit of history). A task naming a prebuilt image
(SWE-bench's ``sweb.eval.x86_64.<id>``) stands on it, pulled when missing; its instance layer
locks the image's own /testbed down to one commit (``images.py``) and puts the image's Python
env first on PATH. The harness runtime is a named volume ``legorl-runtime-<key>`` mounted
read-only. Containers run with ``--network none``; a proxy is
reached through the relay (``relay.py``). Every container carries ``legorl.run`` and
``legorl.owner`` labels; a backend's first start removes containers whose owner process is
dead, and ``legorl sandbox gc`` removes the rest.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import json
import os
import re
import secrets
import select
import shutil
import signal
import socket
import struct
import subprocess
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from legorl.protocols import READ_LIMIT, ExecResult, FileTooLarge, Limits, SandboxError
from legorl.sandbox import cgroups, tree_probe
from legorl.sandbox.common import (
    BASE_PATH,
    GRADING_CAPS,
    GRADING_TMP_MB,
    JUDGED_DIR_PREFIX,
    JUDGED_SUBDIRS,
    JUDGED_UID,
    RELAY_DIR,
    RUNTIME_DIR,
    WORKDIR,
    BuildError,
    Counters,
    DaemonDownError,
    Deadline,
    ImageMissingError,
    OutputCap,
    build_lock,
    cache_root,
    classify,
    in_thread,
    judged_env,
    last_used,
    owner_alive,
    owner_tag,
    parse_counters,
    state_root,
    touch_usage,
    write_owner,
)
from legorl.sandbox.images import activation, missing_message, probe_script, scrub_script
from legorl.sandbox.layers import Layer, keep_up_to, plan
from legorl.sandbox.relay import FORWARDER, Relay, inside_port, open_relay, split_proxy_url
from legorl.sandbox.repo import scrubbed_repo
from legorl.sandbox.runtime import (
    RuntimeSources,
    check_command,
    split_layers,
    write_agent_tar,
    write_tar,
)

START_HINT = (
    "start it with `dockerd --data-root /var/lib/docker > /var/log/dockerd.log 2>&1 &` "
    "(or `systemctl start docker`)"
)
LABEL = "legorl.sandbox"
TREE_LIMIT = 4 << 30  # bytes of /testbed copied out for diff()
#: Tar framing around one file in the daemon's archive: headers (pax ones too) and padding.
_TAR_SLACK = 1 << 16


class _StreamOver(Exception):
    """The daemon's stream went past what its reader may take."""


class _CappedStream(io.RawIOBase):
    """A file-like view of a chunk iterator that refuses to read past ``cap`` bytes."""

    def __init__(self, chunks: Any, cap: int | None) -> None:
        self._chunks = iter(chunks)
        self._buf = memoryview(b"")
        self._cap = cap
        self._taken = 0

    def readable(self) -> bool:
        return True

    def readinto(self, out: Any) -> int:
        while not self._buf:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._taken += len(chunk)
            if self._cap is not None and self._taken > self._cap:
                raise _StreamOver
            self._buf = memoryview(chunk)
        n = min(len(out), len(self._buf))
        out[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


@dataclass(slots=True, kw_only=True)
class DockerConfig:
    docker_host: str | None = None  # default: $DOCKER_HOST, else the local socket
    build: bool = True  # False: a layer that is not built yet is an error (--no-build)
    mirror: str | None = None  # debootstrap mirror; default: the first Debian one apt uses
    build_network: str = "bridge"  # env layer steps (pip) need the package registry
    ca_bundle: str | None = "/etc/ssl/certs/ca-certificates.crt"  # host CAs for build steps
    step_timeout_s: float = 1800.0
    budget_gb: float | None = None  # after a build, LRU-remove layers above this total
    #: Test-only: "image" keeps a prebuilt image's git history in the sandbox (the control that
    #: shows the one-commit lockdown matters); see ``legorl.sandbox.layers.HISTORIES``.
    history: str = "one-commit"


@dataclass(slots=True)
class LayerReport:
    kind: str
    tag: str
    name: str
    action: str  # "cached" | "built" | "pulled" | "waited" (another builder made it)
    seconds: float = 0.0


def docker_host(config: DockerConfig) -> str:
    return config.docker_host or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def connect(config: DockerConfig) -> Any:
    """A ``docker.APIClient`` that answered a ping, or ``DaemonDownError`` in one line."""
    import docker
    from docker.utils import kwargs_from_env

    host = docker_host(config)
    kwargs = kwargs_from_env()
    kwargs["base_url"] = host
    try:
        api = docker.APIClient(version="auto", max_pool_size=64, timeout=600, **kwargs)
        api.ping()
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        reason = re.sub(r"\s+", " ", reason)[:200]
        raise DaemonDownError(
            f"cannot reach the Docker daemon at {host} ({reason}); {START_HINT}"
        ) from None
    return api


def _debian_mirror() -> str:
    """The first Debian archive apt on this host uses (not the security one)."""
    texts = []
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        with contextlib.suppress(OSError):
            texts.append(path.read_text())
    for text in texts:
        for url in re.findall(r"(?:URIs:\s*|^deb\s+(?:\[[^\]]*\]\s+)?)(\S+)", text, re.M):
            if "debian" in url and "security" not in url and "snapshot" not in url:
                return url.rstrip("/")
    return "http://deb.debian.org/debian"


def _epoch(stamp: str) -> float:
    """Docker's RFC 3339 time as unix seconds (0 when absent or odd)."""
    import datetime

    try:
        return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _last_line(text: str) -> str:
    for line in reversed(text.rstrip().splitlines()):
        if line.strip():
            return line.strip()[:300]
    return "(no output)"


def _label_conf(layer: Layer, extra: dict[str, str] | None = None) -> dict[str, str]:
    labels = {
        "legorl.layer": layer.kind,
        "legorl.key": layer.key,
        "legorl.name": layer.name,
        "legorl.parent": layer.parent.tag if layer.parent else "",
        "legorl.recipe": json.dumps(layer.recipe, sort_keys=True),
    }
    labels.update(extra or {})
    return labels


# ---- the image cache -------------------------------------------------------------------------


class DockerCache:
    """Builds and finds the layers of a task's image; thread- and process-safe per layer."""

    def __init__(self, api: Any, config: DockerConfig) -> None:
        self.api = api
        self.config = config
        self._known: dict[str, dict[str, Any]] = {}  # tag -> image inspect (present images)
        self._guard = threading.Lock()
        self._runtime: tuple[RuntimeSources, Layer, Layer] | None = None

    # -- lookup

    def image(self, tag: str, *, fresh: bool = False) -> dict[str, Any] | None:
        import docker.errors

        with self._guard:
            if not fresh and tag in self._known:
                return self._known[tag]
        try:
            info = self.api.inspect_image(tag)
        except docker.errors.ImageNotFound:
            return None
        except docker.errors.APIError as exc:
            if exc.status_code == 404:
                return None
            raise SandboxError(f"docker inspect {tag}: {exc.explanation or exc}") from None
        with self._guard:
            self._known[tag] = info
        return info

    def forget(self, tag: str) -> None:
        with self._guard:
            self._known.pop(tag, None)

    # -- ensure

    def ensure(
        self, task: Any, tasks_dir: Path, *, level: str = "instance", build: bool | None = None
    ) -> list[LayerReport]:
        """Every layer of ``task`` up to ``level`` present (built or pulled when allowed)."""
        build = self.config.build if build is None else build
        layers = keep_up_to(plan(task, history=self.config.history), level)
        reports = []
        for layer in layers:
            reports.append(self._ensure_layer(layer, task, Path(tasks_dir), build))
        return reports

    def _ensure_layer(self, layer: Layer, task: Any, tasks_dir: Path, build: bool) -> LayerReport:
        if self.image(layer.tag) is not None and not self._stale(layer):
            touch_usage(layer.tag)
            return LayerReport(layer.kind, layer.tag, layer.name, "cached")
        if not build and layer.kind == "image":
            raise ImageMissingError(missing_message(layer.tag, "pulling is off: --no-build"))
        if not build:
            raise ImageMissingError(
                f"{layer.kind} layer {layer.tag} ({layer.name}) is not built and building is off "
                f"(--no-build); build it with `legorl sandbox build --tasks …`"
            )
        started = time.monotonic()
        with build_lock(layer.tag):
            fresh = self.image(layer.tag, fresh=True)
            if fresh is not None and not self._stale(layer):  # another builder finished it
                touch_usage(layer.tag)
                return LayerReport(layer.kind, layer.tag, layer.name, "waited")
            log_path = cache_root() / "logs" / f"{layer.kind}-{layer.key}.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            action = "built"
            if layer.kind == "image":
                self._pull(layer)
                action = "pulled"
            elif layer.kind == "base":
                self.build_base(layer, log_path)
            elif layer.kind == "env":
                self._build_env(layer, log_path)
            elif layer.kind == "instance":
                self._build_instance(layer, task, tasks_dir, log_path)
            if self.image(layer.tag, fresh=True) is None:
                raise SandboxError(f"{layer.kind} layer {layer.tag}: built but not found after")
        touch_usage(layer.tag)
        if self.config.budget_gb is not None:
            self.gc_budget(self.config.budget_gb, keep={layer.tag})
        return LayerReport(layer.kind, layer.tag, layer.name, action, time.monotonic() - started)

    def _stale(self, layer: Layer) -> bool:
        """An instance layer built on a prebuilt image that has since changed under its tag."""
        parent = layer.parent
        if layer.kind != "instance" or parent is None or parent.kind != "image":
            return False
        mine, theirs = self.image(layer.tag), self.image(parent.tag)
        if mine is None or theirs is None:
            return False
        labels = (mine.get("Config") or {}).get("Labels") or {}
        return labels.get("legorl.parent_id") != theirs.get("Id")

    # -- builders

    def _pull(self, layer: Layer) -> None:
        import docker.errors

        repo, _, tag = layer.tag.rpartition(":")
        if not repo or "/" in tag:
            repo, tag = layer.tag, "latest"
        try:
            self.api.pull(repo, tag=tag)
        except docker.errors.APIError as exc:
            why = re.sub(r"\s+", " ", str(exc.explanation or exc))[:160]
            raise BuildError(missing_message(layer.tag, why), step="pull") from None

    def build_base(self, layer: Layer, log_path: Path) -> None:
        recipe = layer.recipe
        if shutil.which("debootstrap") is None:
            raise BuildError(
                f"base layer {layer.tag} ({layer.name}) needs debootstrap to build "
                "(apt-get install debootstrap; no image registry is used)",
                step="debootstrap",
            )
        if os.geteuid() != 0:
            raise BuildError(
                f"base layer {layer.tag} ({layer.name}): debootstrap must run as root",
                step="debootstrap",
            )
        mirror = self.config.mirror or _debian_mirror()
        with tempfile.TemporaryDirectory(prefix="legorl-rootfs-") as tmp:
            rootfs = Path(tmp) / "rootfs"
            argv = [
                "debootstrap",
                f"--variant={recipe['variant']}",
                f"--include={','.join(recipe['include'])}",
                recipe["suite"],
                str(rootfs),
                mirror,
            ]
            self._host_step(layer, log_path, "debootstrap", argv, 1, 2)
            for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
                for item in (rootfs / junk).glob("*"):
                    if item.is_file():
                        item.unlink()
            archive = Path(tmp) / "rootfs.tar"
            self._host_step(
                layer, log_path, "tar", ["tar", "-C", str(rootfs), "-cf", str(archive), "."], 2, 2
            )
            repo, _, tag = layer.tag.partition(":")
            labels = _label_conf(layer)
            changes = [f"ENV PATH={BASE_PATH}", "ENV LANG=C.UTF-8", "ENV HOME=/root"]
            changes += [f"LABEL {k}={json.dumps(v)}" for k, v in labels.items()]
            changes.append('CMD ["sleep", "infinity"]')
            self.api.import_image(src=str(archive), repository=repo, tag=tag, changes=changes)

    def _host_step(
        self, layer: Layer, log_path: Path, name: str, argv: list[str], i: int, n: int
    ) -> None:
        with open(log_path, "ab") as log:
            log.write(f"$ {' '.join(argv)}\n".encode())
            log.flush()
            proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=False)
        if proc.returncode != 0:
            text = log_path.read_text(errors="replace")
            raise BuildError(
                f"{layer.kind} layer {layer.tag} ({layer.name}) failed at step {i}/{n} `{name}` "
                f"(exit {proc.returncode}): {_last_line(text)} (log: {log_path})",
                step=name,
                log_tail=_tail(text),
                log_path=str(log_path),
            )

    def _container_steps(
        self, layer: Layer, cid: str, steps: list[tuple[str, list[str]]], log_path: Path
    ) -> None:
        env = [
            f"PATH={BASE_PATH}",
            "HOME=/root",
            "LANG=C.UTF-8",
            "PIP_DISABLE_PIP_VERSION_CHECK=1",
            "PIP_NO_CACHE_DIR=1",
        ]
        if self._ca_bundle():
            env += [f"PIP_CERT={self._ca_bundle()}", f"SSL_CERT_FILE={self._ca_bundle()}"]
        n = len(steps)
        for i, (name, argv) in enumerate(steps, start=1):
            ex = self.api.exec_create(
                cid,
                ["timeout", "-s", "KILL", str(int(self.config.step_timeout_s)), *argv],
                environment=env,
                workdir="/",
            )
            chunks: list[bytes] = []
            with open(log_path, "ab") as log:
                log.write(f"$ {name}\n".encode())
                for chunk in self.api.exec_start(ex["Id"], stream=True):
                    log.write(chunk)
                    chunks.append(chunk)
            code = self.api.exec_inspect(ex["Id"])["ExitCode"]
            if code != 0:
                text = b"".join(chunks).decode("utf-8", "replace")
                raise BuildError(
                    f"{layer.kind} layer {layer.tag} ({layer.name}) failed at step {i}/{n} "
                    f"`{name}` (exit {code}): {_last_line(text)} (log: {log_path})",
                    step=name,
                    log_tail=_tail(text),
                    log_path=str(log_path),
                )

    def _ca_bundle(self) -> str | None:
        ca = self.config.ca_bundle
        return ca if ca and Path(ca).is_file() else None

    def _build_env(self, layer: Layer, log_path: Path) -> None:
        assert layer.parent is not None
        recipe = layer.recipe
        venv = recipe["venv"]
        steps: list[tuple[str, list[str]]] = [
            (f"python3 -m venv {venv}", ["python3", "-m", "venv", venv])
        ]
        if recipe["packages"]:
            pip = [f"{venv}/bin/python", "-m", "pip", "install", "-q", *recipe["packages"]]
            steps.append((f"pip install {' '.join(recipe['packages'])}", pip))
        for cmd in recipe["setup"]:
            steps.append((cmd, ["/bin/sh", "-c", cmd]))
        binds = {}
        if self._ca_bundle():
            binds[self._ca_bundle()] = {"bind": self._ca_bundle(), "mode": "ro"}
        host_config = self.api.create_host_config(
            network_mode=self.config.build_network, binds=binds or None
        )
        container = self.api.create_container(
            layer.parent.tag,
            command=["sleep", "infinity"],
            host_config=host_config,
            labels={"legorl.build": layer.tag, "legorl.owner": owner_tag()},
        )
        cid = container["Id"]
        try:
            self.api.start(cid)
            self._container_steps(layer, cid, steps, log_path)
            self.api.stop(cid, timeout=0)
            repo, _, tag = layer.tag.partition(":")
            self.api.commit(
                cid,
                repository=repo,
                tag=tag,
                conf={
                    "Labels": _label_conf(layer),
                    "Env": [f"PATH={BASE_PATH}", f"VIRTUAL_ENV={venv}", "HOME=/root"],
                    "Cmd": ["sleep", "infinity"],
                },
            )
        finally:
            with contextlib.suppress(Exception):
                self.api.remove_container(cid, force=True)

    def _build_instance(self, layer: Layer, task: Any, tasks_dir: Path, log_path: Path) -> None:
        assert layer.parent is not None
        if layer.recipe.get("repo_from") == "image":
            self._build_instance_on_image(layer, task, log_path)
            return
        with tempfile.TemporaryDirectory(prefix="legorl-instance-") as tmp:
            repo_dir = Path(tmp) / "testbed"
            repo_dir.mkdir()
            try:
                sha = scrubbed_repo(task, tasks_dir, repo_dir)
            except SandboxError as err:
                raise BuildError(
                    f"instance layer {layer.tag} ({layer.name}) failed at step 1/2 `checkout`: {err}",
                    step="checkout",
                ) from None
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                tar.add(repo_dir, WORKDIR.strip("/"))
            from_image = layer.parent.kind == "image"  # may carry its own /testbed: replace it
            container = self.api.create_container(
                layer.parent.tag,
                command=["rm", "-rf", WORKDIR] if from_image else ["true"],
                labels={"legorl.build": layer.tag, "legorl.owner": owner_tag()},
                host_config=self.api.create_host_config(network_mode="none"),
            )
            cid = container["Id"]
            try:
                if from_image:
                    self.api.start(cid)
                    self.api.wait(cid, timeout=300)
                if not self.api.put_archive(cid, "/", buf.getvalue()):
                    raise BuildError(
                        f"instance layer {layer.tag} ({layer.name}) failed at step 2/2 `copy repo`",
                        step="copy repo",
                    )
                self._commit_instance(cid, layer, {"legorl.base_sha": sha}, task)
            finally:
                with contextlib.suppress(Exception):
                    self.api.remove_container(cid, force=True)
        with open(log_path, "a") as log:
            log.write(f"instance {task.instance_id}: one commit {sha}\n")

    def _commit_instance(
        self, cid: str, layer: Layer, labels: dict[str, str], task: Any, *, user: str = ""
    ) -> None:
        repo, _, tag = layer.tag.partition(":")
        labels = {**labels, "legorl.base_commit": task.base_commit}
        conf: dict[str, Any] = {
            "Labels": _label_conf(layer, labels),
            "WorkingDir": WORKDIR,
            "Cmd": ["sleep", "infinity"],
            "Entrypoint": None,
        }
        if user:  # an image's own user may not be root; our layers run as root
            conf["User"] = user
        self.api.commit(cid, repository=repo, tag=tag, conf=conf)

    def _build_instance_on_image(self, layer: Layer, task: Any, log_path: Path) -> None:
        """The image's own repository locked down in place (``images.scrub_script``) and its
        Python env found (``images.probe_script``), committed with both as labels."""
        assert layer.parent is not None
        parent = self.image(layer.parent.tag, fresh=True)
        if parent is None:
            raise ImageMissingError(missing_message(layer.parent.tag, "it is gone"))
        scrub = layer.recipe["history"] == "one-commit"
        script = f"{scrub_script(task.base_commit, scrub=scrub)}\n{probe_script()}"
        container = self.api.create_container(
            layer.parent.tag,
            command=["/bin/sh", "-c", script],
            entrypoint=[],
            user="root",
            working_dir="/",
            labels={"legorl.build": layer.tag, "legorl.owner": owner_tag()},
            host_config=self.api.create_host_config(network_mode="none"),
        )
        cid = container["Id"]
        try:
            what = f"instance layer {layer.tag} ({layer.name}) on image {layer.parent.tag}"
            text = self._run_step(cid, what=what, step="lock the repository down", log=log_path)
            facts = dict(
                line.split("=", 1) for line in text.splitlines() if re.match(r"^(env|path)=", line)
            )
            shas = re.findall(r"^sha=(\S+) tree=(\S+)$", text, re.M)
            sha = shas[-1][0]
            env_dir = facts.get("env", "")
            path = facts.get("path") or BASE_PATH
            try:
                activated = activation(text)
            except ValueError as exc:
                raise SandboxError(f"{what}: {exc}") from None
            env_path = f"{env_dir}/bin:{path}" if env_dir else path
            env_path = activated.pop("PATH", env_path)
            labels = {
                "legorl.base_sha": sha,
                "legorl.parent_id": parent["Id"],
                "legorl.env_dir": env_dir,
                "legorl.env_path": env_path,
                "legorl.env_activation": json.dumps(activated, sort_keys=True),
            }
            self._commit_instance(cid, layer, labels, task, user="root")
        finally:
            with contextlib.suppress(Exception):
                self.api.remove_container(cid, force=True)
        with open(log_path, "a") as log:
            what = "one commit" if scrub else "history kept (control)"
            log.write(f"instance {task.instance_id} on {layer.parent.tag}: {what} {sha}\n")

    # -- the harness runtime (two named volumes: the tools, and the agent files)

    def runtime_volumes(
        self, *, base_tag: str, build: bool | None = None
    ) -> list[tuple[str, str, LayerReport]]:
        """(volume, mount point, report) of the runtime's two volumes, built when missing."""
        build = self.config.build if build is None else build
        with self._guard:
            if self._runtime is None:
                src = RuntimeSources.find()
                self._runtime = (src, *split_layers(src))
        src, tools, agent = self._runtime
        tools_volume, tools_report = self.tools_volume(src, tools, base_tag, build)
        agent_volume, agent_report = self.agent_volume(src, agent, base_tag, build)
        return [
            (tools_volume, RUNTIME_DIR, tools_report),
            (agent_volume, f"{RUNTIME_DIR}/agent", agent_report),
        ]

    def tools_volume(
        self, src: RuntimeSources, layer: Layer, base_tag: str, build: bool
    ) -> tuple[str, LayerReport]:
        """Node, the npm harnesses and the harness venvs, checked by running each."""

        def fill(volume: str) -> None:
            self._fill(
                volume, base_tag, "legorl-runtime", lambda out: write_tar(src, out, layer.recipe)
            )
            check = check_command(layer.recipe)
            self._run_once(
                base_tag,
                ["/bin/sh", "-c", check],
                mounts={volume: RUNTIME_DIR},
                layer=layer,
                step=f"check: {check}",
            )

        return self._volume("legorl-runtime", layer, build, fill, base_tag)

    def agent_volume(
        self, src: RuntimeSources, layer: Layer, base_tag: str, build: bool
    ) -> tuple[str, LayerReport]:
        """The built-in agent's files (mounted over the tools volume's empty agent/)."""

        def fill(volume: str) -> None:
            self._fill(volume, base_tag, "agent", lambda out: write_agent_tar(src, out))

        return self._volume("legorl-agent", layer, build, fill, base_tag)

    def _volume(
        self, prefix: str, layer: Layer, build: bool, fill: Callable[[str], None], base_tag: str
    ) -> tuple[str, LayerReport]:
        import docker.errors

        name = f"{prefix}-{layer.key}"
        try:
            self.api.inspect_volume(name)
            touch_usage(name)
            return name, LayerReport("runtime", name, layer.name, "cached")
        except docker.errors.NotFound:
            pass
        if not build:
            raise ImageMissingError(
                f"runtime layer {name} is not built and building is off (--no-build); "
                "build it with `legorl sandbox build --runtime`"
            )
        started = time.monotonic()
        with build_lock(name):
            with contextlib.suppress(docker.errors.NotFound):
                self.api.inspect_volume(name)
                return name, LayerReport("runtime", name, layer.name, "waited")
            partial = f"{name}-partial-{secrets.token_hex(4)}"
            self.api.create_volume(
                partial, labels={"legorl.layer": "partial", "legorl.owner": owner_tag()}
            )
            try:
                fill(partial)
                # Volumes cannot be renamed: copy the checked content into the final name
                # inside the daemon, so a half-written volume never carries the final name.
                labels = {
                    "legorl.layer": "runtime",
                    "legorl.key": layer.key,
                    "legorl.name": layer.name,
                    "legorl.recipe": json.dumps(layer.recipe, sort_keys=True),
                }
                self.api.create_volume(name, labels=labels)
                self._run_once(
                    base_tag,
                    ["cp", "-a", "/src/.", "/dst/"],
                    mounts={partial: "/src", name: "/dst"},
                    layer=layer,
                    step="commit volume",
                )
            except BaseException:
                with contextlib.suppress(Exception):
                    self.api.remove_volume(name, force=True)
                raise
            finally:
                with contextlib.suppress(Exception):
                    self.api.remove_volume(partial, force=True)
        touch_usage(name)
        return name, LayerReport("runtime", name, layer.name, "built", time.monotonic() - started)

    def _fill(self, volume: str, base_tag: str, top: str, writer: Callable[[Any], None]) -> None:
        """Extract a tar (top folder ``top``) into a volume through a never-started container."""
        from docker.types import Mount

        container = self.api.create_container(
            base_tag,
            command=["true"],
            host_config=self.api.create_host_config(
                network_mode="none", mounts=[Mount(f"/mnt/fill/{top}", volume, type="volume")]
            ),
            labels={"legorl.build": volume, "legorl.owner": owner_tag()},
        )
        cid = container["Id"]
        try:
            with tempfile.TemporaryFile(prefix="legorl-runtime-") as tmp:
                writer(tmp)
                tmp.seek(0)
                if not self.api.put_archive(cid, "/mnt/fill", tmp):
                    raise BuildError(
                        f"runtime layer {volume}: copying files in failed", step="copy"
                    )
        finally:
            with contextlib.suppress(Exception):
                self.api.remove_container(cid, force=True)

    def _run_once(
        self,
        image: str,
        argv: list[str],
        *,
        mounts: dict[str, str],
        layer: Layer,
        step: str,
    ) -> None:
        from docker.types import Mount

        log_path = cache_root() / "logs" / f"runtime-{layer.key}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        container = self.api.create_container(
            image,
            command=argv,
            host_config=self.api.create_host_config(
                network_mode="none",
                mounts=[Mount(target, vol, type="volume") for vol, target in mounts.items()],
            ),
            environment={"HOME": "/tmp", "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
            labels={"legorl.build": layer.key, "legorl.owner": owner_tag()},
        )
        cid = container["Id"]
        try:
            self._run_step(cid, what=f"runtime layer ({layer.name})", step=step, log=log_path)
        finally:
            with contextlib.suppress(Exception):
                self.api.remove_container(cid, force=True)

    def _run_step(self, cid: str, *, what: str, step: str, log: Path) -> str:
        """Start a created container and wait for it; its output, logged. A non-zero exit is
        a ``BuildError`` naming ``what`` and ``step``."""
        self.api.start(cid)
        code = self.api.wait(cid, timeout=int(self.config.step_timeout_s))["StatusCode"]
        text = self.api.logs(cid).decode("utf-8", "replace")
        with open(log, "a") as fh:
            fh.write(f"$ {step}\n{text}")
        if code != 0:
            raise BuildError(
                f"{what} failed at step `{step}` (exit {code}): {_last_line(text)} (log: {log})",
                step=step,
                log_tail=_tail(text),
                log_path=str(log),
            )
        return text

    # -- listing and removal

    def layers(self, *, volume_sizes: bool = False) -> list[dict[str, Any]]:
        """Every legorl layer: tag, kind, name, own and total size, created, last use. Runtime
        volumes are sized only with ``volume_sizes`` (the daemon walks them: seconds)."""

        images = self.api.images(filters={"label": "legorl.layer"})
        by_tag: dict[str, dict[str, Any]] = {}
        for img in images:
            for tag in img.get("RepoTags") or []:
                if tag.startswith("legorl/"):
                    by_tag[tag] = img
        rows = []
        for tag, img in sorted(by_tag.items()):
            labels = img.get("Labels") or {}
            parent = labels.get("legorl.parent", "")
            parent_size = by_tag[parent]["Size"] if parent in by_tag else 0
            if parent and parent not in by_tag:
                with contextlib.suppress(Exception):
                    parent_size = self.api.inspect_image(parent)["Size"]
            rows.append(
                {
                    "kind": labels.get("legorl.layer", "?"),
                    "tag": tag,
                    "name": labels.get("legorl.name", ""),
                    "parent": parent,
                    "size": max(0, img["Size"] - parent_size),
                    "total": img["Size"],
                    "created": img.get("Created", 0),
                    "last_used": last_used(tag) or img.get("Created", 0),
                    "id": img["Id"],
                }
            )
        sizes: dict[str, int] = {}
        if volume_sizes:
            with contextlib.suppress(Exception):
                for vol in self.api.df().get("Volumes") or []:
                    sizes[vol["Name"]] = (vol.get("UsageData") or {}).get("Size", -1)
        for vol in self.api.volumes(filters={"label": "legorl.layer=runtime"}).get("Volumes") or []:
            rows.append(
                {
                    "kind": "runtime",
                    "tag": vol["Name"],
                    "name": (vol.get("Labels") or {}).get("legorl.name", "harness-runtime"),
                    "parent": "",
                    "size": sizes.get(vol["Name"]),
                    "total": sizes.get(vol["Name"]),
                    "created": _epoch(vol.get("CreatedAt", "")),
                    "last_used": last_used(vol["Name"]),
                    "id": vol["Name"],
                }
            )
        return rows

    def gc_budget(self, budget_gb: float, keep: set[str] | None = None) -> list[str]:
        """Remove least-recently-used leaf layers until the images total at most the budget."""
        import docker.errors

        keep = keep or set()
        removed: list[str] = []
        budget = int(budget_gb * 1024**3)
        while True:
            rows = [r for r in self.layers() if r["kind"] != "runtime"]
            total = sum(r["size"] for r in rows)
            if total <= budget:
                return removed
            parents = {r["parent"] for r in rows}
            in_use = {c["Image"] for c in self.api.containers(all=True, filters={"label": LABEL})}
            leaves = [
                r
                for r in rows
                if r["tag"] not in parents and r["tag"] not in keep and r["tag"] not in in_use
            ]
            if not leaves:
                return removed
            victim = min(leaves, key=lambda r: r["last_used"])
            try:
                self.api.remove_image(victim["tag"])
            except docker.errors.APIError:
                keep.add(victim["tag"])
                continue
            self.forget(victim["tag"])
            removed.append(victim["tag"])


# ---- containers ------------------------------------------------------------------------------


#: How long an ended command's stream must stay quiet before its output is taken as complete.
_DRAIN_S = 1.0


def _frames(buf: bytearray) -> list[tuple[int, bytes]]:
    """Pop complete multiplexed frames (8-byte header: stream, 0, 0, 0, size) from ``buf``."""
    out = []
    while len(buf) >= 8:
        stream, size = buf[0], struct.unpack(">I", bytes(buf[4:8]))[0]
        if len(buf) < 8 + size:
            break
        out.append((stream, bytes(buf[8 : 8 + size])))
        del buf[: 8 + size]
    return out


class DockerSandbox:
    """One running container; see ``legorl.protocols.Sandbox``."""

    def __init__(
        self,
        backend: DockerBackend,
        container_id: str,
        name: str,
        *,
        limits: Limits,
        base_sha: str,
        relay: Relay | None,
        rundir: Path | None,
        runtime: bool,
        image: str = "",
        env_path: str = BASE_PATH,
        env_vars: dict[str, str] | None = None,
        grading: bool = False,
    ) -> None:
        self.backend = backend
        self.grading = grading
        self._judged_ready = False  # the repository is chowned to the judged user
        self.api = backend.api
        self.id = name
        self.container_id = container_id
        self.workdir = WORKDIR
        self.proxy_url = relay.inside_url if relay else None
        self.runtime_dir = RUNTIME_DIR if runtime else None
        self.limits = limits
        self.base_sha = base_sha
        self.image = image
        self._relay = relay
        self._rundir = rundir
        self._deadline = Deadline(limits.wall_s)
        self._cgroups: cgroups.CgroupSet | None = None
        self._closed = False
        self.env_path = env_path + (f":{RUNTIME_DIR}/bin" if runtime else "")
        #: What the image's env's activation sets (``images.probe_script``), for every command.
        self.env_vars = dict(env_vars or {})
        #: What a harness adds to a command's env: the activated env, PATH with the env's
        #: folder (and the runtime).
        self.runtime_env = {**self.env_vars, "PATH": self.env_path}
        #: The OpenHands SDK's Python when the runtime is attached.
        self.openhands_python = f"{RUNTIME_DIR}/openhands/bin/python" if runtime else None

    # -- exec

    async def exec(
        self,
        cmd: str | list[str],
        *,
        timeout: float = 600.0,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
        on_output: Callable[[bytes], None] | None = None,
        judged: bool = False,
    ) -> ExecResult:
        return await in_thread(
            self.exec_sync,
            cmd,
            timeout=timeout,
            env=env,
            cwd=cwd,
            stdin=stdin,
            on_output=on_output,
            judged=judged,
        )

    def _judged_folder(self) -> str:
        """As root: the repository chowned to the judged user (before the first judged
        command; ``-h``: a symlink in the tree is changed itself, never what it points at),
        and a fresh private folder for this judged command, empty, mode 0700, its owner."""
        folder = f"/tmp/{JUDGED_DIR_PREFIX}{secrets.token_hex(8)}"
        dirs = [folder, *(f"{folder}/{sub}" for sub in JUDGED_SUBDIRS)]
        owner = f"{JUDGED_UID}:{JUDGED_UID}"
        steps = [] if self._judged_ready else [["chown", "-R", "-h", "-P", owner, WORKDIR]]
        steps += [["mkdir", "-m", "0700", *dirs], ["chown", owner, *dirs]]
        script = " && ".join(" ".join(step) for step in steps)
        made = self.exec_sync(["/bin/sh", "-c", script], timeout=300, cwd="/")
        if made.exit_code != 0:
            raise SandboxError(
                f"sandbox {self.id}: cannot prepare the judged run: {_last(made.output)}"
            )
        self._judged_ready = True
        return folder

    def exec_sync(
        self,
        cmd: str | list[str],
        *,
        timeout: float = 600.0,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
        on_output: Callable[[bytes], None] | None = None,
        output_limit: int | None = None,
        judged: bool = False,
    ) -> ExecResult:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        private = judged_env(self._judged_folder()) if judged else {}
        left = self._deadline.left()
        if left <= 0:
            return ExecResult(exit_code=None, output="", timed_out=True, killed_by="wall")
        wall_bound = left < timeout
        budget = min(timeout, left)
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        environment = {**self.env_vars, "PATH": self.env_path, **(env or {}), **private}
        started = time.monotonic()
        before = self._counters()
        try:
            ex = self.api.exec_create(
                self.container_id,
                # One pipe for both streams keeps their interleaving exact.
                [
                    "timeout",
                    "-s",
                    "KILL",
                    f"{budget:.3f}",
                    "/bin/sh",
                    "-c",
                    'exec "$@" 2>&1',
                    "sh",
                    *argv,
                ],
                stdout=True,
                stderr=True,
                stdin=stdin is not None,
                environment=environment,
                workdir=cwd or WORKDIR,
                user=f"{JUDGED_UID}:{JUDGED_UID}" if judged else "",
            )
        except Exception as exc:
            raise SandboxError(f"sandbox {self.id}: exec failed: {_short(exc)}") from None
        cap = OutputCap(self.limits.output_bytes if output_limit is None else output_limit)
        self._stream(ex["Id"], stdin, cap, on_output, started + budget + 5.0)
        info = self.api.exec_inspect(ex["Id"])
        duration = time.monotonic() - started
        code = info.get("ExitCode")
        if info.get("Running"):
            code = None  # outlived even the kill (only a process that left its group can)
        timed_out = code is None or (code in (124, 137) and duration >= budget - 0.05)
        after = self._counters() if code != 0 else before
        killed_by = classify(
            code,
            timed_out=timed_out,
            wall_hit=timed_out and wall_bound,
            before=before,
            after=after,
        )
        if killed_by == "pids":
            # The command's leftovers still hold the PIDs; end its process group (``timeout``
            # made one, led by the exec's pid) so the sandbox stays usable.
            with contextlib.suppress(OSError, TypeError, ValueError):
                os.killpg(int(info.get("Pid") or 0) or -1, signal.SIGKILL)
        if killed_by in ("timeout", "wall") or (killed_by == "memory" and code == 137):
            code = None
        return ExecResult(
            exit_code=code,
            output=cap.text(),
            timed_out=timed_out,
            truncated=cap.truncated,
            killed_by=killed_by,
            duration_s=duration,
        )

    def _stream(
        self,
        exec_id: str,
        stdin: bytes | None,
        cap: OutputCap,
        on_output: Callable[[bytes], None] | None,
        hard_deadline: float,
    ) -> None:
        sock, pending = self.backend.exec_socket(exec_id)
        buf = bytearray(pending)
        try:
            if stdin is not None:
                sock.sendall(stdin)
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)
            idle_since = time.monotonic()
            ended = False
            while True:
                for _, data in _frames(buf):
                    cap.add(data)
                    if on_output is not None:
                        on_output(data)
                now = time.monotonic()
                if now > hard_deadline:
                    return
                ready, _, _ = select.select([sock], [], [], 0.25)
                if ready:
                    try:
                        data = sock.recv(1 << 16)
                    except OSError:
                        data = b""
                    if not data:
                        for _, frame in _frames(buf):
                            cap.add(frame)
                            if on_output is not None:
                                on_output(frame)
                        return
                    buf += data
                    idle_since = now
                elif ended and now - idle_since > _DRAIN_S:
                    return  # ended, and no more output came: a background child holds the stream
                elif not ended and now - idle_since > 0.5:
                    # The command may have ended while a background child keeps the stream open.
                    # Docker answers the start before the process runs (not yet started reads as
                    # not running, with no exit code), and copies the output to this socket after
                    # the process has ended: both can lag on a busy host, so the stream is read
                    # until it has been quiet for _DRAIN_S after the end.
                    idle_since = now
                    info = self.api.exec_inspect(exec_id)
                    ended = not info.get("Running") and info.get("ExitCode") is not None
        finally:
            with contextlib.suppress(OSError):
                sock.close()

    def _counters(self) -> Counters | None:
        if self._cgroups is None:
            try:
                pid = self.api.inspect_container(self.container_id)["State"]["Pid"]
            except Exception:
                return None
            self._cgroups = cgroups.of_pid(pid)
        counters = self._cgroups.counters()
        if counters is not None:
            return counters
        # A remote daemon: ask inside (fails when the pids limit is still exhausted).
        v1 = "/sys/fs/cgroup/memory/memory.oom_control"
        try:
            oom = self._read_inside(v1) or self._read_inside("/sys/fs/cgroup/memory.events")
            pids = self._read_inside("/sys/fs/cgroup/pids/pids.events") or self._read_inside(
                "/sys/fs/cgroup/pids.events"
            )
        except Exception:
            return None
        return parse_counters(oom.decode(), pids.decode())

    def _read_inside(self, path: str) -> bytes:
        try:
            return self.read_file_sync(path, 1 << 20)
        except FileNotFoundError:
            return b""

    # -- files

    async def write_file(self, path: str, data: bytes) -> None:
        await in_thread(self.write_file_sync, path, data)

    def write_file_sync(self, path: str, data: bytes) -> None:
        full = path if path.startswith("/") else f"{WORKDIR}/{path}"
        folder, _, name = full.rstrip("/").rpartition("/")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            info.mtime = int(time.time())
            tar.addfile(info, io.BytesIO(data))
        import docker.errors

        try:
            self.api.put_archive(self.container_id, folder or "/", buf.getvalue())
        except docker.errors.NotFound:
            made = self.exec_sync(["mkdir", "-p", folder], timeout=30)
            if made.exit_code != 0:
                raise SandboxError(
                    f"sandbox {self.id}: cannot create {folder}: {made.output}"
                ) from None
            self.api.put_archive(self.container_id, folder, buf.getvalue())

    async def read_file(self, path: str, *, limit: int | None = READ_LIMIT) -> bytes:
        return await in_thread(self.read_file_sync, path, limit)

    def read_file_sync(self, path: str, limit: int | None = READ_LIMIT) -> bytes:
        """The daemon's tar stream of ``path``, read chunk by chunk: the size the daemon
        states is checked before any byte is read, and the stream is never read past
        ``limit`` plus the tar framing (a file may grow after the daemon stats it)."""
        import docker.errors

        full = path if path.startswith("/") else f"{WORKDIR}/{path}"
        try:
            stream, stat = self.api.get_archive(self.container_id, full)
        except docker.errors.NotFound:
            raise FileNotFoundError(f"{full}: no such file in sandbox {self.id}") from None
        try:
            size = (stat or {}).get("size")
            if limit is not None and isinstance(size, int) and size > limit:
                raise FileTooLarge(full, limit, size)
            reader = _CappedStream(stream, None if limit is None else limit + _TAR_SLACK)
            try:
                with tarfile.open(fileobj=reader, mode="r|") as tar:
                    member = tar.next()
                    if member is None or not member.isfile():
                        raise IsADirectoryError(f"{full}: not a regular file in sandbox {self.id}")
                    if limit is not None and member.size > limit:
                        raise FileTooLarge(full, limit, member.size)
                    fh = tar.extractfile(member)
                    assert fh is not None
                    return fh.read()
            except _StreamOver:
                raise FileTooLarge(full, limit or 0) from None
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    close()

    async def diff(self) -> str:
        return await in_thread(self.diff_sync)

    def diff_sync(self) -> str:
        """The agent's changes against the base commit, computed outside the agent's reach: the
        daemon copies /testbed into a fresh container of the pristine instance image (its own
        git, shell and .git, which the agent never touched) and ``tree_probe`` diffs it there
        with a clean configuration; the patch is read from a file, never from a merged stream."""
        import docker.errors

        with tempfile.TemporaryFile(prefix="legorl-tree-") as tmp:
            try:
                stream, _ = self.api.get_archive(self.container_id, WORKDIR)
                for chunk in stream:
                    if tmp.tell() + len(chunk) > TREE_LIMIT:
                        raise SandboxError(
                            f"sandbox {self.id}: the tree is larger than {TREE_LIMIT >> 30} GiB"
                        )
                    tmp.write(chunk)
            except docker.errors.APIError as exc:
                raise SandboxError(
                    f"sandbox {self.id}: cannot copy the tree: {_short(exc)}"
                ) from None
            tmp.seek(0)
            helper = self.backend.helper_box(self.image, base_sha=self.base_sha)
            try:
                if not self.api.put_archive(helper.container_id, "/tmp", tmp):
                    raise SandboxError(f"sandbox {self.id}: copying the tree for the diff failed")
                return helper.probe_diff("/tmp/testbed", f"{WORKDIR}/.git")
            finally:
                helper.close_sync()

    def probe_diff(self, root: str, git_dir: str) -> str:
        """Run ``tree_probe``'s diff of ``root`` in this (trusted) container: the script on
        stdin, the request as its argument, the result (patch included) as its last line."""
        work = f"/tmp/legorl-diff-{secrets.token_hex(4)}"
        req = {
            "mode": "diff",
            "root": root,
            "git_dir": git_dir,
            "base": self.base_sha,
            "index": f"{work}-index",
            "out": f"{work}-out",
            "skip_junk": True,
            "respect_ignores": True,
            "print": True,
        }
        run = self.exec_sync(
            ["python3", "-I", "-S", "-", json.dumps(req)],
            timeout=300,
            cwd="/",
            stdin=Path(tree_probe.__file__).read_bytes(),
            output_limit=256 << 20,
        )
        try:
            out = json.loads(run.output.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise SandboxError(f"sandbox {self.id}: git diff failed: {_last(run.output)}") from None
        if "error" in out or run.truncated:
            why = out.get("error", "the patch is larger than 256 MiB")
            raise SandboxError(f"sandbox {self.id}: git diff failed: {why}")
        return str(out["patch"])

    async def alive(self) -> bool | None:
        return await in_thread(self.alive_sync)

    def alive_sync(self) -> bool | None:
        """The daemon's view, never a command in the container (the agent, root there, may
        have replaced ``true`` or ``timeout``): True while the container runs; False when
        the daemon answers and the container has stopped or is gone (what ran in it ended
        it: its init exits with its child, and the container is removed on exit); None when
        the daemon does not answer."""
        import docker.errors

        try:
            self.api.ping()
            state = self.api.inspect_container(self.container_id).get("State", {})
        except docker.errors.NotFound:
            return False
        except Exception:
            return None
        return bool(state.get("Running"))

    # -- close

    async def close(self) -> None:
        await in_thread(self.close_sync)

    def close_sync(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.backend.remove_container(self.container_id)
        if self._relay is not None:
            self._relay.close()
        if self._rundir is not None:
            shutil.rmtree(self._rundir.parent, ignore_errors=True)


def _short(exc: BaseException) -> str:
    text = getattr(exc, "explanation", None) or str(exc) or type(exc).__name__
    return re.sub(r"\s+", " ", str(text))[:300]


def _last(text: str) -> str:
    return _last_line(text)


# ---- the backend -----------------------------------------------------------------------------


class DockerBackend:
    """``SandboxBackend`` on the Docker engine; ``config_class`` is ``DockerConfig``."""

    name = "docker"
    config_class: ClassVar[type] = DockerConfig

    def __init__(self, config: DockerConfig | None = None) -> None:
        self.config = config or DockerConfig()
        self._api: Any = None
        self._cache: DockerCache | None = None
        self._reaped = False  # containers of dead runs are removed at the first start
        self._lock = threading.Lock()

    @property
    def api(self) -> Any:
        with self._lock:
            if self._api is None:
                self._api = connect(self.config)
            return self._api

    @property
    def cache(self) -> DockerCache:
        api = self.api
        with self._lock:
            if self._cache is None:
                self._cache = DockerCache(api, self.config)
            return self._cache

    def exec_socket(self, exec_id: str) -> tuple[socket.socket, bytes]:
        """Start an exec and return its hijacked stream socket plus bytes already read past the
        response headers. Over a unix socket we speak the HTTP upgrade ourselves, so no byte of
        a fast command's output can sit unseen in a client library's buffer."""
        host = docker_host(self.config)
        if host.startswith("unix://"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(host[len("unix://") :])
            body = b'{"Detach":false,"Tty":false}'
            version = self.api.api_version
            head = (
                f"POST /v{version}/exec/{exec_id}/start HTTP/1.1\r\nHost: docker\r\n"
                "Content-Type: application/json\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            sock.sendall(head + body)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    raise SandboxError("docker closed the exec stream before answering")
                data += chunk
            header, _, rest = data.partition(b"\r\n\r\n")
            status = header.split(b"\r\n", 1)[0]
            if b" 101 " not in status and b" 200 " not in status:
                raise SandboxError(f"docker exec start: {status.decode(errors='replace')}")
            return sock, rest
        raw = self.api.exec_start(exec_id, socket=True)
        return getattr(raw, "_sock", raw), b""

    def ensure_images(self, tasks: list[Any]) -> None:
        """Every prebuilt image the tasks name present, pulled when missing: a run's first
        check, so an image that is not here and cannot be pulled stops it in one line."""
        seen: set[str] = set()
        for task in tasks:
            if task.image and task.image not in seen:
                seen.add(task.image)
                image = plan(task, history=self.config.history)[0]
                self.cache._ensure_layer(image, task, Path("."), self.config.build)

    def helper_box(self, image: str, *, base_sha: str) -> DockerSandbox:
        """A fresh container of ``image`` (no network) for work the agent must not reach."""
        name = f"legorl-helper-{secrets.token_hex(6)}"
        host_config = self.api.create_host_config(
            network_mode="none", auto_remove=True, security_opt=["no-new-privileges"]
        )
        try:
            cid = self.api.create_container(
                image,
                command=["sleep", "900"],
                name=name,
                labels={LABEL: "1", "legorl.owner": owner_tag(), "legorl.image": image},
                host_config=host_config,
            )["Id"]
            self.api.start(cid)
        except Exception as exc:
            raise SandboxError(
                f"cannot start a helper container of {image}: {_short(exc)}"
            ) from None
        limits = Limits(wall_s=900)
        return DockerSandbox(
            self,
            cid,
            name,
            limits=limits,
            base_sha=base_sha,
            relay=None,
            rundir=None,
            runtime=False,
        )

    def remove_container(self, container_id: str) -> None:
        import docker.errors

        try:
            # v: with the container goes its anonymous volume (a grading sandbox's /testbed);
            # named ones (the harness runtime) stay.
            self.api.remove_container(container_id, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if exc.status_code != 409:  # 409: removal already in progress (auto-remove)
                raise SandboxError(
                    f"cannot remove container {container_id[:12]}: {_short(exc)}"
                ) from None

    def remove_containers(self, ids: list[str]) -> None:
        """Remove several at once: each removal waits for a kill, so do them side by side."""
        if not ids:
            return
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(ids))) as pool:
            for future in [pool.submit(self.remove_container, cid) for cid in ids]:
                with contextlib.suppress(SandboxError):
                    future.result()

    def reap_dead(self) -> list[str]:
        """Remove containers whose owning process is dead (once per backend, at first start)."""
        removed = []
        for c in self.api.containers(all=True, filters={"label": "legorl.owner"}):
            owner = (c.get("Labels") or {}).get("legorl.owner", "")
            if owner_alive(owner) is False:
                removed.append(c["Id"])
        self.remove_containers(removed)
        return removed

    async def start(
        self,
        task: Any,
        tasks_dir: str,
        *,
        run_id: str,
        proxy_url: str | None = None,
        limits: Limits | None = None,
        harness_runtime: bool = False,
        grading: bool = False,
    ) -> DockerSandbox:
        return await in_thread(
            self.start_sync,
            task,
            tasks_dir,
            run_id=run_id,
            proxy_url=proxy_url,
            limits=limits,
            harness_runtime=harness_runtime,
            grading=grading,
        )

    def start_sync(
        self,
        task: Any,
        tasks_dir: str | Path,
        *,
        run_id: str,
        proxy_url: str | None = None,
        limits: Limits | None = None,
        harness_runtime: bool = False,
        grading: bool = False,
    ) -> DockerSandbox:
        import docker.errors
        from docker.types import Mount

        limits = limits or Limits()
        cache = self.cache
        with self._lock:
            first, self._reaped = not self._reaped, True
        if first:
            self.reap_dead()
        reports = cache.ensure(task, Path(tasks_dir))
        tag = reports[-1].tag
        info = cache.image(tag)
        assert info is not None
        labels_img = (info.get("Config") or {}).get("Labels") or {}
        base_sha = labels_img.get("legorl.base_sha") or "HEAD"
        env_path = labels_img.get("legorl.env_path") or BASE_PATH
        env_vars = json.loads(labels_img.get("legorl.env_activation") or "{}")
        mounts = []
        if harness_runtime:
            base_tag = reports[0].tag
            for volume, target, _ in cache.runtime_volumes(base_tag=base_tag):
                mounts.append(Mount(target, volume, type="volume", read_only=True))
        name = f"legorl-{secrets.token_hex(6)}"
        relay = None
        rundir = None
        binds = None
        if proxy_url:
            split_proxy_url(proxy_url)  # a bad URL fails before anything starts
            rundir = state_root() / name / "run"
            rundir.mkdir(parents=True)
            write_owner(rundir.parent, run_id, task.instance_id)
            shutil.copy(FORWARDER, rundir / "forwarder.py")
            relay = open_relay(rundir / "proxy.sock", proxy_url)
            binds = {str(rundir): {"bind": RELAY_DIR, "mode": "ro"}}
        lockdown: dict[str, Any] = {"cap_drop": ["NET_RAW", "MKNOD", "AUDIT_WRITE"]}
        if grading:
            # The image's files read-only; /testbed a fresh anonymous volume (Docker copies
            # the image's repository into it; removed with the container); /tmp a tmpfs.
            mounts.append(Mount(WORKDIR, None, type="volume"))
            lockdown = {
                "read_only": True,
                "tmpfs": {"/tmp": f"rw,exec,nosuid,nodev,size={GRADING_TMP_MB}m,mode=1777"},
                "cap_drop": ["ALL"],
                "cap_add": list(GRADING_CAPS),
            }
        host_config = self.api.create_host_config(
            network_mode="none",
            init=True,
            auto_remove=True,
            mem_limit=f"{limits.memory_mb}m",
            memswap_limit=f"{limits.memory_mb}m",
            nano_cpus=int(limits.cpus * 1e9),
            pids_limit=limits.pids,
            binds=binds,
            mounts=mounts or None,
            security_opt=["no-new-privileges"],
            **lockdown,
        )
        labels = {
            LABEL: "1",
            "legorl.run": run_id,
            "legorl.owner": owner_tag(),
            "legorl.task": task.instance_id,
            "legorl.image": tag,
        }
        if grading:
            labels["legorl.grading"] = "1"
        cid = ""
        try:
            for attempt in (1, 2):
                try:
                    container = self.api.create_container(
                        tag,
                        command=["sleep", str(int(limits.wall_s) + 60)],
                        name=name if attempt == 1 else f"{name}-2",
                        labels=labels,
                        host_config=host_config,
                        working_dir=WORKDIR,
                    )
                    break
                except docker.errors.ImageNotFound:
                    # Removed behind our back (a gc elsewhere): forget it and build it again.
                    if attempt == 2:
                        raise
                    for report in reports:
                        cache.forget(report.tag)
                    cache.ensure(task, Path(tasks_dir))
            cid = container["Id"]
            self.api.start(cid)
        except Exception as exc:
            if cid:
                with contextlib.suppress(Exception):
                    self.remove_container(cid)
            if relay is not None:
                relay.close()
            if rundir is not None:
                shutil.rmtree(rundir.parent, ignore_errors=True)
            if isinstance(exc, SandboxError):
                raise
            raise SandboxError(
                f"{task.instance_id}: cannot start a container: {_short(exc)}"
            ) from None
        box = DockerSandbox(
            self,
            cid,
            name,
            limits=limits,
            base_sha=base_sha,
            relay=relay,
            rundir=rundir,
            runtime=harness_runtime,
            image=tag,
            env_path=env_path,
            env_vars=env_vars,
            grading=grading,
        )
        touch_usage(tag)
        if relay is not None:
            _, port, _ = split_proxy_url(proxy_url or "")
            ready = box.exec_sync(
                [
                    "python3",
                    f"{RELAY_DIR}/forwarder.py",
                    str(inside_port(port)),
                    f"{RELAY_DIR}/proxy.sock",
                    "--daemon",
                ],
                timeout=30,
            )
            if ready.exit_code != 0:
                box.close_sync()
                raise SandboxError(
                    f"{task.instance_id}: the proxy relay did not start: {_last(ready.output)}"
                )
        return box


def gc(
    config: DockerConfig | None = None,
    *,
    everything: bool = False,
    budget_gb: float | None = None,
    dry_run: bool = False,
) -> dict[str, list[str]]:
    """Remove legorl containers of dead processes (all with ``everything``), leftover build
    containers, dangling legorl images, runtime volumes unused for a week, and, with a budget,
    least-recently-used layers until the cache fits."""
    import docker.errors

    backend = DockerBackend(config)
    api = backend.api
    out: dict[str, list[str]] = {"containers": [], "images": [], "volumes": []}
    doomed = []
    for label in (LABEL, "legorl.build"):
        for c in api.containers(all=True, filters={"label": label}):
            owner = (c.get("Labels") or {}).get("legorl.owner", "")
            if everything or owner_alive(owner) is False:
                out["containers"].append(c["Names"][0].lstrip("/") if c.get("Names") else c["Id"])
                doomed.append(c["Id"])
    if not dry_run:
        backend.remove_containers(doomed)
    for img in api.images(filters={"dangling": True, "label": "legorl.layer"}):
        out["images"].append(img["Id"][:19])
        if not dry_run:
            with contextlib.suppress(docker.errors.APIError):
                api.remove_image(img["Id"])
    # Runtime volumes go when unused for a week (another checkout's or an older runtime), and
    # half-made ones when their builder is dead.
    week_ago = time.time() - 7 * 86400
    for vol in api.volumes(filters={"label": "legorl.layer"}).get("Volumes") or []:
        labels = vol.get("Labels") or {}
        partial = labels.get("legorl.layer") == "partial"
        if partial:
            doomed_volume = everything or owner_alive(labels.get("legorl.owner", "")) is False
        else:
            doomed_volume = everything or (last_used(vol["Name"]) or 0) < week_ago
        if not doomed_volume:
            continue
        if not dry_run:
            try:
                api.remove_volume(vol["Name"])
            except docker.errors.APIError:
                continue  # in use
        out["volumes"].append(vol["Name"])
    if budget_gb is not None and not dry_run:
        out["images"] += backend.cache.gc_budget(budget_gb)
    return out
