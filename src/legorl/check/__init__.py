"""Preflight checks for a run (`legorl check`): each check is a function that returns
``CheckResult``s (name, status, reason, fix) instead of raising, so a run learns every problem at
once, before it spends hours.

    legorl check --config run.yaml --dry-run
    legorl check --model fixtures/models/tiny-qwen3 --engine forced \\
        --tasks fixtures/tasks/train.jsonl --harness mini --sandbox local

    from legorl.check import RunConfig, run_checks
    results = run_checks(RunConfig(model="fixtures/models/tiny-qwen3", engine="forced"))

The checks, in order (a check whose prerequisite failed is reported as ``skip``):

* ``model``: the folder has a config, a tokenizer, a chat template and readable weights.
* ``template``: a conversation with tool calls renders, tokenises, decodes and parses back into
  the same calls and text (the proxy's own parser), and renders are prefix-stable.
* ``vllm`` (engine vllm): the server at ``base_url`` answers and says whether it reloads
  weights; or, when legorl launches it, a Python with vLLM is there and can serve the model.
* ``engine``: the engine loads the model and samples a few tokens with finite log-probs.
* ``proxy: API``: an in-process proxy answers each API shape the configured harnesses speak
  (OpenAI Chat, Anthropic Messages, Responses), streaming where the harness streams, and
  records the Turn.
* ``fidelity`` (``dry_run``): a two-sample rollout from the engine through `legorl train
  --dry-run` with the trainer's model; its rollout/trainer Pearson of probabilities on the loss
  tokens must be >= 0.99.
* ``tasks``: the task file loads and every repository bundle it names exists.
* ``harness: NAME``: the harness is installed (binary on PATH, the OpenHands SDK venv).
* ``sandbox``: the backend works here: bubblewrap starts a sandbox (``local``); the Docker daemon
  answers, the configured images are present, and each task's layers (``legorl.sandbox.layers``)
  are built or buildable (``docker``).
* ``disk``: free space where the run writes is at least the budget.

The run configuration (``RunConfig``) comes from a YAML or JSON file and/or flags; see
``load_config``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from legorl.check.config import RunConfig, config_from_dict, load_config
from legorl.check.engine import _close, check_engine, check_fidelity, check_proxy, check_vllm
from legorl.check.environment import (
    check_disk,
    check_docker,
    check_harness,
    check_sandbox,
    check_tasks,
)
from legorl.check.model import check_model, check_template
from legorl.check.results import CheckResult, _skip
from legorl.protocols import ConfigError

# --------------------------------------------------------------------------------------------
# All together
# --------------------------------------------------------------------------------------------


def run_checks(
    config: RunConfig,
    *,
    dry_run: bool = False,
    on_result: Callable[[CheckResult], None] | None = None,
) -> list[CheckResult]:
    """Every check in order; ``on_result`` sees each result as it is known."""
    results: list[CheckResult] = []

    def add(*new: CheckResult) -> None:
        for r in new:
            results.append(r)
            if on_result is not None:
                on_result(r)

    model = check_model(config.model)
    add(model)
    template = check_template(config.model) if model.ok and config.model else None
    add(template or _skip("template", "needs the model"))
    if model.ok:
        asyncio.run(_engine_checks(config, dry_run, add))
    else:
        add(_skip("engine", "needs the model"))
        add(_skip("proxy", "needs the model"))
        if dry_run:
            add(_skip("fidelity", "needs the model"))
    add(check_tasks(config.tasks, config.task_format))
    for harness in config.harnesses:
        add(check_harness(harness, config.sandbox))
    add(
        check_sandbox(
            config.sandbox,
            docker_host=config.docker_host,
            images=config.images,
            tasks=config.tasks,
            task_format=config.task_format,
        )
    )
    add(check_disk(config.workdir, config.disk_budget_gb))
    return results


async def _engine_checks(config: RunConfig, dry_run: bool, add: Callable[..., None]) -> None:
    if config.engine == "vllm":
        row = check_vllm(config)
        add(row)
        if not row.ok:
            add(_skip("engine", "needs vllm"))
            add(_skip("proxy", "needs the engine"))
            if dry_run:
                add(_skip("fidelity", "needs the engine"))
            return
    result, engine = await check_engine(config)
    add(result)
    if engine is None:
        add(_skip("proxy", "needs the engine"))
        if dry_run:
            add(_skip("fidelity", "needs the engine"))
        return
    try:
        add(*await check_proxy(config, engine))
        if dry_run:
            add(await check_fidelity(config, engine))
    finally:
        await _close(engine)


__all__ = [
    "CheckResult",
    "ConfigError",
    "RunConfig",
    "check_disk",
    "check_docker",
    "check_engine",
    "check_fidelity",
    "check_harness",
    "check_model",
    "check_proxy",
    "check_sandbox",
    "check_tasks",
    "check_template",
    "check_vllm",
    "config_from_dict",
    "load_config",
    "run_checks",
]
