"""The align stage: graded Trajectories and their Turns in, token-exact training Samples out.

    legorl align graded.jsonl --out samples.jsonl --summary align.json
    legorl align graded.jsonl --check --model fixtures/models/tiny-qwen3 > /dev/null

    from legorl.align import AlignStats, align
    stats = AlignStats()
    samples = list(align(trajectories, base_dir=Path("runs"), stats=stats))

The proxy recorded every call as a Turn whose prompt is a delta against its segment. ``align``
walks each episode's Turns once, grouped by (session, segment), and concatenates prompt deltas
and sampled completions into one sequence for as long as each prompt token-exactly extends the
previous prompt + completion; a prompt that does not starts a new Sample with its own left
context. ``loss_mask`` is 1 on sampled completion tokens only, and ``rollout_logprobs`` carries
the engine's log-prob of each of them. Every Sample of an episode keeps the episode id (the
trajectory id), its index among the episode's samples and their count, the group id and the
episode's reward, so the trainer can give all segments the episode's advantage.

Auxiliary sub-sessions (``flags.aux``: title calls, sub-agents) are left out unless
``include_aux``; then they become samples of their own, flagged ``aux``. Episodes whose status is
an environment failure or whose reward is null are dropped and counted by reason, never scored 0.

An episode the proxy ``truncated`` (a budget spent, or its prompt outgrew the model's context:
the policy's doing) is handled by one ``Truncation`` rule (``--truncation``). ``mask``, the
default and DAPO's overlong filtering: its samples are kept with ``weight`` 0, so its reward
still counts in its group's baseline but no loss flows through it, and the survivors are not
the only episodes the group is judged by. ``penalty``, DAPO's soft overlong punishment, adds to
every episode's reward R(L) of its L sampled tokens: 0 for L <= max - buffer, the linear
((max - buffer) - L) / buffer up to L = max, and -1 beyond max or for a truncated episode.
Work and storage are linear in the episode's tokens: nothing rebuilds a full prompt per turn.

MoE routing (``Turn.routing``, ``legorl.routing``) follows the same bookkeeping as the tokens: a
Sample's ``routing`` lists spans of the Turns' sidecar chunks by position. A position keeps the
routing of the first call that computed it (reused raw tokens, and the left context a new
Sample copies from the one it broke off, keep theirs; a turn's prefill and decode add the
positions after them). Each chunk's header and checksum are checked as it is read; a missing
or corrupt sidecar is an ``AlignError`` naming the file. A Sample whose turns leave positions
without routing (a turn recorded by an engine that does not capture it) covers only the
positions before the first gap; the trainer counts or refuses the rest
(``router_replay_missing``).

``FidelityCheck`` is the trainer's side of pillar 1: it recomputes the log-prob of every loss
token with the model (``legorl.engines.models.token_logprobs``) and reports the Pearson
correlation of probabilities on loss tokens, mean and max |Δ log-prob| and the k3 estimate of
KL(rollout ‖ trainer), per sample and overall.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from legorl.records import (
    ENVIRONMENT_FAILURES,
    RecordError,
    RoutingSpan,
    Sample,
    Trajectory,
    Turn,
    read_jsonl,
)
from legorl.routing import RoutingError, RoutingLayout, read_chunk, read_layout

#: Why an episode yields no samples; the keys of ``AlignStats.dropped`` besides failure statuses.
NO_REWARD = "no_reward"
NO_TURNS = "no_turns"
NO_TRAINABLE_TURNS = "no_trainable_turns"
INVALID = "invalid"


@dataclass(slots=True, frozen=True)
class Truncation:
    """What training makes of truncated episodes; see the module docstring."""

    rule: Literal["mask", "penalty"] = "mask"
    overlong_max: int | None = None  # penalty: L_max, sampled tokens of an episode
    overlong_buffer: int = 0  # penalty: L_cache, the soft band below overlong_max

    def __post_init__(self) -> None:
        if self.rule not in ("mask", "penalty"):
            raise ValueError(f"truncation rule: expected mask or penalty, got {self.rule!r}")
        if self.rule == "penalty":
            if self.overlong_max is None or self.overlong_max <= 0:
                raise ValueError("overlong_max: the penalty rule needs a length > 0")
            if not 0 <= self.overlong_buffer <= self.overlong_max:
                raise ValueError(
                    f"overlong_buffer: expected 0..overlong_max ({self.overlong_max}), "
                    f"got {self.overlong_buffer}"
                )

    def shaped(self, reward: float, length: int, truncated: bool) -> tuple[float, float]:
        """(reward, sample weight) of an episode of ``length`` sampled tokens."""
        if self.rule == "mask":
            return reward, 0.0 if truncated else 1.0
        assert self.overlong_max is not None
        soft = self.overlong_max - self.overlong_buffer
        if truncated or length > self.overlong_max:
            penalty = -1.0
        elif length > soft:
            penalty = (soft - length) / self.overlong_buffer
        else:
            penalty = 0.0
        return reward + penalty, 1.0


class AlignError(ValueError):
    """An episode cannot become samples; the message names the trajectory and, when one is to
    blame, the session and turn."""

    def __init__(self, trajectory_id: str, message: str, turn: Turn | None = None) -> None:
        where = f"trajectory {trajectory_id!r}"
        if turn is not None:
            where += f", session {turn.session!r} turn {turn.turn}"
        super().__init__(f"{where}: {message}")
        self.trajectory_id = trajectory_id
        self.turn = turn


@dataclass(slots=True)
class AlignStats:
    """Counts over one or more ``align`` calls; ``summary()`` is the JSON the CLI writes."""

    episodes_in: int = 0
    episodes: int = 0  # kept: yielded at least one sample
    samples: int = 0
    aux_samples: int = 0
    turns: int = 0  # turns of kept episodes that went into samples
    aux_turns_excluded: int = 0
    realigned_turns: int = 0  # turns whose history the proxy repaired to the raw tokens
    breaks: int = 0  # samples opened inside a proxy segment: the prompt stopped extending
    mixed_policy_samples: int = 0  # samples whose turns came from more than one policy version
    trained_tokens: int = 0
    total_tokens: int = 0
    max_samples_per_episode: int = 0
    truncated_episodes: int = 0  # kept episodes the proxy truncated, under the truncation rule
    routed_samples: int = 0  # samples carrying MoE routing
    routing_gaps: int = 0  # of those, samples with positions no recorded routing covers
    dropped: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # first messages of skipped episodes

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def summary(self) -> dict[str, Any]:
        return {
            "episodes_in": self.episodes_in,
            "episodes": self.episodes,
            "samples": self.samples,
            "aux_samples": self.aux_samples,
            "segments_per_episode": {
                "mean": self.samples / self.episodes if self.episodes else None,
                "max": self.max_samples_per_episode,
            },
            "turns": self.turns,
            "aux_turns_excluded": self.aux_turns_excluded,
            "realigned_turns": self.realigned_turns,
            "breaks": self.breaks,
            "mixed_policy_samples": self.mixed_policy_samples,
            "trained_tokens": self.trained_tokens,
            "total_tokens": self.total_tokens,
            "trained_fraction": (
                self.trained_tokens / self.total_tokens if self.total_tokens else None
            ),
            "truncated_episodes": self.truncated_episodes,
            "routed_samples": self.routed_samples,
            "routing_gaps": self.routing_gaps,
            "dropped": dict(sorted(self.dropped.items())),
            "errors": list(self.errors),
        }


# --------------------------------------------------------------------------------------------
# Turns of a trajectory
# --------------------------------------------------------------------------------------------

TurnLoader = Callable[[Trajectory], Iterable[Turn]]


def turns_of(traj: Trajectory, base_dir: Path | None = None) -> Iterator[Turn]:
    """The trajectory's turns: inline, or read from its ``turns_ref`` files (relative to
    ``base_dir``, the trajectory file's folder; None: the working directory)."""
    for turn, _ in _turns_and_folders(traj, base_dir):
        yield turn


