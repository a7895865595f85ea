"""Shared model helpers for the engines: load a causal LM and its tokenizer from a local folder,
swap in a new checkpoint in place, and score tokens with exact, chunked log-probs.

    from legorl.engines.models import load_model, token_logprobs
    model = load_model("fixtures/models/tiny-qwen3", dtype="float32", device="cpu")
    lps = token_logprobs(model, prompt_ids + completion_ids, start=len(prompt_ids), temperature=1.0)

The log-prob of a token is ``log_softmax(raw_logits / T)[token]``: raw logits, at the sampling
temperature, before top-p or any other processor; a temperature of 0 (greedy) scores at T = 1.
``token_logprobs`` runs the decoder once over the whole sequence and applies the output head in
chunks of positions, so a long sequence never holds fp32 full-vocabulary logits for every
position at once (only ``[chunk, vocab]``). Given the K/V of a prefix it computed before, it runs
over the rest of the sequence only (the ``forced`` engine's prefix cache).

torch and transformers are imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    KV = list[tuple[torch.Tensor, torch.Tensor]]

DType = Literal["float32", "bfloat16"]
Device = str  # "cpu", "cuda", "cuda:1", …

#: Positions per output-head chunk when scoring: [chunk, vocab] fp32 logits at a time.
DEFAULT_LOGPROB_CHUNK = 1024


def torch_dtype(name: str) -> torch.dtype:
    import torch

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if name not in dtypes:
        raise ValueError(f"dtype must be one of {', '.join(dtypes)}, got {name!r}")
    return dtypes[name]


def load_model(path: str | Path, *, dtype: str = "float32", device: Device = "cpu") -> Any:
    """A causal LM from a local folder, in eval mode, on ``device`` with ``dtype`` weights; a
    LoRA adapter folder gives its base model with the adapter merged."""
    import torch
    from transformers import AutoModelForCausalLM

    from legorl.engines.adapters import adapter_base, is_adapter

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA device")
    adapter = Path(path) if is_adapter(path) else None
    model: Any = AutoModelForCausalLM.from_pretrained(
        str(adapter_base(path) if adapter else path),
        dtype=torch_dtype(dtype),
        local_files_only=True,
    )
    if adapter is not None:  # a LoRA checkpoint: its base with the adapter merged in
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    from legorl.engines.adapters import adapter_base, is_adapter

    folder = adapter_base(path) if is_adapter(path) else path  # an adapter uses its base's
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def max_context_of(model: PreTrainedModel) -> int:
    """The model's context length from its config (``max_position_embeddings``)."""
    config = model.config.get_text_config(decoder=True)
    value = getattr(config, "max_position_embeddings", None)
    if not isinstance(value, int) or value <= 0:
        raise ValueError("model config has no max_position_embeddings; set max_context")
    return value


def reload_weights(model: PreTrainedModel, path: str | Path) -> None:
    """Copy a checkpoint of the same architecture into ``model``'s parameters, in place.

    The checkpoint is loaded through transformers on the CPU (so its on-disk key layout, e.g.
    per-expert MoE weights, is converted exactly as at first load) and then copied tensor by
    tensor; the model on the accelerator never exists twice.
    """
    from transformers import AutoModelForCausalLM

    fresh = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=model.dtype, local_files_only=True
    )
    if type(fresh) is not type(model):
        raise ValueError(
            f"checkpoint {path} is a {type(fresh).__name__}, the engine serves a "
            f"{type(model).__name__}: load_weights needs the same architecture"
        )
    # strict: a missing or extra tensor, or a shape mismatch, is an error, not a silent partial load
    own = model.state_dict()
    if not any(".base_layer." in k for k in own):
        model.load_state_dict(fresh.state_dict(), strict=True)
        del fresh
        return
    # LoRA layers wrap the linear ones (engines/adapters.py): the base tensors are renamed
    import torch

    base = {k.replace(".base_layer.", "."): v for k, v in own.items() if ".lora_" not in k}
    new = fresh.state_dict()
    if base.keys() != new.keys() or any(base[k].shape != new[k].shape for k in new):
        raise ValueError(f"checkpoint {path}: its tensors do not match the served model's")
    with torch.no_grad():
        for key, value in new.items():
            base[key].copy_(value)
    del fresh


