"""The layered image cache's recipes: base → env → instance, each tagged by a content hash.

    from legorl.sandbox.layers import plan
    base, env, instance = plan(task)          # Layer objects, nothing built
    instance.tag                              # 'legorl/instance:3f1c…', changes when any recipe below changes

A layer's key hashes its own recipe and its parent's key, so a changed recipe gives new tags
for that layer and the ones above it and leaves the ones below untouched. A task that names a
prebuilt ``image`` replaces base and env by that image (pulled when a registry is reachable);
with a ``source`` bundle the instance layer puts that repository at /testbed, without one it
locks the image's own repository down (``legorl.sandbox.images``). Pure data: the backends
build these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from legorl.protocols import SandboxError
from legorl.sandbox.common import WORKDIR, short_hash
from legorl.sandbox.images import SCRUB_VERSION

#: The Python each Debian suite ships as python3; an env layer picks its base by Python.
SUITE_PYTHON: dict[str, str] = {"bullseye": "3.9", "bookworm": "3.11", "trixie": "3.13"}
#: Debian packages of every base: Python, venv support for the env layer, git for the repo.
BASE_PACKAGES: tuple[str, ...] = ("python3", "python3-venv", "git", "patch", "ca-certificates")
#: Bump when the way a layer is built changes, so old tags stop matching.
RECIPE_VERSION = {"base": 1, "env": 1, "instance": 1, "runtime": 1}

HISTORIES = ("one-commit", "image")  # what an instance keeps of its repository's history
LEVELS = ("none", "base", "env", "instance")  # --cache-level, in order


@dataclass(frozen=True, slots=True)
class Layer:
    kind: str  # "base" | "env" | "instance" | "image" (a prebuilt image) | "runtime"
    name: str  # for people: "debian-bookworm", "legorl-toy/geometry@0.1", an instance id
    recipe: dict[str, Any] = field(hash=False, compare=False)
    parent: Layer | None = None

    @property
    def key(self) -> str:
        if self.kind == "image":
            return short_hash({"image": self.recipe["image"]})
        return short_hash(
            {
                "kind": self.kind,
                "v": RECIPE_VERSION[self.kind],
                "recipe": self.recipe,
                "parent": self.parent.key if self.parent else None,
            }
        )

    @property
    def tag(self) -> str:
        if self.kind == "image":
            return str(self.recipe["image"])
        return f"legorl/{self.kind}:{self.key}"

    def chain(self) -> list[Layer]:
        """This layer and its ancestors, bottom first."""
        out: list[Layer] = []
        layer: Layer | None = self
        while layer is not None:
            out.append(layer)
            layer = layer.parent
        return out[::-1]


def base_layer(python: str = "3.11") -> Layer:
    suites = [s for s, v in SUITE_PYTHON.items() if v == python]
    if not suites:
        known = ", ".join(f"{v} ({s})" for s, v in SUITE_PYTHON.items())
        raise SandboxError(f"no Debian base ships Python {python} (known: {known})")
    suite = suites[0]
    recipe = {
        "builder": "debootstrap",
        "suite": suite,
        "variant": "minbase",
        "include": sorted(BASE_PACKAGES),
        "python": python,
    }
    return Layer("base", f"debian-{suite}", recipe)


def env_layer(task: Any, parent: Layer) -> Layer:
    env = task.env
    recipe = {
        "python": env.python,
        "packages": list(env.packages),
        "setup": list(env.setup),
        "venv": "/opt/legorl-env",
    }
    return Layer("env", f"{task.repo}@{task.version}", recipe, parent)


def instance_layer(task: Any, parent: Layer, *, history: str = "one-commit") -> Layer:
    recipe = {
        "instance_id": task.instance_id,
        "repo": task.repo,
        "base_commit": task.base_commit,
        "workdir": WORKDIR,
        "history": history,
    }
    if parent.kind == "image" and not task.source:
        recipe["repo_from"] = "image"  # the image's own /testbed, scrubbed in place
        recipe["scrub"] = SCRUB_VERSION
    return Layer("instance", task.instance_id, recipe, parent)


def plan(task: Any, *, history: str = "one-commit") -> list[Layer]:
    """The layers a task's sandbox stands on, bottom first (base, env, instance or image,
    instance). ``history`` is ``one-commit`` (the lockdown) or, for the control that shows
    it matters, ``image``: an image's repository as the image has it."""
    if history not in HISTORIES:
        raise SandboxError(f"unknown history {history!r} (one of {', '.join(HISTORIES)})")
    if task.image:
        image = Layer("image", task.image, {"image": task.image})
        if history != "one-commit" and task.source:
            raise SandboxError(f"{task.instance_id}: history {history!r} needs the image's repo")
        return [image, instance_layer(task, image, history=history)]
    if not task.source:
        raise SandboxError(f"{task.instance_id}: the task names no source repository")
    if history != "one-commit":
        raise SandboxError(f"{task.instance_id}: history {history!r} needs a prebuilt image")
    if task.env is None:
        raise SandboxError(f"{task.instance_id}: the task names neither an image nor an env recipe")
    base = base_layer(task.env.python)
    env = env_layer(task, base)
    return [base, env, instance_layer(task, env)]


def keep_up_to(layers: list[Layer], level: str) -> list[Layer]:
    """The layers a ``--cache-level`` keeps: ``base`` keeps base, ``env`` base and env, …"""
    if level not in LEVELS:
        raise SandboxError(f"unknown cache level {level!r} (one of {', '.join(LEVELS)})")
    rank = LEVELS.index(level)
    order = {"base": 1, "image": 2, "env": 2, "instance": 3}
    return [layer for layer in layers if order[layer.kind] <= rank]