def _turns_and_folders(traj: Trajectory, base_dir: Path | None) -> Iterator[tuple[Turn, Path]]:
    """Each turn with the folder its routing sidecar is relative to (its Turn file's)."""
    if traj.turns is not None and traj.turns_ref is not None:
        raise AlignError(traj.trajectory_id, "has both turns and turns_ref; give one")
    base = base_dir if base_dir is not None else Path.cwd()
    if traj.turns is not None:
        for turn in traj.turns:
            yield turn, base
        return
    for ref in traj.turns_ref or ():
        path = base / ref
        if not path.is_file():
            raise AlignError(traj.trajectory_id, f"turns_ref {ref!r}: no such file ({path})")
        try:
            for turn in read_jsonl(path, Turn):
                yield turn, path.parent
        except RecordError as err:
            raise AlignError(traj.trajectory_id, f"turns_ref {ref!r}: {err}") from None


# --------------------------------------------------------------------------------------------
# Merging turns into samples
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Open:
    """A sample being built: the segment's tokens so far, which are also its input_ids."""

    order: int  # call order of its first turn, to emit samples in that order
    aux: bool
    policy_version: int
    input_ids: list[int] = field(default_factory=list)  # [T]
    loss_mask: list[int] = field(default_factory=list)  # [T]
    logprobs: list[float] = field(default_factory=list)  # [sum(loss_mask)]
    mixed_policy: bool = False
    span_versions: list[int] = field(default_factory=list)  # per completion span
    span_lengths: list[int] = field(default_factory=list)
    spans: list[RoutingSpan] = field(default_factory=list)  # routing of positions [0, routed)
    routed: int = 0
    gap: bool = False  # a position after ``routed`` was computed by a call without routing
    has_routing: bool = False


