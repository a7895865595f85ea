"""The trainer's one config: a typed dataclass whose defaults live in the class, filled from a
YAML file and ``key=value`` overrides, validated, unknown keys rejected with the key named.

    legorl train samples.jsonl --model M --out ckpt --config run.yaml lr=3e-6 correction=tis

Precedence: class defaults < YAML file < ``key=value`` overrides < explicit flags (``--steps``).
The resolved config is written beside the checkpoint as ``train_config.yaml``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from legorl.protocols import ConfigError

Algorithm = Literal["gspo", "grpo", "drgrpo"]
AdvantageMode = Literal["auto", "grpo", "drgrpo", "sample"]
Correction = Literal["none", "tis", "token_mask", "seq_mask"]
Precision = Literal["fp32", "bf16"]
Attention = Literal["varlen_sdpa", "sdpa", "eager", "flash_attention_2"]
RouterReplayMode = Literal["off", "r3"]
MissingRouting = Literal["refuse", "mask"]


@dataclass(kw_only=True)
class TrainConfig:
    # --- objective --------------------------------------------------------------------------
    algorithm: Algorithm = "gspo"
    # auto: GRPO's (r - mean) / std for gspo and grpo, Dr.GRPO's r - mean for drgrpo;
    # sample: use Sample.advantage as given (every sample must carry one)
    advantage: AdvantageMode = "auto"
    adv_eps: float = 1e-6  # std guard: A = (r - mean) / (std + adv_eps)
    # group advantages below 0 are multiplied by this: 1 = the algorithm's own, 0 = only the
    # group's better-than-average episodes are pushed up (nothing is pushed down)
    negative_advantage_scale: float = 1.0
    gspo_clip_low: float = 3e-4  # sequence ratio clipped to [1 - low, 1 + high]
    gspo_clip_high: float = 4e-4
    ppo_clip_low: float = 0.2  # token ratio clip for grpo and drgrpo
    ppo_clip_high: float = 0.2
    # Dr.GRPO divides each episode's token sum by this constant; 0: the longest episode's loss
    # tokens in the step
    drgrpo_norm_tokens: int = 0
    kl_coef: float = 0.0  # k3 KL(π_θ ‖ π_ref) per token; off by default
    ref_model: str = ""  # reference for the KL term; "" = the model the call starts from
    entropy_coef: float = 0.0  # entropy bonus; off by default
    temperature: float = 1.0  # log-probs are log_softmax(logits / T), as the rollout sampled
    # --- rollout / trainer mismatch ---------------------------------------------------------
    correction: Correction = "tis"
    tis_cap: float = 2.0  # token TIS: weight min(π_old / μ, cap)
    token_mask_low: float = 0.5  # token mask: keep tokens with π_old / μ in [low, high]
    token_mask_high: float = 2.0
    seq_mask_low: float = 0.99  # sequence mask: keep episodes whose geometric-mean ratio is in
    seq_mask_high: float = 1.01
    # MoE models: r3 runs the experts the rollout engine chose for each token (recorded in
    # Sample.routing), gate weights from the trainer's own router logits (train/routing.py)
    router_replay: RouterReplayMode = "off"
    # r3 with samples lacking routing for some tokens: refuse (stop), or mask those loss tokens
    router_replay_missing: MissingRouting = "refuse"
    # --- data -------------------------------------------------------------------------------
    train_aux: bool = False  # train auxiliary sub-session samples (sub-agents, titles)
    drop_zero_variance_groups: bool = True  # groups with equal rewards: no gradient, not run
    # --- optimisation -----------------------------------------------------------------------
    steps: int = 1  # optimizer steps in this call
    mini_batch_episodes: int = 0  # episodes per optimizer step; 0 = all of them every step
    shuffle: bool = True  # shuffle episodes into mini-batches (seeded)
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0
    # a regular expression over parameter names (``re.search``): only the matching parameters
    # are trained, the rest stay frozen; "" = every parameter
    train_params: str = ""
    # of the trained parameters, those whose name this regular expression finds are trained
    # through one scalar each: the tensor times a learned factor that starts at 1 (for the final
    # norm's gains, a learned inverse temperature); "" = none, every trained tensor element-wise
    scale_only: str = ""
    # other learning rates for some of the trained parameters: whitespace-separated
    # ``REGEX=LR`` entries, the first entry whose regex finds a name wins, the rest get ``lr``
    # (say ``^model\.norm\.=0.4`` with lr=3e-5 over every parameter); "" = ``lr`` for all
    lr_groups: str = ""
    seed: int = 0
    resume: bool = True  # load optimizer state when the model folder has one (a checkpoint)
    # --- memory and speed -------------------------------------------------------------------
    micro_batch_tokens: int = 8192  # token budget of one packed micro-batch
    pad_to_multiple_of: int = 1  # pad micro-batches (e.g. 64 on GPU); 1 = no padding
    precision: Precision = "fp32"  # bf16: autocast, fp32 master weights
    attention: Attention = "varlen_sdpa"
    gradient_checkpointing: bool = False
    logprob_chunk: int = 1024  # positions per output-head chunk (fp32 [chunk, vocab] logits)
    # π_old of the mini-batch trained first is the detached log-prob of its own forward
    # (θ = θ_old then); False: always a separate no-grad pass
    fuse_old_logprobs: bool = True
    find_unused_parameters: bool = True  # DDP: MoE experts may get no tokens on a rank
    # --- LoRA (train/lora.py): train a peft adapter, the base weights frozen ------------------
    lora: bool = False
    lora_rank: int = 8
    lora_alpha: float = 32.0  # the adapter's output is scaled by lora_alpha / lora_rank
    lora_dropout: float = 0.0
    # the linear layers that get an adapter: a regular expression over module names
    # (``re.search``) or a list of names (a module is taken when its name is one of them or ends
    # in ``.NAME``); "" = every linear layer but the output head, the MLP included
    lora_targets: str | list[str] = ""
    merge: bool = False  # write merged full weights instead of the adapter (lora=true only)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        positive = ["adv_eps", "lr", "adam_eps", "max_grad_norm", "temperature", "tis_cap"]
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: must be > 0, got {getattr(self, name)}")
        at_least_one = ["steps", "micro_batch_tokens", "pad_to_multiple_of", "logprob_chunk"]
        for name in at_least_one:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        non_negative = [
            "mini_batch_episodes",
            "drgrpo_norm_tokens",
            "kl_coef",
            "entropy_coef",
            "weight_decay",
        ]
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for name in ["gspo_clip_low", "gspo_clip_high", "ppo_clip_low", "ppo_clip_high"]:
            if not 0 < getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be in (0, 1), got {getattr(self, name)}")
        if not 0 <= self.negative_advantage_scale <= 1:
            raise ConfigError(
                f"negative_advantage_scale: must be in [0, 1], got {self.negative_advantage_scale}"
            )
        if self.advantage == "sample" and self.negative_advantage_scale != 1:
            raise ConfigError(
                "negative_advantage_scale: scales group advantages; with advantage=sample the "
                "samples' own advantages are used as given (leave it at 1)"
            )
        for name in ["train_params", "scale_only"]:
            pattern = getattr(self, name)
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ConfigError(
                    f"{name}: not a regular expression ({exc}): {pattern!r}"
                ) from None
        self.lr_group_entries()  # checks the entries
        self._validate_lora()
        for name in ["adam_beta1", "adam_beta2"]:
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be in [0, 1), got {getattr(self, name)}")
        for low, high in [
            ("token_mask_low", "token_mask_high"),
            ("seq_mask_low", "seq_mask_high"),
        ]:
            if not 0 < getattr(self, low) <= 1 <= getattr(self, high):
                raise ConfigError(
                    f"{low}, {high}: need 0 < {low} <= 1 <= {high}, got "
                    f"{getattr(self, low)}, {getattr(self, high)}"
                )

    def _validate_lora(self) -> None:
        if self.lora_rank < 1:
            raise ConfigError(f"lora_rank: must be >= 1, got {self.lora_rank}")
        if not self.lora_alpha > 0:
            raise ConfigError(f"lora_alpha: must be > 0, got {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"lora_dropout: must be in [0, 1), got {self.lora_dropout}")
        targets = self.lora_targets
        if isinstance(targets, str):
            try:
                re.compile(targets)
            except re.error as exc:
                raise ConfigError(
                    f"lora_targets: not a regular expression ({exc}): {targets!r}"
                ) from None
        elif not targets or not all(isinstance(t, str) and t for t in targets):
            raise ConfigError(f"lora_targets: a list must hold module names, got {targets!r}")
        if self.merge and not self.lora:
            raise ConfigError("merge: merges a LoRA adapter; set lora=true, or leave merge off")
        if self.lora:
            for name in ("train_params", "scale_only", "lr_groups"):
                if getattr(self, name):
                    raise ConfigError(
                        f"{name}: chooses base parameters, which lora=true freezes; leave it "
                        "empty (the adapter is what trains)"
                    )

    @property
    def advantage_mode(self) -> Literal["grpo", "drgrpo", "sample"]:
        if self.advantage == "auto":
            return "drgrpo" if self.algorithm == "drgrpo" else "grpo"
        return self.advantage

    def lr_group_entries(self) -> list[tuple[str, float]]:
        """``lr_groups`` as ``(regex, lr)`` pairs, in order; a bad entry is a ConfigError."""
        entries = []
        for entry in self.lr_groups.split():
            pattern, sep, raw = entry.rpartition("=")
            if not sep or not pattern:
                raise ConfigError(f"lr_groups: expected REGEX=LR, got {entry!r}")
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ConfigError(
                    f"lr_groups: {pattern!r} is not a regular expression ({exc})"
                ) from None
            try:
                lr = float(raw)
            except ValueError:
                lr = math.nan
            if not (math.isfinite(lr) and lr > 0):
                raise ConfigError(f"lr_groups: the lr of {entry!r} must be a number > 0")
            entries.append((pattern, lr))
        return entries

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# Building a config from YAML and key=value overrides
# --------------------------------------------------------------------------------------------


def _field_types() -> dict[str, Any]:
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig)}


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """``value`` as field type ``tp``; strings from ``key=value`` are parsed as YAML scalars."""
    if get_origin(tp) is Literal:
        allowed = get_args(tp)
        if isinstance(value, bool):  # YAML 1.1 reads off / on / no / yes as booleans
            words = ("off", "no", "false") if not value else ("on", "yes", "true")
            spelled = [a for a in allowed if isinstance(a, str) and a in words]
            value = spelled[0] if len(spelled) == 1 else value
        if value not in allowed:
            raise ConfigError(
                f"{key}: must be one of {', '.join(map(str, allowed))}, got {value!r}"
            )
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as text
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected text, got {value!r}")
    if tp == str | list[str]:
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        raise ConfigError(f"{key}: expected a regular expression or a list of names, got {value!r}")
    raise TypeError(f"no coercion for {key}: {tp}")  # a field type this module does not handle


def _unknown(key: str, known: dict[str, Any]) -> ConfigError:
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"unknown config key {key!r}{hint}")


def parse_override(text: str) -> tuple[str, Any]:
    """``"lr=3e-6"`` → ``("lr", 3e-06)``; the value is read as a YAML scalar."""
    import yaml

    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {text!r}: expected key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def build_config(
    yaml_path: str | Path | None = None,
    overrides: list[str] | None = None,
    **explicit: Any,
) -> TrainConfig:
    """Defaults, then the YAML file, then ``key=value`` overrides, then ``explicit`` values."""
    import yaml

    types = _field_types()
    values: dict[str, Any] = {}

    def put(key: str, value: Any, where: str) -> None:
        if key not in types:
            err = _unknown(key, types)
            raise ConfigError(f"{where}: {err}")
        try:
            values[key] = _coerce(key, types[key], value)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None

    if yaml_path is not None:
        path = Path(yaml_path)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"{path}: {exc.strerror or exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of config keys")
        for key, value in data.items():
            put(str(key), value, str(path))
    for text in overrides or []:
        key, value = parse_override(text)
        put(key, value, f"override {text!r}")
    for key, value in explicit.items():
        if value is not None:
            put(key, value, f"--{key.replace('_', '-')}")
    return TrainConfig(**values)


def dump_config(config: TrainConfig, path: str | Path, extra: dict[str, Any] | None = None) -> None:
    """Write the resolved config (plus ``extra`` run facts, under ``run:``) as YAML."""
    import yaml

    data = config.to_dict()
    text = yaml.safe_dump(data, sort_keys=False)
    if extra:
        text += "# run facts, not config keys (build_config rejects them):\n"
        text += "\n".join(
            f"# {line}" for line in yaml.safe_dump(extra, sort_keys=False).splitlines()
        )
        text += "\n"
    Path(path).write_text(text)
