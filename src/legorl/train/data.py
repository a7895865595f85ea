"""Samples → a checked training batch: episodes, groups, advantages and flat loss-token arrays.

    batch = prepare_batch(samples, config, vocab_size=3000, max_len=4096)

Every sample is checked against the model and against the other segments of its episode; a
problem raises ``SampleError`` naming the sample (or, with ``skip_bad``, drops its episode and
says so through ``on_skip``). Loss tokens of all samples are numbered in one flat order (sample
by sample, left to right): ``token_offset[k]`` is where sample k's start.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from legorl.records import Sample
from legorl.train.config import TrainConfig
from legorl.train.losses import group_advantages


class SampleError(ValueError):
    """A malformed or inconsistent sample; the message starts with the sample's id."""


def _where(s: Sample) -> str:
    return f"sample {s.sample_id!r} (episode {s.episode_id!r})"


def check_sample(s: Sample, *, vocab_size: int, max_len: int) -> None:
    """Checks the record reader cannot make: against the model, and numeric sanity."""
    s.check()  # the record's own invariants, again: samples may be built in code
    if not s.input_ids:
        raise SampleError(f"{_where(s)}: input_ids is empty")
    if s.loss_mask[0] == 1:
        raise SampleError(f"{_where(s)}: loss_mask[0] is 1, but the first token has no context")
    if len(s.input_ids) > max_len:
        raise SampleError(
            f"{_where(s)}: {len(s.input_ids)} tokens, more than the model's context of {max_len}"
        )
    lo, hi = min(s.input_ids), max(s.input_ids)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise SampleError(
            f"{_where(s)}: token id {bad} is outside the model's vocabulary of {vocab_size}"
        )
    for k, lp in enumerate(s.rollout_logprobs):
        if not (math.isfinite(lp) and lp <= 1e-6):
            raise SampleError(f"{_where(s)}: rollout_logprobs[{k}] = {lp} is not a log-probability")
    if not math.isfinite(s.reward):
        raise SampleError(f"{_where(s)}: reward {s.reward} is not finite")
    if s.advantage is not None and not math.isfinite(s.advantage):
        raise SampleError(f"{_where(s)}: advantage {s.advantage} is not finite")
    if not (math.isfinite(s.weight) and s.weight >= 0):
        raise SampleError(f"{_where(s)}: weight {s.weight} must be finite and >= 0")


def _check_episode(segs: list[Sample], advantage_mode: str) -> None:
    first = segs[0]
    for s in segs[1:]:
        for name in ("segment_count", "group_id", "reward", "advantage"):
            if getattr(s, name) != getattr(first, name):
                raise SampleError(
                    f"{_where(s)}: {name} {getattr(s, name)!r} differs from "
                    f"{getattr(first, name)!r} in sample {first.sample_id!r} of the same episode"
                )
    seen: dict[int, Sample] = {}
    for s in segs:
        if s.segment_index in seen:
            raise SampleError(
                f"{_where(s)}: segment {s.segment_index} appears twice (also sample "
                f"{seen[s.segment_index].sample_id!r})"
            )
        seen[s.segment_index] = s
    missing = sorted(set(range(first.segment_count)) - set(seen))
    if missing:
        raise SampleError(
            f"{_where(first)}: episode has {first.segment_count} segments but segment(s) "
            f"{', '.join(map(str, missing))} are missing from the input"
        )
    if advantage_mode == "sample" and first.advantage is None:
        raise SampleError(f"{_where(first)}: advantage=sample, but the sample has no advantage")


@dataclass
class Batch:
    samples: list[Sample]  # segment order within each episode, episodes in input order
    episode_ids: list[str]  # [E]
    episode_samples: list[list[int]]  # [E] sample indices, in segment order
    sample_episode: list[int]  # [S] episode of each sample
    group_ids: list[str]  # [G]
    episode_group: torch.Tensor  # [E] long
    reward: torch.Tensor  # [E]
    advantage: torch.Tensor  # [E]
    trainable: list[int]  # episodes that get a gradient (zero-variance groups left out)
    zero_variance_groups: int
    token_offset: list[int]  # [S] first flat loss-token index of each sample
    mu: torch.Tensor  # [N] rollout log-probs
    token_episode: torch.Tensor  # [N] long
    token_weight: torch.Tensor  # [N] the sample's weight
    counts: dict[str, int] = field(default_factory=dict)  # dropped samples and why

    @property
    def n_tokens(self) -> int:
        return int(self.mu.numel())

    def episode_loss_tokens(self, e: int) -> int:
        return sum(sum(self.samples[i].loss_mask) for i in self.episode_samples[e])

    def mini_batches(self, size: int, *, shuffle: bool, seed: int) -> list[list[int]]:
        """Trainable episodes split into mini-batches of ``size`` (0: one with all of them)."""
        order = list(self.trainable)
        if shuffle:
            random.Random(seed).shuffle(order)
        if size <= 0 or size >= len(order):
            return [order]
        return [order[i : i + size] for i in range(0, len(order), size)]