class _Routing:
    """Reads and checks the Turns' routing chunks of one align call (headers cached)."""

    def __init__(self) -> None:
        self.layouts: dict[Path, RoutingLayout] = {}
        self.layout: RoutingLayout | None = None  # the first one seen: all must agree

    def add(self, traj_id: str, turn: Turn, folder: Path, open_: _Open) -> None:
        """Extend ``open_``'s routing by the positions ``turn``'s call computed after it."""
        ref = turn.routing
        end = (
            turn.prompt_len + len(turn.completion_ids) - 1
            if turn.completion_ids
            else turn.prompt_len
        )
        if ref is None:
            open_.gap = open_.gap or end > open_.routed
            return
        path = folder / ref.file
        try:
            layout = self.layouts.get(path) or self.layouts.setdefault(path, read_layout(path))
            if self.layout is not None and layout != self.layout:
                raise RoutingError(
                    f"{path}: routing of {layout.describe()}, but {self.layout.describe()} "
                    "elsewhere in this input"
                )
            self.layout = layout
            read_chunk(path, ref.row, ref.rows, ref.sha256, layout)  # checks length and checksum
        except RoutingError as err:
            raise AlignError(traj_id, str(err), turn) from None
        open_.has_routing = True
        if open_.gap or ref.start > open_.routed:
            open_.gap = True  # positions before this call's first row have no routing
            return
        new = ref.start + ref.rows - open_.routed
        if new > 0:
            open_.spans.append(
                RoutingSpan(
                    file=str(path.resolve()),
                    row=ref.row,
                    rows=ref.rows,
                    sha256=ref.sha256,
                    skip=open_.routed - ref.start,
                    count=new,
                    at=open_.routed,
                )
            )
            open_.routed += new


def _routing_prefix(old: _Open, fresh: _Open, n: int) -> None:
    """``fresh`` starts with ``old``'s first ``n`` tokens: they keep their routing."""
    fresh.has_routing = old.has_routing
    for span in old.spans:
        if span.at >= n:
            break
        count = min(span.count, n - span.at)
        fresh.spans.append(dataclasses.replace(span, count=count))
        fresh.routed = span.at + count
    fresh.gap = old.gap and old.routed < n


