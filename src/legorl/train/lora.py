"""LoRA for ``legorl train`` through peft: the base weights frozen, a low-rank adapter trained.

    legorl train samples.jsonl --model fixtures/models/tiny-qwen3 --out ckpt lora=true \\
        lora_rank=8 lora_alpha=32 lr=1e-4
    legorl train more.jsonl --model ckpt --out ckpt lora=true        # resumes the adapter
    legorl train more.jsonl --model ckpt --out merged lora=true merge=true

The adapter goes on every linear layer but the output head (attention and MLP) unless
``lora_targets`` says otherwise: a regular expression over module names, or a list of names.
The trainer runs unchanged through the adapted model: π_old is recomputed through the adapter
the call starts from (identity for a fresh one: B starts at zero), the loss trains A and B only.

The checkpoint is a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``,
readable by ``peft`` and by vLLM's runtime LoRA loading), with the optimizer state, the trainer
state and the resolved config beside it. Its ``base_model_name_or_path`` is the base folder's
absolute path: a resume loads that base and the adapter on top, and engines refuse an adapter
whose base is not the model they serve. ``merge=true`` writes merged full weights instead (no
optimizer state: its moments belong to the adapter).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from legorl.engines.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_base,
    adapter_config,
    is_adapter,
)
from legorl.protocols import ConfigError
from legorl.train.config import TrainConfig, dump_config

ADAPTER_NAME = "default"  # peft's own name for a model's one adapter


class LoraError(ConfigError):
    """A LoRA request that cannot be honoured; the message names the field or the folder."""


def base_of(model_dir: str | Path) -> Path:
    """The folder whose full weights a run starts from: an adapter's base, else ``model_dir``."""
    if not is_adapter(model_dir):
        return Path(model_dir)
    base = adapter_base(model_dir)
    if not (base / "config.json").is_file():
        raise LoraError(
            f"{Path(model_dir) / ADAPTER_CONFIG}: its base model {base} is not a model folder "
            "(no config.json)"
        )
    return base


def check_start(
    model_dir: Path, out: Path | None, config: TrainConfig, state: dict[str, Any]
) -> None:
    """Refuse, before any work, a run that would switch between LoRA and full training on
    resume, or write an adapter over a full model folder."""
    if is_adapter(model_dir) and not config.lora:
        raise LoraError(
            f"--model {model_dir}: a LoRA adapter checkpoint; resume it with lora=true (merge=true "
            "writes its merged full weights, which full training can start from)"
        )
    saved_lora = bool(state.get("lora"))
    has_moments = (model_dir / "optimizer.pt").is_file()
    if config.lora and config.resume and has_moments and not saved_lora:
        raise LoraError(
            f"{model_dir / 'optimizer.pt'}: saved for full training, not a LoRA adapter; "
            "resume=false starts a fresh adapter on these weights"
        )
    full_out = out is not None and (out / "config.json").is_file() and not is_adapter(out)
    if config.lora and not config.merge and full_out:
        raise LoraError(
            f"--out {out}: holds a full model; an adapter checkpoint goes to a folder of its "
            "own (or merge=true writes merged full weights)"
        )


def linear_targets(lm: Any, targets: str | list[str]) -> list[str]:
    """The names of the linear layers ``targets`` chooses ("" = all but the output head)."""
    head = lm.get_output_embeddings()
    linear = [n for n, m in lm.named_modules() if isinstance(m, torch.nn.Linear) and m is not head]
    if targets == "":
        chosen = linear
    elif isinstance(targets, str):
        regex = re.compile(targets)
        chosen = [n for n in linear if regex.search(n)]
    else:
        chosen = [n for n in linear if any(n == t or n.endswith(f".{t}") for t in targets)]
    if not chosen:
        kinds = sorted({n.rsplit(".", 1)[-1] for n in linear})
        raise LoraError(
            f"lora_targets: {targets!r} matches none of the model's linear layers (their names "
            f"end in {', '.join(kinds) or 'nothing: the model has none'})"
        )
    return chosen


