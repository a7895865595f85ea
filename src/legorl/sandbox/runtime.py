"""The harness-runtime layer: Node, the npm harnesses (Claude Code, OpenCode, Codex CLI, Gemini
CLI, Qwen Code), the OpenHands SDK and mini-swe-agent venvs (both on one Python 3.12) and
legorl's built-in agent, shared by every
sandbox at ``/opt/legorl-runtime``.

    legorl sandbox build --tasks fixtures/tasks/train.jsonl --runtime

Layout inside a sandbox (the same for both backends)::

    /opt/legorl-runtime/bin/{node,claude,opencode,…}  executables
    /opt/legorl-runtime/lib/node_modules/…           the npm packages they come from
    /opt/legorl-runtime/python/                       the Python 3.12 the venv runs on
    /opt/legorl-runtime/openhands/bin/python          the OpenHands SDK venv
    /opt/legorl-runtime/miniswe/bin/python            the mini-swe-agent venv
    /opt/legorl-runtime/agent/*.py                    built-in agent and harness drivers
    /opt/legorl-runtime/manifest.json                 versions (the layer's recipe)

The layer is made from what is installed on this host (no registry is reachable from a
sandbox): ``node`` on PATH and its global npm packages, the OpenHands venv named by
``$LEGORL_OPENHANDS_PYTHON`` or found at ``.venv-openhands/`` in the repository root (the same
for mini-swe-agent: ``$LEGORL_MINISWE_PYTHON``, ``.venv-miniswe/``, made on the same Python), and
``legorl/harnesses/*.py``. Its key hashes their versions, not their bytes, so checking it is
quick. For Docker the files are copied into a named volume once and mounted read-only into
instance containers (never rebuilt into them); the copied Python gets a relative RUNPATH so it
runs from its new place. The host's binaries must suit the base image's C library (here both
are Debian 12). For the local backend the same layout is a folder of symlinks to the host's
files, which the sandbox sees read-only.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import legorl
from legorl.sandbox.common import RUNTIME_DIR
from legorl.sandbox.layers import Layer

#: The npm harnesses' executables, by the package that brings each.
NPM_BINARIES = {
    "claude": "@anthropic-ai/claude-code",
    "opencode": "opencode-ai",
    "codex": "@openai/codex",
    "gemini": "@google/gemini-cli",
    "qwen": "@qwen-code/qwen-code",
}
NPM_PACKAGES = tuple(NPM_BINARIES.values())
#: Harness venvs, by the folder they get in the layout; all run on the OpenHands venv's Python.
VENVS = ("openhands", "miniswe")
_SKIP_PY = ("lib/python3.12/test/", "lib/python3.12/idlelib/", "lib/python3.12/tkinter/")


@dataclass(slots=True, kw_only=True)
class RuntimeSources:
    """Where the runtime's parts are on this host (None: not installed)."""

    node: Path | None = None
    npm_root: Path | None = None
    openhands_venv: Path | None = None
    miniswe_venv: Path | None = None
    agent_dir: Path | None = None

    @classmethod
    def find(cls) -> RuntimeSources:
        node = shutil.which("node")
        node_path = Path(node).resolve() if node else None
        npm_root = Path(os.environ["LEGORL_NPM_ROOT"]) if "LEGORL_NPM_ROOT" in os.environ else None
        if npm_root is None and node_path is not None:
            # Where NodeSource's node keeps global packages; Debian's npm uses /usr/local.
            guess = node_path.parent.parent / "lib" / "node_modules"
            if any((guess / name / "package.json").is_file() for name in NPM_PACKAGES):
                npm_root = guess
        if npm_root is None and shutil.which("npm"):
            out = subprocess.run(["npm", "root", "-g"], capture_output=True, text=True, timeout=60)
            npm_root = Path(out.stdout.strip()) if out.returncode == 0 else None
        agent = Path(legorl.__file__).resolve().parent / "harnesses"
        return cls(
            node=node_path,
            npm_root=npm_root,
            openhands_venv=_find_venv("openhands"),
            miniswe_venv=_find_venv("miniswe"),
            agent_dir=agent if agent.is_dir() else None,
        )

    def venv(self, name: str) -> Path | None:
        return self.openhands_venv if name == "openhands" else self.miniswe_venv

    def package(self, name: str) -> Path | None:
        if self.npm_root is None:
            return None
        path = self.npm_root / name
        # Resolved: an npm root may be a folder of links to packages installed elsewhere.
        return path.resolve() if (path / "package.json").is_file() else None

    def venv_home(self) -> Path | None:
        """The Python prefix the harness venvs run on (the OpenHands venv's, else the first
        venv found: a host may have one harness venv and not the other)."""
        venv = self.openhands_venv or self.miniswe_venv
        if venv is None:
            return None
        cfg = _pyvenv_cfg(venv)
        home = cfg.get("home")
        return Path(home).parent if home else None