def _add_completion(traj_id: str, turn: Turn, open_: _Open) -> None:
    ids, lps = turn.completion_ids, turn.completion_logprobs
    if len(lps) != len(ids):
        raise AlignError(
            traj_id,
            f"{len(ids)} completion tokens but {len(lps)} log-probs: every loss token needs "
            "its rollout log-prob",
            turn,
        )
    if not all(math.isfinite(x) for x in lps):
        bad = next(i for i, x in enumerate(lps) if not math.isfinite(x))
        raise AlignError(traj_id, f"completion token {bad} has a non-finite log-prob", turn)
    open_.input_ids.extend(ids)
    open_.loss_mask.extend([1] * len(ids))
    open_.logprobs.extend(lps)
    if turn.policy_version != open_.policy_version:
        open_.mixed_policy = True
    open_.span_versions.append(turn.policy_version)
    open_.span_lengths.append(len(ids))


def _episode_samples(
    traj: Trajectory,
    turns: Iterable[tuple[Turn, Path]],
    include_aux: bool,
    stats: AlignStats,
    routing: _Routing,
) -> tuple[list[_Open], int]:
    """The episode's samples in call order of their first turn, and how many turns it had."""
    tid = traj.trajectory_id
    current: dict[tuple[str, int], _Open] = {}  # (session, segment) -> the sample it extends
    last_turn: dict[str, int] = {}  # session -> last turn index, to catch disorder
    last_segment: dict[str, int] = {}
    done: list[_Open] = []
    seen = aux_excluded = realigned = breaks = used = 0
    for turn, folder in turns:
        seen += 1
        prev = last_turn.get(turn.session)
        if prev is not None and turn.turn <= prev:
            raise AlignError(
                tid, f"comes after turn {prev} of its session: turns must be in call order", turn
            )
        last_turn[turn.session] = turn.turn
        if turn.segment < last_segment.get(turn.session, 0):
            raise AlignError(
                tid,
                f"is in segment {turn.segment} after segment {last_segment[turn.session]} "
                "of its session",
                turn,
            )
        last_segment[turn.session] = turn.segment
        if turn.flags.aux and not include_aux:
            aux_excluded += 1
            continue
        used += 1
        realigned += turn.flags.realigned > 0
        key = (turn.session, turn.segment)
        open_ = current.get(key)
        held = open_.input_ids if open_ is not None else []
        offset, delta = turn.prompt_offset, turn.prompt_delta
        if offset > len(held):
            raise AlignError(
                tid,
                f"prompt_offset {offset} points past the {len(held)} tokens its segment "
                f"{turn.segment} holds (a turn of the segment is missing, or out of order)",
                turn,
            )
        # The prompt is held[:offset] + delta. It extends held (previous prompt + completion)
        # when the tokens it replaces are the same ones: compare only that overlap.
        overlap = len(held) - offset
        extends = open_ is not None and len(delta) >= overlap and delta[:overlap] == held[offset:]
        if open_ is not None and extends:
            new = delta[overlap:]
            open_.input_ids.extend(new)
            open_.loss_mask.extend([0] * len(new))
        else:
            if open_ is not None:
                done.append(open_)
                breaks += 1
            fresh = _Open(order=seen, aux=turn.flags.aux, policy_version=turn.policy_version)
            fresh.input_ids = held[:offset] + delta
            fresh.loss_mask = [0] * len(fresh.input_ids)
            if open_ is not None:
                _routing_prefix(open_, fresh, offset)
            current[key] = open_ = fresh
        if not open_.input_ids:
            raise AlignError(tid, "has an empty prompt", turn)
        routing.add(tid, turn, folder, open_)
        _add_completion(tid, turn, open_)
    done.extend(current.values())
    done.sort(key=lambda s: s.order)
    stats.aux_turns_excluded += aux_excluded
    if done:
        stats.turns += used
        stats.realigned_turns += realigned
        stats.breaks += breaks
    return done, seen


