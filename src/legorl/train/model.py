"""The policy as the trainer sees it: a causal LM wrapped so that one forward over a packed
micro-batch returns the log-probs (and entropies) of its loss tokens only.

    scorer = TokenScorer(load_policy("fixtures/models/tiny-qwen3", attention="varlen_sdpa"))
    logp, entropy = scorer(mb.input_ids, mb.position_ids, mb.logit_index, mb.targets, **kw)

The decoder runs once over the row; the output head runs only on the positions that predict a
loss token, ``chunk`` positions at a time, each chunk under activation checkpointing when grads
are on, so fp32 ``[chunk, vocab]`` logits are the most that exists at once, forward or backward
(slime #2253). Log-probs are ``log_softmax(raw_logits / T)``, as ``engines.models`` scores
rollouts. ``TokenScorer`` is the module accelerate wraps (DDP / FSDP), so its forward is the one
that syncs gradients.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from legorl.engines.models import logits_from_hidden, scaled_logprobs
from legorl.train.packing import attn_implementation


def load_policy(path: str | Path, *, attention: str = "varlen_sdpa") -> Any:
    """A causal LM from a local folder, fp32 master weights, in train mode with grads on."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(
        str(path),
        dtype=torch.float32,
        local_files_only=True,
        attn_implementation=attn_implementation(attention),
    )
    model.train()
    model.requires_grad_(True)
    return model


class TokenScorer(nn.Module):
    def __init__(self, lm: Any, *, temperature: float = 1.0, chunk: int = 1024) -> None:
        super().__init__()
        self.lm = lm
        self.temperature = temperature
        self.chunk = chunk
        self.replay: Any = None  # train.routing.RouterReplay: MoE routing of the next forward

    def _score(
        self, hidden: torch.Tensor, targets: torch.Tensor, entropy: list[str]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        lp = scaled_logprobs(logits_from_hidden(self.lm, hidden), self.temperature)  # [c, V]
        tok = lp.gather(-1, targets[:, None])[:, 0]  # [c]
        if entropy[0] == "grad":
            return tok, -(lp.exp() * lp).sum(-1)  # [c]
        if entropy[0] == "value":
            with torch.no_grad():
                return tok, -(lp.exp() * lp).sum(-1)
        return tok, None

    def forward(
        self,
        input_ids: torch.Tensor,  # [1, T]
        position_ids: torch.Tensor,  # [1, T]
        logit_index: torch.Tensor,  # [N]
        targets: torch.Tensor,  # [N]
        *,
        entropy: bool | str = False,
        routing: torch.Tensor | None = None,  # [L, T, k] recorded MoE routing, for ``replay``
        routing_rows: list[tuple[int, int]] | None = None,  # (sample, start) laid in the row
        **attention_kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs [N] of ``targets`` and the policy's entropy [N] there: ``entropy=True`` (or
        ``"grad"``) with a gradient, ``"value"`` without one (for metrics), False not at all."""
        from torch.utils.checkpoint import checkpoint

        if self.replay is not None:
            self.replay.use(routing, routing_rows)
        hidden = self.lm.get_decoder()(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, **attention_kwargs
        ).last_hidden_state[0]  # [T, H]
        h = hidden.index_select(0, logit_index)  # [N, H]
        grad = torch.is_grad_enabled()
        mode = "grad" if entropy is True else "none" if entropy is False else entropy
        if mode == "grad" and not grad:
            mode = "value"
        toks, ents = [], []
        for lo in range(0, targets.numel(), self.chunk):
            hc, tc = h[lo : lo + self.chunk], targets[lo : lo + self.chunk]
            flag = [mode]
            if grad:
                # recomputed in backward: only the [c, H] input is kept, never [c, V] logits;
                # an entropy wanted as a value only (a metric) is not recomputed: its flag is
                # switched off once the forward has run
                tok, ent = checkpoint(self._score, hc, tc, flag, use_reentrant=False)
                if mode == "value":
                    flag[0] = "none"
            else:
                tok, ent = self._score(hc, tc, flag)
            toks.append(tok)
            if ent is not None:
                ents.append(ent)
        if not toks:
            # no loss tokens: keep the graph connected so every process still runs backward
            empty = (hidden.sum() * 0.0).reshape(1)[:0]
            return empty, (empty if mode != "none" else None)
        return torch.cat(toks), (torch.cat(ents) if ents else None)