def attach(lm: Any, model_dir: Path, config: TrainConfig) -> Any:
    """Put a LoRA adapter on ``lm`` in place (a fresh one, or the one saved in ``model_dir``)
    and return the peft model around it; only the adapter's tensors require grad."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    names = linear_targets(lm, config.lora_targets)
    saved = adapter_config(model_dir) if is_adapter(model_dir) else None
    if saved is not None:
        was: tuple[Any, ...] = (saved.get("r"), saved.get("lora_alpha"))
        # peft may save a long list of names as the fewest suffixes that choose them
        kept = saved.get("target_modules") or []
        kept = [kept] if isinstance(kept, str) else kept
        was += (sorted(linear_targets(lm, kept) if kept else []),)
        now: tuple[Any, ...] = (config.lora_rank, config.lora_alpha, sorted(names))
        for what, a, b in zip(("lora_rank", "lora_alpha", "lora_targets"), was, now, strict=True):
            if a != b:
                shown = (
                    (f"{len(a)} layers", f"{len(b)} layers") if what == "lora_targets" else (a, b)
                )
                raise LoraError(
                    f"{model_dir / ADAPTER_CONFIG}: the adapter has {what} {shown[0]}, the config "
                    f"asks for {shown[1]}; resume with the adapter's own settings"
                )
    settings: dict[str, Any] = {"lora_alpha": config.lora_alpha}  # peft types it int
    peft_config = LoraConfig(
        r=config.lora_rank,
        lora_dropout=config.lora_dropout,
        target_modules=names,
        bias="none",
        task_type="CAUSAL_LM",
        **settings,
    )
    model = get_peft_model(lm, peft_config)
    model.peft_config[ADAPTER_NAME].base_model_name_or_path = str(base_of(model_dir).resolve())
    if saved is not None:
        tensors = load_file(str(model_dir / ADAPTER_WEIGHTS))
        result: Any = set_peft_model_state_dict(model, tensors)
        missing = [k for k in result.missing_keys if "lora_" in k]
        if missing or result.unexpected_keys:
            raise LoraError(
                f"{model_dir / ADAPTER_WEIGHTS}: does not fit the adapter (missing "
                f"{missing[:3]}, unexpected {list(result.unexpected_keys)[:3]})"
            )
    return model


def trainable(model: Any) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def state_of(config: TrainConfig, model: Any) -> dict[str, Any]:
    """What ``trainer_state.json`` says of the adapter (a resume checks it)."""
    return {
        "rank": config.lora_rank,
        "alpha": config.lora_alpha,
        "targets": sorted(model.peft_config[ADAPTER_NAME].target_modules),
        "merged": config.merge,
    }


def save_adapter(
    accelerator: Any,
    model: Any,
    optimizer: Any,
    out: Path,
    *,
    config: TrainConfig,
    state: dict[str, Any],
    run: dict[str, Any],
    files: dict[str, str],
) -> None:
    """The adapter folder: PEFT config and weights (fp32), optimizer state, trainer state and
    the resolved config, each file moved into ``out`` whole (``out`` may be the run's own
    ``--model`` adapter folder)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    if not accelerator.is_main_process:
        accelerator.wait_for_everyone()
        return
    tensors = {
        k: v.detach().to("cpu", torch.float32).contiguous()
        for k, v in get_peft_model_state_dict(model).items()
    }
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".saving-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        model.peft_config[ADAPTER_NAME].save_pretrained(str(tmp))
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / files["optimizer"])
        (tmp / files["state"]).write_text(json.dumps(state, indent=2) + "\n")
        dump_config(config, tmp / files["config"], extra=run)
        for p in tmp.iterdir():
            os.replace(p, out / p.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()


def merge(model: Any, out: Path) -> None:
    """Fold the adapter into the base weights in place (before a full-weight save); an earlier
    adapter checkpoint in ``out`` is removed, as the merged weights hold it."""
    model.merge_and_unload()
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        (out / name).unlink(missing_ok=True)


def load_merged(path: str | Path, *, attention: str = "varlen_sdpa") -> Any:
    """A frozen copy of the policy in ``path`` (an adapter folder merged onto its base, or a
    full model): the KL reference of a LoRA run."""
    from legorl.train.model import load_policy

    lm = load_policy(base_of(path), attention=attention)
    if is_adapter(path):
        from peft import PeftModel

        lm = PeftModel.from_pretrained(lm, str(path)).merge_and_unload()
    return lm