def logits_from_hidden(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """The output head applied to decoder hidden states, as the model's own forward does it."""
    logits = model.get_output_embeddings()(hidden)
    cap = getattr(model.config.get_text_config(decoder=True), "final_logit_softcapping", None)
    if cap:
        import torch

        logits = torch.tanh(logits / cap) * cap
    return logits


def scaled_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(logits / T)`` in fp32 over the last dim; T = 0 (greedy) scores at T = 1."""
    import torch

    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits.float() / t, dim=-1)


def token_logprobs(
    model: PreTrainedModel,
    input_ids: list[int],
    *,
    start: int,
    temperature: float,
    chunk: int = DEFAULT_LOGPROB_CHUNK,
    prefix: KV | None = None,
    keep: list[KV] | None = None,
) -> list[float]:
    """Log-probs of ``input_ids[start:]``, each given everything before it, in one decoder pass.

    ``start`` must be >= 1 (the first token has no context). Only the output head is chunked:
    ``chunk`` positions of fp32 logits exist at a time. ``prefix``: the K/V of the sequence's
    first tokens, per layer ``[1, H_kv, n, D]`` with ``n < start``, computed by this model
    over exactly those tokens; the pass then runs over the rest only. ``keep``: a list the
    whole sequence's K/V is appended to, for a later call's ``prefix``.
    """
    import torch

    if not 1 <= start <= len(input_ids):
        raise ValueError(f"start must be in 1..{len(input_ids)}, got {start}")
    if start == len(input_ids) and keep is None:
        return []
    n = prefix[0][0].shape[-2] if prefix else 0
    if not 0 <= n < start:
        raise ValueError(f"a prefix of {n} tokens leaves no position before {start} to run")
    device = next(model.parameters()).device
    ids = torch.tensor([input_ids], dtype=torch.long, device=device)  # [1, T]
    with torch.inference_mode():
        cache = None
        if keep is not None or prefix:
            from transformers import DynamicCache

            cache = DynamicCache(config=model.config)
            layers: list[Any] = cache.layers  # DynamicLayers (the caller's to check)
            for layer, (k, v) in zip(layers, prefix or [], strict=False):
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k, v  # a DynamicLayer concatenates: never written
        out = model.get_decoder()(input_ids=ids[:, n:], cache=cache, use_cache=cache is not None)
        hidden = out.last_hidden_state  # [1, T - n, H], positions n..T-1
        if keep is not None:
            assert cache is not None
            keep.append([(layer.keys, layer.values) for layer in layers])
        # position p predicts token p + 1: score hidden[start - 1 : T - 1] against ids[start:]
        targets = ids[0, start:]  # [N]
        scored: list[torch.Tensor] = []
        for lo in range(0, targets.numel(), chunk):
            h = hidden[0, start - 1 - n + lo : start - 1 - n + lo + chunk]  # [c, H]
            lp = scaled_logprobs(logits_from_hidden(model, h), temperature)  # [c, V]
            scored.append(lp.gather(-1, targets[lo : lo + chunk, None])[:, 0])
    return torch.cat(scored).tolist() if scored else []


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (a cached prefix's reach)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case: the new prompt extends the cached tokens
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]: bisect on slice equality
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def odd_cache_layers(model: PreTrainedModel) -> set[str]:
    """The class names of the model's cache layers that are not full-attention
    ``DynamicLayer``s (a sliding window's, say), whose K/V a prefix cannot be cut from."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    layers = DynamicCache(config=model.config).layers
    return {type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer}