def align(
    trajectories: Iterable[Trajectory],
    *,
    include_aux: bool = False,
    base_dir: Path | None = None,
    load_turns: TurnLoader | None = None,
    stats: AlignStats | None = None,
    skip_bad: bool = False,
    truncation: Truncation | None = None,
) -> Iterator[Sample]:
    """Samples of each trajectory, episode by episode, in input order.

    ``truncation`` (default: mask) sets the reward and weight of truncated episodes' samples.

    Turns come from ``load_turns(traj)`` when given, else inline or from ``turns_ref`` files
    relative to ``base_dir`` (``turns_of``). Raises ``AlignError`` (naming the trajectory and
    turn) for an episode that cannot be aligned; with ``skip_bad`` that episode is dropped,
    counted as ``invalid`` and its message kept in ``stats.errors`` instead.
    """
    stats = stats if stats is not None else AlignStats()
    rule = truncation if truncation is not None else Truncation()
    routing = _Routing()
    for traj in trajectories:
        stats.episodes_in += 1
        if traj.status in ENVIRONMENT_FAILURES:
            stats.drop(traj.status)
            continue
        if traj.reward is None:
            stats.drop(NO_REWARD)
            continue
        if load_turns is not None:
            folder = base_dir if base_dir is not None else Path.cwd()
            turns: Iterable[tuple[Turn, Path]] = ((t, folder) for t in load_turns(traj))
        else:
            turns = _turns_and_folders(traj, base_dir)
        try:
            opens, seen = _episode_samples(traj, turns, include_aux, stats, routing)
        except AlignError as err:
            if not skip_bad:
                raise
            stats.drop(INVALID)
            if len(stats.errors) < 20:
                stats.errors.append(str(err))
            continue
        if not opens:
            stats.drop(NO_TRAINABLE_TURNS if seen else NO_TURNS)
            continue
        stats.episodes += 1
        truncated = traj.status == "truncated"
        stats.truncated_episodes += truncated
        sampled = sum(len(o.logprobs) for o in opens)
        reward, weight = rule.shaped(traj.reward, sampled, truncated)
        stats.samples += len(opens)
        stats.max_samples_per_episode = max(stats.max_samples_per_episode, len(opens))
        for index, o in enumerate(opens):
            stats.aux_samples += o.aux
            stats.mixed_policy_samples += o.mixed_policy
            stats.trained_tokens += len(o.logprobs)
            stats.total_tokens += len(o.input_ids)
            stats.routed_samples += o.has_routing
            stats.routing_gaps += o.has_routing and o.routed < len(o.input_ids) - 1
            yield Sample(
                sample_id=f"{traj.trajectory_id}/{index}",
                episode_id=traj.trajectory_id,
                group_id=traj.group_id,
                segment_index=index,
                segment_count=len(opens),
                input_ids=o.input_ids,
                loss_mask=o.loss_mask,
                rollout_logprobs=o.logprobs,
                reward=reward,
                weight=weight,
                policy_version=o.policy_version,
                aux=o.aux,
                span_versions=o.span_versions,
                span_lengths=o.span_lengths,
                routing=o.spans if o.has_routing else None,
            )


# --------------------------------------------------------------------------------------------
# Fidelity: the trainer's log-probs against the rollout's, on the loss tokens
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Moments:
    """Running co-moments of paired values (Chan et al.'s parallel update), for Pearson."""

    n: int = 0
    mean_x: float = 0.0
    mean_y: float = 0.0
    m2_x: float = 0.0
    m2_y: float = 0.0
    c_xy: float = 0.0

    def merge(self, o: _Moments) -> None:
        if o.n == 0:
            return
        n = self.n + o.n
        dx, dy = o.mean_x - self.mean_x, o.mean_y - self.mean_y
        w = self.n * o.n / n
        self.m2_x += o.m2_x + dx * dx * w
        self.m2_y += o.m2_y + dy * dy * w
        self.c_xy += o.c_xy + dx * dy * w
        self.mean_x += dx * o.n / n
        self.mean_y += dy * o.n / n
        self.n = n

    def pearson(self) -> float | None:
        """None when undefined: fewer than two values, or one side constant."""
        if self.n < 2 or self.m2_x <= 0.0 or self.m2_y <= 0.0:
            return None
        return max(-1.0, min(1.0, self.c_xy / math.sqrt(self.m2_x * self.m2_y)))


