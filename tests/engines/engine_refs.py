"""Shared helpers for the engine tests: the tiny model, a chat prompt, and an independent
log-prob recompute (the model's own full-logits forward, no legorl code involved)."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from legorl.protocols import GenerationRequest, TokenStep

MODEL = Path(__file__).resolve().parents[2] / "fixtures/models/tiny-qwen3"
MOE_MODEL = Path(__file__).resolve().parents[2] / "fixtures/models/tiny-qwen3-moe"
IM_END = 2  # <|im_end|>, the ChatML stop token


@cache
def reference_model(path: Path = MODEL, dtype: torch.dtype = torch.float32) -> Any:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.eval()
    return model


@cache
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(str(MODEL))


def chat_prompt(text: str) -> list[int]:
    tok = tokenizer()
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return list(tok.encode(rendered, add_special_tokens=False))


def reference_logprobs(model: Any, ids: list[int], start: int, temperature: float) -> list[float]:
    """log_softmax(full logits / T) of ids[start:], from one plain forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()  # [T, V]
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits / t, dim=-1)[start - 1 : -1]
    return logp.gather(1, torch.tensor(ids[start:])[:, None])[:, 0].tolist()


def agreement(a: list[float], b: list[float]) -> tuple[float, float]:
    """(max |Δ log-prob|, Pearson correlation of the probabilities)."""
    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    max_delta = float((x - y).abs().max())
    pearson = float(torch.corrcoef(torch.stack([x.exp(), y.exp()]))[0, 1])
    return max_delta, pearson


async def collect(engine: Any, request: GenerationRequest) -> tuple[list[TokenStep], int]:
    """All steps of one request and the number of chunks they came in."""
    steps: list[TokenStep] = []
    chunks = 0
    async for chunk in engine.generate(request):
        steps.extend(chunk)
        chunks += 1
    return steps, chunks