def prepare_batch(
    samples: Iterable[Sample],
    config: TrainConfig,
    *,
    vocab_size: int,
    max_len: int,
    keep_zero_variance: bool = False,
    skip_bad: bool = False,
    on_skip: Callable[[str], None] | None = None,
) -> Batch:
    counts = {"samples_read": 0, "aux_dropped": 0, "bad_episodes_dropped": 0, "empty_episodes": 0}
    by_episode: dict[str, list[Sample]] = {}
    bad: dict[str, str] = {}  # episode -> first error, with skip_bad
    seen_ids: dict[str, str] = {}

    def problem(s: Sample, err: SampleError) -> None:
        if not skip_bad:
            raise err
        bad.setdefault(s.episode_id, str(err))

    for s in samples:
        counts["samples_read"] += 1
        if s.aux and not config.train_aux:
            counts["aux_dropped"] += 1
            continue
        if s.sample_id in seen_ids:
            problem(s, SampleError(f"{_where(s)}: sample_id appears twice in the input"))
            continue
        seen_ids[s.sample_id] = s.episode_id
        try:
            check_sample(s, vocab_size=vocab_size, max_len=max_len)
        except (SampleError, ValueError) as exc:
            err = exc if isinstance(exc, SampleError) else SampleError(f"{_where(s)}: {exc}")
            problem(s, err)
        by_episode.setdefault(s.episode_id, []).append(s)

    episodes: list[list[Sample]] = []
    for eid, segs in by_episode.items():
        segs.sort(key=lambda x: x.segment_index)
        if eid not in bad:
            try:
                _check_episode(segs, config.advantage_mode)
            except SampleError as err:
                problem(segs[0], err)
        if eid in bad:
            counts["bad_episodes_dropped"] += 1
            if on_skip is not None:
                on_skip(bad[eid])
            continue
        if sum(sum(s.loss_mask) for s in segs) == 0:
            counts["empty_episodes"] += 1
            continue
        episodes.append(segs)

    ordered: list[Sample] = []
    episode_samples: list[list[int]] = []
    for segs in episodes:
        episode_samples.append(list(range(len(ordered), len(ordered) + len(segs))))
        ordered.extend(segs)
    group_index: dict[str, int] = {}
    ep_group = [group_index.setdefault(segs[0].group_id, len(group_index)) for segs in episodes]
    reward = torch.tensor([segs[0].reward for segs in episodes], dtype=torch.float32)
    E, G = len(episodes), len(group_index)
    group_t = torch.tensor(ep_group, dtype=torch.long)
    if config.advantage_mode == "sample":
        advantage = torch.tensor([segs[0].advantage for segs in episodes], dtype=torch.float32)
        zero_var = torch.zeros(G, dtype=torch.bool)
        trainable = [e for e in range(E) if advantage[e] != 0 or keep_zero_variance]
    elif E:
        adv = group_advantages(
            reward, group_t, mode=config.advantage_mode, eps=config.adv_eps, n_groups=G
        )
        advantage, zero_var = adv.advantage, adv.zero_variance
        if config.negative_advantage_scale != 1.0:
            advantage = torch.where(
                advantage < 0, advantage * config.negative_advantage_scale, advantage
            )
        drop = config.drop_zero_variance_groups and not keep_zero_variance
        trainable = [e for e in range(E) if not (drop and bool(zero_var[ep_group[e]]))]
    else:
        advantage, zero_var, trainable = torch.zeros(0), torch.zeros(0, dtype=torch.bool), []

    token_offset, mu, tok_ep, tok_w = [], [], [], []
    n = 0
    for e, members in enumerate(episode_samples):
        for i in members:
            s = ordered[i]
            token_offset.append(n)
            k = len(s.rollout_logprobs)
            mu.extend(s.rollout_logprobs)
            tok_ep.extend([e] * k)
            tok_w.extend([s.weight] * k)
            n += k
    return Batch(
        samples=ordered,
        episode_ids=[segs[0].episode_id for segs in episodes],
        episode_samples=episode_samples,
        sample_episode=[e for e, members in enumerate(episode_samples) for _ in members],
        group_ids=list(group_index),
        episode_group=group_t,
        reward=reward,
        advantage=advantage,
        trainable=trainable,
        zero_variance_groups=int(zero_var.sum()),
        token_offset=token_offset,
        mu=torch.tensor(mu, dtype=torch.float32),
        token_episode=torch.tensor(tok_ep, dtype=torch.long),
        token_weight=torch.tensor(tok_w, dtype=torch.float32),
        counts=counts,
    )
