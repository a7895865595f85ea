"""A test double that ships in the package but is not registered: named by its import path,

    legorl rollout --harness legorl.harnesses.testing:ScriptedHarness --harness-opt command=…

it runs one shell command in the sandbox as the "agent" (exit 0 → ok; a hang → timeout;
anything else → harness_crash). The command finds its session's route in ``$LEGORL_PROXY_URL``.
With ``raise_if_env=NAME`` it raises instead of running, in a process whose environment has
``NAME`` (a fault injected into one node of a cluster, whose processes alone were given it).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import ClassVar

from legorl.harnesses import _classify_limits, _env, _run_record
from legorl.protocols import ApiShape, HarnessRun, Requirement, Sandbox

#: How tests name it.
SCRIPTED = "legorl.harnesses.testing:ScriptedHarness"


@dataclass(slots=True, kw_only=True)
class ScriptedHarness:
    """One shell command as the agent (a fake: no model decides anything)."""

    name: ClassVar[str] = "scripted"
    api: ClassVar[ApiShape] = "openai_chat"
    streams: ClassVar[bool] = False
    requires: ClassVar[Requirement] = Requirement(binary="sh", install="install a POSIX shell")
    needs_runtime: ClassVar[bool] = False
    command: str = "true"
    raise_if_env: str = ""

    async def run(self, sandbox: Sandbox, prompt: str, *, model: str, timeout: float) -> HarnessRun:
        started = time.monotonic()
        if self.raise_if_env and self.raise_if_env in os.environ:
            raise RuntimeError(f"scripted fault: ${self.raise_if_env} is set here")
        url = {"LEGORL_PROXY_URL": sandbox.proxy_url} if sandbox.proxy_url else {}
        result = await sandbox.exec(
            ["sh", "-c", self.command], timeout=timeout, cwd=sandbox.workdir, env=_env(sandbox, url)
        )
        status = _classify_limits(result) or ("ok" if result.exit_code == 0 else "harness_crash")
        return _run_record(result, status, started)