def _find_venv(name: str) -> Path | None:
    py = os.environ.get(f"LEGORL_{name.upper()}_PYTHON")
    candidates = [Path(py).parent.parent] if py else []
    repo_root = Path(legorl.__file__).resolve().parents[2]
    candidates += [repo_root / f".venv-{name}", Path.cwd() / f".venv-{name}"]
    for cand in candidates:
        if (cand / "pyvenv.cfg").is_file():
            return cand.absolute()
    return None


def _pyvenv_cfg(venv: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (venv / "pyvenv.cfg").read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


def manifest(src: RuntimeSources) -> dict[str, Any]:
    """Versions of every part: the runtime layer's recipe (missing parts are null)."""
    node_version = None
    if src.node is not None:
        out = subprocess.run([str(src.node), "--version"], capture_output=True, text=True)
        node_version = out.stdout.strip() or None
    packages: dict[str, str | None] = {}
    for name in NPM_PACKAGES:
        pkg = src.package(name)
        packages[name] = json.loads((pkg / "package.json").read_text())["version"] if pkg else None
    venvs: dict[str, dict[str, Any] | None] = {}
    for name in VENVS:
        venv = src.venv(name)
        venvs[name] = None
        if venv is not None:
            cfg = _pyvenv_cfg(venv)
            dists = sorted(p.name for p in (venv / "lib").glob("python*/site-packages/*.dist-info"))
            venvs[name] = {"python": cfg.get("version"), "dists": dists}
    agent = None
    if src.agent_dir is not None:
        agent = {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest()[:16]
            for p in sorted(src.agent_dir.glob("*.py"))
        }
    return {"node": node_version, "npm": packages, **venvs, "agent": agent}


def runtime_layer(src: RuntimeSources | None = None) -> Layer:
    """The whole runtime (for the local backend, whose layout is made in an instant)."""
    src = src or RuntimeSources.find()
    return Layer("runtime", "harness-runtime", manifest(src))


def split_layers(src: RuntimeSources | None = None) -> tuple[Layer, Layer]:
    """(tools, agent): the heavy part (Node, npm harnesses, OpenHands) and the few agent files,
    kept apart so editing the agent rebuilds a kilobyte volume, not a gigabyte one."""
    src = src or RuntimeSources.find()
    recipe = manifest(src)
    agent = recipe.pop("agent")
    return Layer("runtime", "harness-runtime", recipe), Layer("runtime", "agent", {"agent": agent})


def missing_parts(recipe: dict[str, Any]) -> list[str]:
    """Every part of the full runtime this host lacks (a layer is built without them; only a
    harness that needs one fails, at preflight: ``harness_preflight``)."""
    if set(recipe) == {"agent"}:
        return [] if recipe["agent"] else ["built-in agent"]
    missing = [] if recipe.get("node") else ["node"]
    missing += [name for name, version in recipe.get("npm", {}).items() if not version]
    missing += [f"{name} venv" for name in VENVS if not recipe.get(name)]
    missing += [] if recipe.get("agent", True) else ["built-in agent"]
    return missing


def parts_for(requirement: Any) -> list[str]:
    """The runtime parts a harness with this ``Requirement`` runs from, named as
    ``missing_parts`` names them: [] for a harness that brings itself (the built-in agent)."""
    if requirement.binary in NPM_BINARIES:
        return ["node", NPM_BINARIES[requirement.binary]]
    if requirement.python in VENVS:
        return [f"{requirement.python} venv"]
    return []


def present_parts(recipe: dict[str, Any]) -> set[str]:
    """The parts a runtime recipe (``manifest``) has."""
    have = {"node"} if recipe.get("node") else set()
    have |= {name for name, version in (recipe.get("npm") or {}).items() if version}
    return have | {f"{name} venv" for name in VENVS if recipe.get(name)}


def check_command(recipe: dict[str, Any]) -> str:
    """The shell line that runs each part the layer has (``--version``, an import), so a built
    volume is checked for what it carries and nothing it was never given."""
    have = present_parts(recipe)
    # a `#!/usr/bin/env node` script (qwen) needs the runtime's node on PATH
    steps = [f"export PATH={RUNTIME_DIR}/bin:$PATH"]
    if "node" in have:
        steps.append(f"{RUNTIME_DIR}/bin/node --version")
    steps += [
        f"{RUNTIME_DIR}/bin/{exe} --version"
        for exe in ("claude", "opencode", "qwen")
        if NPM_BINARIES[exe] in have and "node" in have
    ]
    modules = {"openhands": "openhands.sdk", "miniswe": "minisweagent"}
    steps += [
        f"{RUNTIME_DIR}/{name}/bin/python -c 'import {modules[name]}'"
        for name in VENVS
        if f"{name} venv" in have
    ]
    return " && ".join(steps)


class PreflightError(RuntimeError):
    """A harness cannot run where it must: one line naming the harness, the node and the fix."""


def node_name() -> str:
    import socket

    return socket.gethostname()


def harness_preflight(
    harness: Any, sandbox: str, *, node: str | None = None, src: RuntimeSources | None = None
) -> None:
    """Raise ``PreflightError`` unless ``harness`` (an instance or class) can run in a
    ``sandbox`` ("docker" | "local") sandbox on this host, before any sandbox starts: a harness
    that runs from the runtime layer needs its parts installed here (the layer is made from
    this host's installs, for either backend); one that runs from the sandbox's own tools
    under the local backend needs its executable on this host's PATH."""
    need = harness.requires
    where = node or node_name()
    fix = f"install: {need.install}"
    if harness.needs_runtime:
        parts = parts_for(need)
        if not parts:
            return
        have = present_parts(manifest(src or RuntimeSources.find()))
        missing = [p for p in parts if p not in have]
        if missing:
            raise PreflightError(
                f"harness {harness.name} is not installed on node {where} "
                f"(missing {', '.join(missing)}); {fix}"
            )
    elif sandbox == "local" and need.binary and shutil.which(need.binary) is None:
        raise PreflightError(
            f"harness {harness.name} is not installed on node {where} "
            f"({need.binary} is not on PATH); {fix}"
        )


# ---- Docker: one tar of the whole layout ---------------------------------------------------


def _relocate_runpath(data: bytes, old_lib: str, file_dir_in_prefix: str) -> bytes:
    """Point an ELF's absolute RUNPATH at the same folder relative to ``$ORIGIN`` (same length
    or shorter, NUL-padded), so a copied Python finds its libpython in its new place."""
    needle = b"\0" + old_lib.encode() + b"\0"
    if needle not in data:
        return data
    rel = os.path.relpath("lib", file_dir_in_prefix)
    new = ("$ORIGIN" if rel == "." else f"$ORIGIN/{rel}").encode()
    if len(new) > len(old_lib):
        return data
    padded = b"\0" + new + b"\0" * (len(old_lib) - len(new) + 1)
    return data.replace(needle, padded)


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    tar.addfile(info, io.BytesIO(data))


def _add_symlink(tar: tarfile.TarFile, name: str, target: str) -> None:
    info = tarfile.TarInfo(name)
    info.type = tarfile.SYMTYPE
    info.linkname = target
    info.mode = 0o777
    tar.addfile(info)


def write_agent_tar(src: RuntimeSources, out: Any) -> None:
    """The agent files as a tar whose top folder is ``agent/``."""
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.GNU_FORMAT) as tar:
        if src.agent_dir is not None:
            for path in sorted(src.agent_dir.glob("*.py")):
                tar.add(path, f"agent/{path.name}")


