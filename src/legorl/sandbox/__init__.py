"""Sandboxes for the agent stage, chosen by short name: ``docker`` and ``local`` (bubblewrap).

    from legorl.sandbox import make_backend
    backend = make_backend("docker")            # or "local"; options: DockerConfig / LocalConfig
    box = await backend.start(task, "fixtures/tasks", run_id="run-1",
                              proxy_url="http://127.0.0.1:8000/s/sess-1", harness_runtime=True)
    await box.exec("python -m pytest -q", timeout=300)
    patch = await box.diff()
    await box.close()

    legorl sandbox build --tasks fixtures/tasks/train.jsonl
    legorl sandbox exec legorl-toy__geometry-1 --tasks fixtures/tasks/train.jsonl -- python -m pytest -q

A sandbox is the task's repository at /testbed with one commit of history, no network except
the proxy it was given (``Sandbox.proxy_url`` is the address to use inside: the same path, so a
session's capability route passes through unchanged, and the proxy checks it), the
task's hidden tests nowhere inside, and CPU, memory, PIDs, wall time and output limited.
Importing this package imports neither the Docker SDK nor anything heavy.
"""

from __future__ import annotations

from typing import Any

from legorl.protocols import SandboxBackend, SandboxError
from legorl.registry import Registry
from legorl.sandbox.docker_backend import DockerBackend
from legorl.sandbox.docker_images import DockerConfig
from legorl.sandbox.local_backend import LocalBackend, LocalConfig

#: Backend classes by short name; each is built from its ``config_class``. (The Docker SDK is
#: imported only when a Docker backend first talks to the daemon.)
SANDBOXES: Registry[SandboxBackend] = Registry(
    "sandbox backend", {"docker": DockerBackend, "local": LocalBackend}
)


def make_backend(name: str, **config: Any) -> SandboxBackend:
    """Build the backend ``name`` (or ``module:Class``) from keyword ``config`` (its config
    dataclass's fields); unknown names and options are ``ConfigError``s."""
    return SANDBOXES.build(name, **config)


__all__ = [
    "SANDBOXES",
    "DockerBackend",
    "DockerConfig",
    "LocalBackend",
    "LocalConfig",
    "SandboxError",
    "make_backend",
]
