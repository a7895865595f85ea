"""The Docker image cache (``DockerCache``) and the client that talks to the daemon.

A task's image is built in layers: ``legorl/base:<key>`` (Debian from ``debootstrap`` +
``docker import``, since no registry is reachable here), ``legorl/env:<key>`` (a venv at
/opt/legorl-env with the task's packages and setup steps), ``legorl/instance:<key>`` (the
repository at /testbed with one commit of history). A task naming a prebuilt image (SWE-bench's
``sweb.eval.x86_64.<id>``) stands on it, pulled when missing; its instance layer locks the
image's own /testbed down to one commit (``images.py``) and puts the image's Python env first
on PATH. The containers that run on these images are ``docker_backend.py``'s.
"""

import contextlib
import io
import json
import os
import re
import secrets
import shutil
import subprocess
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from legorl.protocols import SandboxError
from legorl.sandbox.common import (
    BASE_PATH,
    RUNTIME_DIR,
    WORKDIR,
    BuildError,
    DaemonDownError,
    ImageMissingError,
    build_lock,
    cache_root,
    last_used,
    owner_tag,
    touch_usage,
)
from legorl.sandbox.images import activation, missing_message, probe_script, scrub_script
from legorl.sandbox.layers import Layer, keep_up_to, plan
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
#: The label on every container a sandbox runs (the image cache keeps the images they use).
LABEL = "legorl.sandbox"


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


def last_line(text: str) -> str:
    for line in reversed(text.rstrip().splitlines()):
        if line.strip():
            return line.strip()[:300]
    return "(no output)"


def _step_failed(
    layer: Layer, at: tuple[int, int], name: str, code: int, text: str, log_path: Path
) -> BuildError:
    return BuildError(
        f"{layer.kind} layer {layer.tag} ({layer.name}) failed at step {at[0]}/{at[1]} "
        f"`{name}` (exit {code}): {last_line(text)} (log: {log_path})",
        step=name,
        log_tail=_tail(text),
        log_path=str(log_path),
    )


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
            raise _step_failed(
                layer, (i, n), name, proc.returncode, log_path.read_text(errors="replace"), log_path
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
                raise _step_failed(layer, (i, n), name, code, text, log_path)

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
                f"{what} failed at step `{step}` (exit {code}): {last_line(text)} (log: {log})",
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