def write_tar(src: RuntimeSources, out: Any, recipe: dict[str, Any]) -> None:
    """Write the tools' layout as a tar whose top folder is ``legorl-runtime/`` (extract at
    /opt); ``agent/`` is left empty, a mount point for the agent volume."""
    top = "legorl-runtime"
    root = f"{RUNTIME_DIR}"
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.GNU_FORMAT) as tar:
        agent_dir = tarfile.TarInfo(f"{top}/agent")
        agent_dir.type, agent_dir.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(agent_dir)
        if src.node is not None:
            tar.add(src.node, f"{top}/bin/node")
        for name in NPM_PACKAGES:
            pkg = src.package(name)
            if pkg is None:
                continue
            tar.add(pkg, f"{top}/lib/node_modules/{name}")
            bins = json.loads((pkg / "package.json").read_text()).get("bin") or {}
            if isinstance(bins, str):
                bins = {name.rsplit("/", 1)[-1]: bins}
            for exe, rel in bins.items():
                target = os.path.normpath(f"../lib/node_modules/{name}/{rel}")
                _add_symlink(tar, f"{top}/bin/{exe}", target)
        home = src.venv_home()
        if home is not None:
            _add_python(tar, home, f"{top}/python")
            for name in VENVS:
                venv = src.venv(name)
                if venv is not None and _pyvenv_cfg(venv).get("home") == f"{home}/bin":
                    _add_venv(tar, venv, f"{top}/{name}", home, root)
        _add_bytes(tar, f"{top}/manifest.json", json.dumps(recipe, indent=2).encode())