@dataclass(slots=True, kw_only=True)
class SampleCheck:
    """Rollout vs trainer on one sample's loss tokens."""

    sample_id: str
    tokens: int
    pearson: float | None  # of probabilities; None when undefined
    mean_abs_diff: float  # mean |Δ log-prob|
    max_abs_diff: float
    k3_kl: float  # k3 estimate of KL(rollout ‖ trainer): mean of r - 1 - log r, r = p_train / p_rollout


class FidelityCheck:
    """Recompute every loss token's log-prob with ``model`` and compare with the rollout's.

    ``temperature`` must be the one the rollout sampled at: engines record log-probs of
    ``log_softmax(logits / T)``. Feed samples to ``score`` one at a time (memory stays one
    sample); ``report`` gives the overall figures.
    """

    def __init__(self, model: Any, *, temperature: float = 1.0, chunk: int | None = None) -> None:
        self.model = model
        self.temperature = temperature
        self.chunk = chunk
        self.checks: list[SampleCheck] = []
        self._moments = _Moments()
        self._abs_sum = 0.0
        self._abs_max = 0.0
        self._k3_sum = 0.0

    def trainer_logprobs(self, sample: Sample) -> list[float]:
        """The model's log-prob of each loss token of ``sample``, in order."""
        from legorl.engines.models import DEFAULT_LOGPROB_CHUNK, token_logprobs

        mask = sample.loss_mask
        first = next((i for i, m in enumerate(mask) if m), None)
        if first is None:
            return []
        if first == 0:
            raise ValueError(f"sample {sample.sample_id!r}: its first token is a loss token")
        lps = token_logprobs(
            self.model,
            sample.input_ids,
            start=first,
            temperature=self.temperature,
            chunk=self.chunk or DEFAULT_LOGPROB_CHUNK,
        )
        return [lp for lp, m in zip(lps, mask[first:], strict=True) if m]

    def score(self, sample: Sample) -> SampleCheck:
        import torch

        trainer = torch.tensor(self.trainer_logprobs(sample), dtype=torch.float64)  # [N]
        rollout = torch.tensor(sample.rollout_logprobs, dtype=torch.float64)  # [N]
        if trainer.shape != rollout.shape:
            raise ValueError(
                f"sample {sample.sample_id!r}: {rollout.numel()} rollout log-probs for "
                f"{trainer.numel()} loss tokens"
            )
        n = int(trainer.numel())
        diff = trainer - rollout  # log r, r = p_train / p_rollout
        absd = diff.abs()
        k3 = torch.expm1(diff) - diff
        x, y = rollout.exp(), trainer.exp()
        m = _Moments()
        if n:
            mx, my = float(x.mean()), float(y.mean())
            dx, dy = x - mx, y - my
            m = _Moments(n, mx, my, float(dx @ dx), float(dy @ dy), float(dx @ dy))
        check = SampleCheck(
            sample_id=sample.sample_id,
            tokens=n,
            pearson=m.pearson(),
            mean_abs_diff=float(absd.mean()) if n else 0.0,
            max_abs_diff=float(absd.max()) if n else 0.0,
            k3_kl=float(k3.mean()) if n else 0.0,
        )
        self._moments.merge(m)
        self._abs_sum += float(absd.sum())
        self._abs_max = max(self._abs_max, check.max_abs_diff)
        self._k3_sum += float(k3.sum())
        self.checks.append(check)
        return check

    def report(self) -> dict[str, Any]:
        """Overall figures over every loss token scored so far."""
        n = self._moments.n
        return {
            "samples": len(self.checks),
            "tokens": n,
            "pearson": self._moments.pearson(),
            "mean_abs_diff": self._abs_sum / n if n else None,
            "max_abs_diff": self._abs_max if n else None,
            "k3_kl": self._k3_sum / n if n else None,
            "temperature": self.temperature,
        }


def check_fidelity(
    samples: Iterable[Sample], model: Any, *, temperature: float = 1.0
) -> tuple[dict[str, Any], list[SampleCheck]]:
    """Score every sample with ``model``; the overall report and the per-sample checks."""
    check = FidelityCheck(model, temperature=temperature)
    for sample in samples:
        check.score(sample)
    return check.report(), check.checks
