"""mini-swe-agent (PyPI ``mini-swe-agent``), unmodified, against a proxy session through litellm.

    legorl rollout --tasks tasks.jsonl --harness mini-swe-agent --model fixtures/models/tiny-qwen3 …

Not to be confused with ``mini``, legorl's own built-in agent (`mini_agent.py`): this is the
mini-swe-agent project's ``mini`` command, run from its own venv (``.venv-miniswe``, Python 3.12,
carried into sandboxes by the harness-runtime layer at ``/opt/legorl-runtime/miniswe``).

It is configured only through its own config files and environment: its stock ``mini.yaml``
merged with a file that names a litellm ``openai/<model>`` model whose ``api_base`` is the
session's route, turns cost tracking off (the model has no price) and sets the step limit; the
run is ``--yolo --exit-immediately``. Its exit status (``Submitted``, ``LimitsExceeded``, an API
error's class name, …) is read from the trajectory file it writes. Its traffic is OpenAI Chat,
not streamed, one call per step with one ``bash`` tool; no auxiliary calls, no model listing.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import ClassVar

from legorl.harnesses import SCRATCH, _classify_limits, _env, _run_record, default_venv_python
from legorl.protocols import ApiShape, ExecResult, HarnessRun, Requirement, Sandbox

TRAJECTORY = f"{SCRATCH}/miniswe.traj.json"
TRAJECTORY_LIMIT = 64 << 20  # bytes of its trajectory file read back
RUNTIME_PYTHON = "/opt/legorl-runtime/miniswe/bin/python"
#: Exit statuses that mean the proxy (the "model provider") failed, not the agent.
_PROVIDER_ERRORS = ("APIConnectionError", "InternalServerError", "ServiceUnavailableError")


def classify(result: ExecResult, trajectory: bytes | None) -> str:
    """ok / agent_error / proxy_error / harness_crash from the trajectory mini-swe-agent wrote."""
    status = _classify_limits(result)
    if status is not None:
        return status
    try:
        info = json.loads(trajectory or b"{}").get("info") or {}
    except (json.JSONDecodeError, AttributeError):
        info = {}
    exit_status = str(info.get("exit_status") or "")
    if not exit_status:
        return "harness_crash"
    if exit_status == "Submitted" and result.exit_code == 0:
        return "ok"
    if any(name in exit_status for name in _PROVIDER_ERRORS):
        return "proxy_error"
    return "agent_error"  # LimitsExceeded, RepeatedFormatError, TimeExceeded, …


@dataclass(slots=True, kw_only=True)
class MiniSweAgentHarness:
    """mini-swe-agent's ``mini`` command (its stock config), litellm pointed at the proxy."""

    name: ClassVar[str] = "mini-swe-agent"
    api: ClassVar[ApiShape] = "openai_chat"
    streams: ClassVar[bool] = False
    requires: ClassVar[Requirement] = Requirement(
        python="miniswe",
        module="minisweagent",
        install=(
            "python3.12 -m venv .venv-miniswe && .venv-miniswe/bin/pip install "
            "mini-swe-agent==2.4.6 (or set LEGORL_MINISWE_PYTHON)"
        ),
    )
    needs_runtime: ClassVar[bool] = True  # its venv comes from the sandbox's runtime layer
    step_limit: int = 30

    async def run(self, sandbox: Sandbox, prompt: str, *, model: str, timeout: float) -> HarnessRun:
        started = time.monotonic()
        if sandbox.proxy_url is None:
            raise ValueError("the mini-swe-agent harness needs a sandbox started with a proxy_url")
        config = {
            "model": {
                "model_name": f"openai/{model}",
                "cost_tracking": "ignore_errors",
                "model_kwargs": {"api_base": f"{sandbox.proxy_url}/v1", "api_key": "sk-legorl"},
            },
            "agent": {"step_limit": self.step_limit, "cost_limit": 0},
        }
        await sandbox.write_file(f"{SCRATCH}/miniswe.yaml", json.dumps(config).encode())
        await sandbox.write_file(f"{SCRATCH}/home/.keep", b"")
        # The runtime layer is attached exactly when the sandbox names its OpenHands Python;
        # both venvs live in it, on its one Python 3.12.
        python = RUNTIME_PYTHON if sandbox.openhands_python else default_venv_python("miniswe")
        cmd = [
            python,
            "-m",
            "minisweagent.run.mini",
            "-c",
            "mini.yaml",
            "-c",
            f"{SCRATCH}/miniswe.yaml",
            "--yolo",
            "--exit-immediately",
            "-t",
            prompt,
            "-o",
            TRAJECTORY,
        ]
        env = _env(
            sandbox,
            {
                "MSWEA_CONFIGURED": "true",
                "MSWEA_SILENT_STARTUP": "1",
                "MSWEA_COST_TRACKING": "ignore_errors",
                "MSWEA_GLOBAL_CONFIG_DIR": f"{SCRATCH}/home/mini-swe-agent",
            },
        )
        result = await sandbox.exec(cmd, timeout=timeout, cwd=sandbox.workdir, env=env)
        try:
            trajectory: bytes | None = await sandbox.read_file(TRAJECTORY, limit=TRAJECTORY_LIMIT)
        except Exception:  # no trajectory: it never got far enough to write one
            trajectory = None
        return _run_record(result, classify(result, trajectory), started)