def _add_python(tar: tarfile.TarFile, home: Path, dest: str) -> None:
    old_lib = f"{home}/lib"
    for dirpath, dirnames, filenames in os.walk(home):
        rel_dir = os.path.relpath(dirpath, home)
        rel_dir = "" if rel_dir == "." else rel_dir
        if any(f"{rel_dir}/".startswith(skip) for skip in _SKIP_PY):
            dirnames[:] = []
            continue
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if path.is_dir() and not path.is_symlink():
                tar.add(path, f"{dest}/{rel}", recursive=False)
                continue
            if path.is_file() and not path.is_symlink():
                with open(path, "rb") as fh:
                    is_elf = fh.read(4) == b"\x7fELF"
                if is_elf:
                    data = _relocate_runpath(path.read_bytes(), old_lib, rel_dir or ".")
                    info = tar.gettarinfo(str(path), f"{dest}/{rel}")
                    info.type, info.linkname, info.size = tarfile.REGTYPE, "", len(data)
                    tar.addfile(info, io.BytesIO(data))
                    continue
            tar.add(path, f"{dest}/{rel}", recursive=False)


def _add_venv(tar: tarfile.TarFile, venv: Path, dest: str, home: Path, root: str) -> None:
    cfg = _pyvenv_cfg(venv)
    version = cfg.get("version", "3.12")
    major_minor = ".".join(version.split(".")[:2])
    old_shebang = f"#!{venv}/bin/python".encode()
    new_shebang = f"#!{root}/{dest.rsplit('/', 1)[-1]}/bin/python".encode()
    for dirpath, dirnames, filenames in os.walk(venv):
        rel_dir = os.path.relpath(dirpath, venv)
        rel_dir = "" if rel_dir == "." else rel_dir
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if rel == "pyvenv.cfg":
                text = (
                    f"home = {root}/python/bin\ninclude-system-site-packages = false\n"
                    f"version = {version}\nexecutable = {root}/python/bin/python{major_minor}\n"
                )
                _add_bytes(tar, f"{dest}/{rel}", text.encode())
            elif rel_dir == "bin" and name.startswith("python"):
                _add_symlink(tar, f"{dest}/{rel}", f"../../python/bin/python{major_minor}")
            elif rel_dir == "bin" and path.is_file() and not path.is_symlink():
                data = path.read_bytes()
                if data.startswith(old_shebang):
                    data = new_shebang + data[len(old_shebang) :]
                info = tar.gettarinfo(str(path), f"{dest}/{rel}")
                info.type, info.linkname, info.size = tarfile.REGTYPE, "", len(data)
                tar.addfile(info, io.BytesIO(data))
            elif path.is_dir() and not path.is_symlink():
                tar.add(path, f"{dest}/{rel}", recursive=False)
            else:
                tar.add(path, f"{dest}/{rel}", recursive=False)


# ---- local: a folder of symlinks, plus the host paths the sandbox must see -----------------


def local_layout(src: RuntimeSources, dest: Path, recipe: dict[str, Any]) -> list[Path]:
    """Fill ``dest`` with the layout as symlinks to host files; returns host paths to bind."""
    binds: list[Path] = []
    (dest / "bin").mkdir(parents=True, exist_ok=True)
    (dest / "lib" / "node_modules").mkdir(parents=True, exist_ok=True)
    if src.node is not None:
        (dest / "bin" / "node").symlink_to(src.node)
        binds.append(src.node.parent)
    for name in NPM_PACKAGES:
        pkg = src.package(name)
        if pkg is None:
            continue
        link = dest / "lib" / "node_modules" / name
        link.parent.mkdir(exist_ok=True)  # a scope folder such as @openai/
        link.symlink_to(pkg)
        binds.append(pkg)
        bins = json.loads((pkg / "package.json").read_text()).get("bin") or {}
        if isinstance(bins, str):
            bins = {name.rsplit("/", 1)[-1]: bins}
        for exe, rel in bins.items():
            (dest / "bin" / exe).symlink_to(os.path.normpath(pkg / rel))
    home = src.venv_home()
    if home is not None:
        (dest / "python").symlink_to(home)
        binds.append(home)
        for name in VENVS:
            venv = src.venv(name)
            if venv is not None:
                (dest / name).symlink_to(venv)
                binds.append(venv)
    if src.agent_dir is not None:
        (dest / "agent").mkdir()
        for path in sorted(src.agent_dir.glob("*.py")):
            shutil.copy2(path, dest / "agent" / path.name)
    (dest / "manifest.json").write_text(json.dumps(recipe, indent=2))
    return binds
