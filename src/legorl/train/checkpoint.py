"""A training call's checkpoint: weights in the model's own dtype, the optimizer state (checked
to belong to the tensors a resumed call trains), the trainer state and the resolved config;
and the push that makes the proxy reload it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from legorl.train.config import TrainConfig, dump_config

OPTIMIZER_FILE = "optimizer.pt"


STATE_FILE = "trainer_state.json"


CONFIG_FILE = "train_config.yaml"


class TrainError(RuntimeError):
    """A failure the command reports in one line (bad push, unusable input)."""


@dataclass
class Push:
    url: str  # the proxy's base URL; /admin/weights is appended
    token: str


def read_state(model: Path) -> dict[str, Any]:
    path = model / STATE_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def _saved_dtype(model: Path) -> torch.dtype:
    from transformers import AutoConfig

    dtype = getattr(AutoConfig.from_pretrained(str(model), local_files_only=True), "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def save_checkpoint(
    accelerator: Any,
    scorer: Any,
    optimizer_state: dict[str, Any] | None,
    out: Path,
    *,
    model_dir: Path,
    config: TrainConfig,
    state: dict[str, Any],
    run: dict[str, Any],
) -> None:
    """Weights (``save_pretrained``, in the dtype the model came in), tokenizer, optimizer state
    (unless None), trainer state and the resolved config, each file moved into
    ``out`` whole (``out`` may be the model folder itself)."""
    full = accelerator.get_state_dict(scorer)  # every process takes part (FSDP gathers here)
    if not accelerator.is_main_process:
        accelerator.wait_for_everyone()
        return
    dtype = _saved_dtype(model_dir)
    weights = {k.removeprefix("lm."): v.to(dtype) for k, v in full.items()}
    lm = accelerator.unwrap_model(scorer).lm
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".saving-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        lm.save_pretrained(tmp, state_dict=weights, safe_serialization=True)
        config_json = json.loads((tmp / "config.json").read_text())
        config_json["dtype"] = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
        with contextlib.suppress(OSError, ValueError):
            from legorl.engines.models import load_tokenizer

            load_tokenizer(model_dir).save_pretrained(tmp)
        if optimizer_state is not None:
            torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
        dump_config(config, tmp / CONFIG_FILE, extra=run)
        new = {p.name for p in tmp.iterdir()}
        for old in out.glob("model*.safetensors*"):  # a differently sharded earlier checkpoint
            if old.name not in new:
                old.unlink()
        for p in tmp.iterdir():
            os.replace(p, out / p.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()


def push_weights(push: Push, checkpoint: Path, timeout: float = 600.0) -> int:
    """Ask the proxy to reload ``checkpoint``; returns the new policy version."""
    url = push.url.rstrip("/")
    if not url.endswith("/admin/weights"):
        url += "/admin/weights"
    body = json.dumps({"path": str(checkpoint.resolve())}).encode()
    request = urllib.request.Request(
        url,
        data=body,
        method="POST",
        headers={"content-type": "application/json", "authorization": f"Bearer {push.token}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace").strip()[:300]
        raise TrainError(f"--push {url}: HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise TrainError(f"--push {url}: {getattr(exc, 'reason', exc)}") from None
    version = answer.get("policy_version") if isinstance(answer, dict) else None
    if not isinstance(version, int):
        raise TrainError(f"--push {url}: answer has no policy_version: {answer!r}")
    return version


def resume_optimizer(
    optimizer: torch.optim.Optimizer,
    groups: list[dict[str, Any]],
    state: dict[str, Any],
    model_dir: Path,
    config: TrainConfig,
) -> bool:
    """Load ``optimizer.pt`` from ``model_dir`` when it was saved for the same tensors, grouped
    the same way; this call's lrs, betas, eps and weight decay win over the saved ones. Returns
    whether there was one; raises TrainError when it belongs to other tensors."""
    path = saved_optimizer(state, model_dir, config)
    if path is None:
        return False
    optimizer.load_state_dict(torch.load(path, weights_only=True))
    take_call_settings(optimizer, groups, config)
    return True


def saved_optimizer(state: dict[str, Any], model_dir: Path, config: TrainConfig) -> Path | None:
    """``optimizer.pt`` in ``model_dir`` (None: there is none), once checked to be saved for
    the tensors this call trains (``TrainError`` otherwise)."""
    path = model_dir / OPTIMIZER_FILE
    if not path.is_file():
        return None
    # Adam's moments belong to the tensors that were trained (another train_params would give
    # them to other tensors, silently where the counts and shapes agree); a scalar factor's are
    # not a whole tensor's; lr_groups' regexes sort them into the groups (their lrs may change)
    saved = {
        "train_params": (
            state.get("train_params", ""),
            config.train_params,
            "train the same parameters",
        ),
        "scale_only": (state.get("scale_only", ""), config.scale_only, "train the same way"),
        "lr_groups regexes": (
            state.get("lr_group_patterns", []),
            [pattern for pattern, _ in config.lr_group_entries()],
            "group the same parameters (other lrs are fine)",
        ),
    }
    for what, (was, now, fix) in saved.items():
        if was != now:
            shown = (repr(was), repr(now)) if isinstance(now, str) else (was, now)
            raise TrainError(
                f"{path}: saved for {what} {shown[0]}, not {shown[1]}; {fix}, or resume=false"
            )
    return path


def take_call_settings(optimizer: Any, groups: list[dict[str, Any]], config: TrainConfig) -> None:
    """This call's lrs, betas, eps and weight decay over the ones a loaded state brought."""
    for group, built in zip(optimizer.param_groups, groups, strict=True):
        group.update(lr=built["lr"], weight_decay=config.weight_decay, eps=config.adam_eps)
        group["betas"] = (config.adam_beta1, config.adam_beta2)
