"""`legorl train`: GSPO / GRPO / Dr.GRPO steps on Sample records, π_old recomputed by the trainer.

    legorl train samples.jsonl --model fixtures/models/tiny-qwen3 --out ckpt --metrics m.jsonl

Several processes, one copy of the loop each (CPU: gloo; GPU: NCCL, or FSDP with a config file):

    accelerate launch --multi_gpu --num_processes 2 -m legorl.cli.main train samples.jsonl \\
        --model fixtures/models/tiny-qwen3 --out ckpt --metrics m.jsonl
    accelerate launch --config_file fixtures/accelerate/fsdp-8gpu.yaml -m legorl.cli.main train …

(On a machine without CUDA, ``--multi_gpu`` only selects torchrun's launcher; the processes find
no GPU and join a gloo group on the CPU.) Several machines: ``--num_machines``, one launch per
machine (``legorl.train.distributed``). Rank 0 reads the samples and sends them to the other
ranks, which make the same plan; each runs its share of the micro-batches, and gradients are
averaged across processes. Each process's loss is scaled so that the average equals the
one-process loss over the whole step, so N processes give the same update as one (tested).

One call, top to bottom: read and check samples → advantages per group → per step: pack the
step's episodes into micro-batches → π_old (no grad) → log π_θ → loss → backward → clip → step
→ metrics; then the checkpoint (``save_pretrained`` + optimizer state + resolved config) and,
with ``push``, the proxy's weight reload.

π_old is the trainer's own log-prob of the sampled tokens under the weights the call starts from.
For the mini-batch trained first those are the weights of its own forward, so its π_old is that
forward's output, detached (``fuse_old_logprobs``, saving a pass); every other mini-batch gets a
no-grad pass before the first update.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from legorl.records import Metric, Sample, TrainerLogprobs
from legorl.train import lora
from legorl.train.checkpoint import (
    CONFIG_FILE,
    OPTIMIZER_FILE,
    STATE_FILE,
    Push,
    TrainError,
    push_weights,
    read_state,
    resume_optimizer,
    save_checkpoint,
    saved_optimizer,
    take_call_settings,
)
from legorl.train.config import TrainConfig
from legorl.train.correction import correction_weights, mismatch_metrics
from legorl.train.data import Batch, prepare_batch
from legorl.train.distributed import (
    gather_optimizer_state,
    parameter_names,
    scatter_optimizer_state,
    shared_samples,
)
from legorl.train.losses import LossOut, episode_sums, policy_loss
from legorl.train.model import TokenScorer, load_policy
from legorl.train.packing import MicroBatch, build_micro_batch, pack_lengths, padded_length
from legorl.train.params import (
    fold_scales,
    lr_param_groups,
    scale_only_parameters,
    trained_parameters,
)
from legorl.train.routing import (
    RouterReplay,
    RoutingSetupError,
    setup_routing,
)


@dataclass
class TrainResult:
    step: int  # global optimizer steps after this call
    updated: bool
    checkpoint: Path | None
    policy_version: int | None
    metrics: list[Metric] = field(default_factory=list)
    logprobs: list[TrainerLogprobs] = field(default_factory=list)  # π_old per sample (main)


# --------------------------------------------------------------------------------------------
# Planning a step: which micro-batches, on which process
# --------------------------------------------------------------------------------------------


@dataclass
class StepPlan:
    episodes: list[int]  # the step's episodes
    tokens: torch.Tensor  # [n] flat indices of their loss tokens
    mine: list[MicroBatch]  # this process's micro-batches
    n_micro: int  # micro-batches per process (the shorter ones run empty ones to keep step)
    all_micro: int
    spanning: set[int]  # episodes split over several micro-batches
    mine_spanning: list[MicroBatch]  # this process's micro-batches holding part of one
    n_spanning: int  # the most such micro-batches any process has
    real_tokens: int
    pad_tokens: int
    norm_tokens: int  # Dr.GRPO's constant for this step


def plan_step(
    batch: Batch, episodes: list[int], config: TrainConfig, rank: int, world: int, pad_id: int
) -> StepPlan:
    members = [batch.episode_samples[e] for e in episodes]
    lengths = [len(s.input_ids) for s in batch.samples]
    bins = pack_lengths(lengths, members, config.micro_batch_tokens)
    owner: dict[int, set[int]] = {}
    for b, sample_ids in enumerate(bins):
        for i in sample_ids:
            owner.setdefault(batch.sample_episode[i], set()).add(b)
    spanning = {e for e, bs in owner.items() if len(bs) > 1}
    with_spanning = {b for e in spanning for b in owner[e]}
    built, built_spanning = [], []
    for b, sample_ids in enumerate(bins):
        if b % world != rank:
            continue
        built.append(
            build_micro_batch(
                [batch.samples[i].input_ids for i in sample_ids],
                [batch.samples[i].loss_mask for i in sample_ids],
                [batch.token_offset[i] for i in sample_ids],
                samples=sample_ids,
                pad_to_multiple_of=config.pad_to_multiple_of,
                pad_id=pad_id,
            )
        )
        if b in with_spanning:
            built_spanning.append(built[-1])
    tokens = torch.cat(
        [
            torch.arange(
                batch.token_offset[i], batch.token_offset[i] + sum(batch.samples[i].loss_mask)
            )
            for m in members
            for i in m
        ]
        or [torch.zeros(0, dtype=torch.long)]
    )
    real = sum(lengths[i] for m in members for i in m)
    pad = sum(padded_length(sum(lengths[i] for i in b), config.pad_to_multiple_of) for b in bins)
    pad -= real
    norm = config.drgrpo_norm_tokens or max(
        (batch.episode_loss_tokens(e) for e in episodes), default=1
    )
    return StepPlan(
        episodes=episodes,
        tokens=tokens,
        mine=built,
        n_micro=-(-len(bins) // world),
        all_micro=len(bins),
        spanning=spanning,
        mine_spanning=built_spanning,
        n_spanning=max(sum(1 for b in with_spanning if b % world == r) for r in range(world)),
        real_tokens=real,
        pad_tokens=pad,
        norm_tokens=norm,
    )


def _empty_micro_batch(pad_id: int) -> MicroBatch:
    """One pad token, no loss tokens: keeps a process in step when it has run out of work."""
    return build_micro_batch([[pad_id]], [[0]], [0], samples=[])


# --------------------------------------------------------------------------------------------
# Small helpers the loop calls
# --------------------------------------------------------------------------------------------


def _accelerator(config: TrainConfig) -> Any:
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    return Accelerator(
        cpu=not torch.cuda.is_available(),
        mixed_precision="bf16" if config.precision == "bf16" else "no",
        kwargs_handlers=[
            DistributedDataParallelKwargs(find_unused_parameters=config.find_unused_parameters)
        ],
    )


def _score(
    scorer: Any, mb: MicroBatch, config: TrainConfig, device: Any, *, entropy: bool | str = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    mb = mb.to(device)
    routing: dict[str, Any] = {}
    if mb.routing is not None:  # MoE routing replay (train/routing.py)
        starts = mb.bounds[: len(mb.samples)]
        routing = {
            "routing": mb.routing,
            "routing_rows": list(zip(mb.samples, starts, strict=True)),
        }
    return scorer(
        mb.input_ids,
        mb.position_ids,
        mb.logit_index,
        mb.targets,
        entropy=entropy,
        **routing,
        **mb.attention_kwargs(config.attention),
    )


def _score_all(
    accelerator: Any,
    scorer: Any,
    batches: list[MicroBatch],
    n_forward: int,
    n_tokens: int,
    config: TrainConfig,
    pad_id: int,
) -> torch.Tensor:
    """No-grad log-probs of the loss tokens of ``batches`` (this process's), gathered on every
    process ([n_tokens] flat, NaN where no process scored). Every process runs ``n_forward``
    forwards, padding with empty ones: FSDP gathers weights in each forward, all together."""
    device = accelerator.device
    values = torch.zeros(n_tokens, dtype=torch.float32, device=device)
    hits = torch.zeros(n_tokens, dtype=torch.float32, device=device)
    with torch.no_grad(), accelerator.autocast():
        for mb in batches:
            logp, _ = _score(scorer, mb, config, device)
            values[mb.token_index.to(device)] = logp.float()
            hits[mb.token_index.to(device)] = 1.0
        for _ in range(n_forward - len(batches)):
            _score(scorer, _empty_micro_batch(pad_id), config, device)
    values, hits = accelerator.reduce(values, "sum"), accelerator.reduce(hits, "sum")
    return torch.where(hits > 0, values, torch.full_like(values, math.nan)).cpu()


def _batch_metrics(batch: Batch) -> dict[str, float | None]:
    """What the samples say, before any training: rewards and the groups that carry a signal."""
    has = len(batch.episode_ids) > 0
    return {
        "reward_mean": float(batch.reward.mean()) if has else None,
        "reward_std": float(batch.reward.std(unbiased=False)) if has else None,
        "groups": float(len(batch.group_ids)),
        "zero_variance_groups": float(batch.zero_variance_groups),
    }


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def _reset_peak_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak RSS


def _peak_memory_mb() -> float | None:
    """Peak GPU memory allocated (CUDA), else the process's peak RSS since the last reset."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return None


# --------------------------------------------------------------------------------------------
# One step's pieces: the loss of a micro-batch, its statistics, the step's metrics
# --------------------------------------------------------------------------------------------


@dataclass
class Tokens:
    """What the call knows per flat loss token ([N], in ``Batch`` order)."""

    batch: Batch
    config: TrainConfig
    old: torch.Tensor  # [N] log π_old, NaN until scored
    adv: torch.Tensor  # [N] the token's episode advantage

    def weights(self, idx: torch.Tensor) -> torch.Tensor:
        """Correction × sample weight of the tokens ``idx`` (π_old must be known there)."""
        c = self.config
        w = correction_weights(
            self.old[idx],
            self.batch.mu[idx],
            self.batch.token_episode[idx],
            len(self.batch.episode_ids),
            c.correction,
            tis_cap=c.tis_cap,
            token_low=c.token_mask_low,
            token_high=c.token_mask_high,
            seq_low=c.seq_mask_low,
            seq_high=c.seq_mask_high,
        )
        return w * self.batch.token_weight[idx]


@dataclass
class StepInputs:
    """What every micro-batch of one step shares."""

    plan: StepPlan
    fresh: bool  # π_old comes from this step's own forward (θ = θ_old)
    ep_tokens: torch.Tensor | None  # [E] kept tokens per episode; None: known per micro-batch
    current: torch.Tensor | None  # [N] no-grad log π_θ of split episodes (GSPO after step 1)
    fresh_old: torch.Tensor  # [N] π_old this process scored in a fresh step, 0 elsewhere


def step_inputs(tokens: Tokens, plan: StepPlan, fresh: bool, current: Any) -> StepInputs:
    """The step's sequence-level normalisers, the same on every process: kept loss tokens per
    episode (seq-mean-token-mean, the GSPO ratio); a masking correction in a fresh step knows
    them only after the forward (its episodes are whole in a micro-batch then)."""
    batch, config = tokens.batch, tokens.config
    ep_tokens = None
    if not (fresh and config.correction in ("token_mask", "seq_mask")):
        w_all = batch.token_weight[plan.tokens] if fresh else tokens.weights(plan.tokens)
        ep_tokens = episode_sums(
            (w_all > 0).float(), batch.token_episode[plan.tokens], len(batch.episode_ids)
        )
    fresh_old = torch.zeros(batch.n_tokens, dtype=torch.float32)
    return StepInputs(plan, fresh, ep_tokens, current, fresh_old)


def micro_batch_loss(
    mb: MicroBatch,
    logp: torch.Tensor,  # [n] log π_θ of mb's loss tokens, with grad
    entropy: torch.Tensor | None,  # [n]
    tokens: Tokens,
    step: StepInputs,
    ref: Any,
    device: Any,
) -> tuple[LossOut, torch.Tensor]:
    """The policy loss of one micro-batch and which of its tokens take part ([n] bool)."""
    batch, config = tokens.batch, tokens.config
    E = len(batch.episode_ids)
    idx = mb.token_index
    ep = batch.token_episode[idx].to(device)
    if step.fresh:  # π_old is this very forward, detached
        step.fresh_old[idx] = tokens.old[idx] = logp.detach().cpu()
    w = tokens.weights(idx).to(device)
    ept = episode_sums((w > 0).float(), ep, E) if step.ep_tokens is None else step.ep_tokens
    rest = None
    if step.current is not None:
        # GSPO's ratio of an episode split over micro-batches needs the current log-probs of
        # its tokens elsewhere
        plan = step.plan
        here = torch.isin(batch.token_episode[plan.tokens], batch.token_episode[idx].unique())
        away = plan.tokens[here & ~torch.isin(plan.tokens, idx)]
        diff = torch.where(tokens.weights(away) > 0, step.current[away] - tokens.old[away], 0.0)
        rest = episode_sums(diff, batch.token_episode[away], E).to(device)
    ref_logp = None
    if ref is not None:
        with torch.no_grad():
            ref_logp = _score(ref, mb, config, device)[0].float()
    gspo = config.algorithm == "gspo"
    res = policy_loss(
        config.algorithm,
        logp,
        tokens.old[idx].to(device),
        tokens.adv[idx].to(device),
        ep,
        w,
        ept.to(device),
        float(len(step.plan.episodes)),
        clip_low=config.gspo_clip_low if gspo else config.ppo_clip_low,
        clip_high=config.gspo_clip_high if gspo else config.ppo_clip_high,
        norm_tokens=float(step.plan.norm_tokens),
        rest=rest,
        ref=ref_logp,
        kl_coef=config.kl_coef,
        entropy=entropy.float() if entropy is not None else None,
        entropy_coef=config.entropy_coef,
    )
    return res, w > 0


@dataclass
class StepStats:
    """Sums over one step's micro-batches (of every process once ``reduce``d)."""

    loss: float = 0.0
    pg_loss: float = 0.0
    clipped: float = 0.0  # kept tokens whose clipped branch won
    kept: float = 0.0  # tokens that take part in the loss
    entropy: float = 0.0  # Σ entropy over kept tokens
    kl: float = 0.0  # Σ k3 KL to the reference over kept tokens
    routed: float = 0.0  # positions with recorded MoE routing (train/routing.py)
    routing_differ: float = 0.0  # of those, where the forward ran other experts than recorded
    router_disagree: float = 0.0  # where the trainer's own router chose other experts

    def add(self, res: LossOut, keep: torch.Tensor, entropy: torch.Tensor | None) -> None:
        self.loss += float(res.loss.detach())
        self.pg_loss += float(res.policy)
        self.clipped += float(res.terms.clipped.sum())
        self.kept += float(keep.sum())
        self.entropy += float(entropy.detach()[keep].sum()) if entropy is not None else 0.0
        self.kl += float(res.kl[keep].sum()) if res.kl is not None else 0.0

    def reduce(self, accelerator: Any) -> StepStats:
        names = [f.name for f in fields(self)]
        packed = torch.tensor([getattr(self, n) for n in names], dtype=torch.float64)
        summed = accelerator.reduce(packed.to(accelerator.device), "sum").cpu().tolist()
        return StepStats(**dict(zip(names, summed, strict=True)))


@dataclass
class StepTiming:
    step_s: float
    step_cpu_s: float  # this process's CPU time: steadier on a shared CPU
    old_logprob_s: float  # the no-grad π_old pass, counted on the first step


def step_metrics(
    stats: StepStats,
    plan: StepPlan,
    tokens: Tokens,
    *,
    grad_norm: float,
    timing: StepTiming,
    has_ref: bool,
    updated: bool,
) -> dict[str, float | None]:
    """The Metric values of one step, in the order they are written."""
    batch, kept = tokens.batch, max(stats.kept, 1.0)
    fidelity = mismatch_metrics(
        tokens.old[plan.tokens], batch.mu[plan.tokens], tokens.weights(plan.tokens)
    )
    return {
        **fidelity,
        "loss": stats.loss,
        "pg_loss": stats.pg_loss,
        "clip_fraction": stats.clipped / kept,
        "entropy": stats.entropy / kept,
        "kl_ref": stats.kl / kept if has_ref else None,
        "routing_mismatch": stats.routing_differ / stats.routed if stats.routed else None,
        "router_disagreement": stats.router_disagree / stats.routed if stats.routed else None,
        "grad_norm": grad_norm,
        "lr": tokens.config.lr,
        **_batch_metrics(batch),
        "advantage_std": float(batch.advantage[plan.episodes].std(unbiased=False)),
        "episodes": float(len(plan.episodes)),
        "loss_tokens": float(plan.tokens.numel()),
        "tokens": float(plan.real_tokens),
        "tokens_per_s": plan.real_tokens / timing.step_s if timing.step_s > 0 else None,
        "step_s": timing.step_s,
        "step_cpu_s": timing.step_cpu_s,
        "old_logprob_s": timing.old_logprob_s,
        "micro_batches": float(plan.all_micro),
        "padding_waste": plan.pad_tokens / max(plan.pad_tokens + plan.real_tokens, 1),
        "peak_memory_mb": _peak_memory_mb(),
        "updated": 1.0 if updated else 0.0,
    }


def trainer_logprobs(
    tokens: Tokens, step: int, replay: RouterReplay | None = None
) -> list[TrainerLogprobs]:
    """π_old of each sample's loss tokens, for ``legorl inspect`` (samples with a token no
    process scored are left out)."""
    batch, out = tokens.batch, []
    for i, sample in enumerate(batch.samples):
        start = batch.token_offset[i]
        lps = tokens.old[start : start + len(sample.rollout_logprobs)]
        if not bool(lps.isnan().any()):
            out.append(
                TrainerLogprobs(
                    sample_id=sample.sample_id,
                    logprobs=lps.tolist(),
                    step=step,
                    policy_version=sample.policy_version,
                    routing_differs=replay.differs.get(i) if replay is not None else None,
                )
            )
    return out


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------


def train(
    samples: Iterable[Sample],
    *,
    model: str | Path,
    out: str | Path | None,
    config: TrainConfig,
    dry_run: bool = False,
    push: Push | None = None,
    skip_bad: bool = False,
    emit: Callable[[Metric], None] | None = None,
    log: Callable[[str], None] | None = None,
    run: dict[str, Any] | None = None,
) -> TrainResult:
    """Run ``config.steps`` optimizer steps on ``samples`` starting from the weights in ``model``;
    save to ``out`` (unless ``dry_run``) and push to the proxy (with ``push``)."""
    from accelerate.utils import DistributedType, set_seed

    from legorl.engines.models import max_context_of

    model_dir, out_dir = Path(model), Path(out) if out is not None else None
    if not dry_run and out_dir is None:
        raise TrainError("--out is needed unless --dry-run")
    accelerator = _accelerator(config)
    main = accelerator.is_main_process
    say = log if (log is not None and main) else (lambda _msg: None)
    metrics: list[Metric] = []

    def record(step: int, name: str, value: float | None) -> None:
        if value is not None and not math.isfinite(value):
            value = None
        m = Metric(step=step, name=name, value=value, time=time.time(), source="train")
        metrics.append(m)
        if emit is not None and main:
            emit(m)

    # ---- model, optimizer, resumed state ---------------------------------------------------
    set_seed(config.seed)
    state = read_state(model_dir) if config.resume else {}
    lora.check_start(model_dir, out_dir, config, state)
    lm = load_policy(lora.base_of(model_dir), attention=config.attention)
    if config.gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    text_config = lm.config.get_text_config(decoder=True)
    pad_id = text_config.pad_token_id if text_config.pad_token_id is not None else 0
    adapted = lora.attach(lm, model_dir, config) if config.lora else None  # lm, adapted in place
    scorer = TokenScorer(lm, temperature=config.temperature, chunk=config.logprob_chunk)
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    if fsdp and (config.scale_only or config.lora):
        raise TrainError("scale_only and lora: not built for FSDP; leave them off there")
    if adapted is not None:
        params = lora.trainable(adapted)
    else:
        params = trained_parameters(lm, config.train_params)
        params = scale_only_parameters(lm, params, config)
    groups = lr_param_groups(lm, params, config)
    optimizer = torch.optim.AdamW(
        groups,
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
    )
    # FSDP shards Adam's moments: they are gathered to save and scattered to resume, in the
    # one-process layout (legorl.train.distributed), once the model is sharded
    names = parameter_names(scorer, optimizer) if fsdp else []
    if not fsdp and config.resume and resume_optimizer(optimizer, groups, state, model_dir, config):
        say(f"resumed optimizer state from {model_dir / OPTIMIZER_FILE}")
    scorer, optimizer = accelerator.prepare(scorer, optimizer)
    saved = saved_optimizer(state, model_dir, config) if fsdp and config.resume else None
    if saved is not None:
        scatter_optimizer_state(scorer, optimizer.optimizer, saved, names, main)
        take_call_settings(optimizer, groups, config)
        say(f"resumed optimizer state from {saved} (sharded over {accelerator.num_processes})")
    ref = None
    if config.kl_coef > 0:
        ref_lm = lora.load_merged(config.ref_model or model_dir, attention=config.attention)
        ref = TokenScorer(ref_lm, temperature=config.temperature, chunk=config.logprob_chunk)
        ref.requires_grad_(False).to(accelerator.device)
    global_step = int(state.get("global_step", 0))

    # ---- data: checked samples, advantages, mini-batches ------------------------------------
    batch = prepare_batch(
        shared_samples(samples, accelerator),  # read by rank 0 alone, sent to the others
        config,
        vocab_size=int(text_config.vocab_size),
        max_len=max_context_of(lm),
        keep_zero_variance=dry_run,
        skip_bad=skip_bad,
        on_skip=lambda msg: say(f"skipped episode: {msg}"),
    )
    if batch.counts["samples_read"] == 0:
        raise TrainError("no samples in the input")
    try:
        replay = setup_routing(lm, batch, config, model_dir)
    except RoutingSetupError as exc:
        raise TrainError(str(exc)) from None
    accelerator.unwrap_model(scorer).replay = replay
    if replay is not None and replay.masked_tokens:
        say(f"router_replay_missing=mask: {replay.masked_tokens} loss tokens without routing")
    say(
        f"{len(batch.samples)} samples, {len(batch.episode_ids)} episodes in "
        f"{len(batch.group_ids)} groups ({batch.zero_variance_groups} with equal rewards), "
        f"{batch.n_tokens} loss tokens; {accelerator.num_processes} process(es)"
    )
    world, rank = accelerator.num_processes, accelerator.process_index
    chunks = batch.mini_batches(
        config.mini_batch_episodes, shuffle=config.shuffle, seed=config.seed
    )
    plans = [plan_step(batch, c, config, rank, world, pad_id) for c in chunks if c]
    if replay is not None:  # each micro-batch carries its row's recorded routing
        for mb in (mb for plan in plans for mb in plan.mine):
            replay.attach(mb, batch)
    N = batch.n_tokens
    tokens = Tokens(
        batch,
        config,
        old=torch.full((N,), math.nan),
        adv=batch.advantage[batch.token_episode] if N else torch.zeros(0),
    )

    # π_old of the first mini-batch may come from its own first forward (θ = θ_old there), unless
    # a masking correction needs the whole of an episode that is split over micro-batches
    fuse_first = (
        bool(plans)
        and config.fuse_old_logprobs
        and not (plans[0].spanning and config.correction in ("token_mask", "seq_mask"))
    )
    t0 = time.perf_counter()
    for k, plan in enumerate(plans):
        if k == 0 and fuse_first:
            continue
        scored = _score_all(accelerator, scorer, plan.mine, plan.n_micro, N, config, pad_id)
        tokens.old = torch.where(scored.isnan(), tokens.old, scored)
    old_pass_s = time.perf_counter() - t0

    # ---- the loop ---------------------------------------------------------------------------
    updated = False
    device = accelerator.device
    want_entropy = "grad" if config.entropy_coef > 0 else "value"  # a gradient only in the loss
    for i in range(config.steps if plans else 0):
        plan = plans[i % len(plans)]
        step = global_step + 1
        _reset_peak_memory()
        t_step, cpu_step = time.perf_counter(), time.process_time()
        current = None
        if config.algorithm == "gspo" and plan.spanning and i != 0:
            current = _score_all(
                accelerator, scorer, plan.mine_spanning, plan.n_spanning, N, config, pad_id
            )
        inputs = step_inputs(tokens, plan, i == 0 and fuse_first, current)

        stats = StepStats()
        work = plan.mine + [_empty_micro_batch(pad_id)] * (plan.n_micro - len(plan.mine))
        for j, mb in enumerate(work):
            # gradients are averaged across processes only at the last micro-batch
            sync = contextlib.nullcontext() if j == len(work) - 1 else accelerator.no_sync(scorer)
            with sync, accelerator.autocast():
                logp, entropy = _score(scorer, mb, config, device, entropy=want_entropy)
                if mb.n_loss == 0:  # an empty micro-batch keeps this process in step
                    accelerator.backward(logp.float().sum() * 0.0)
                    continue
                res, keep = micro_batch_loss(mb, logp.float(), entropy, tokens, inputs, ref, device)
                # DDP/FSDP average over processes: scale so the average is the whole step's loss
                accelerator.backward(res.loss * world)
            stats.add(res, keep, entropy)
        if replay is not None:
            stats.routed, stats.routing_differ, stats.router_disagree = replay.take()
        if inputs.fresh:  # every process now learns π_old of the tokens the others scored
            gathered = accelerator.reduce(inputs.fresh_old.to(device), "sum").cpu()
            tokens.old[plan.tokens] = gathered[plan.tokens]
        stats = stats.reduce(accelerator)

        grad_norm = float(accelerator.clip_grad_norm_(scorer.parameters(), config.max_grad_norm))
        if not dry_run:
            optimizer.step()
            updated = True
            global_step = step
        optimizer.zero_grad(set_to_none=True)

        timing = StepTiming(
            step_s=time.perf_counter() - t_step,
            step_cpu_s=time.process_time() - cpu_step,
            old_logprob_s=old_pass_s if i == 0 else 0.0,
        )
        values = step_metrics(
            stats,
            plan,
            tokens,
            grad_norm=grad_norm,
            timing=timing,
            has_ref=ref is not None,
            updated=not dry_run,
        )
        for name, value in values.items():
            record(step, name, value)
        say(
            f"step {step}: loss {values['loss']:.4g}, grad norm {grad_norm:.3g}, "
            f"pearson {_fmt(values['rollout_trainer_pearson'])}, "
            f"reward {_fmt(values['reward_mean'])}, {plan.real_tokens} tokens in "
            f"{timing.step_s:.2f}s" + (" (dry run)" if dry_run else "")
        )
    if not plans:
        say("no trainable episodes (every group has equal rewards): weights unchanged")
        for name, value in {**_batch_metrics(batch), "updated": 0.0}.items():
            record(global_step + 1, name, value)
    start_step = int(state.get("global_step", 0)) + 1
    pi_old = trainer_logprobs(tokens, start_step, replay) if main else []

    # ---- checkpoint and weight sync ---------------------------------------------------------
    version = None
    if dry_run or out_dir is None:
        return TrainResult(global_step, False, None, None, metrics, pi_old)
    new_state = {
        "global_step": global_step,
        "base_model": str(state.get("base_model", lora.base_of(model_dir))),
        "parent": str(model_dir),
        "samples": len(batch.samples),
        "train_params": config.train_params,  # whose moments optimizer.pt holds
        "lr_group_patterns": [pattern for pattern, _ in config.lr_group_entries()],
        "scale_only": config.scale_only,  # and which of them as one scalar each
        "lora": lora.state_of(config, adapted) if adapted is not None else None,
    }
    run = {**(run or {}), "model": str(model_dir), "processes": world}
    if adapted is not None and not config.merge:
        files = {"optimizer": OPTIMIZER_FILE, "state": STATE_FILE, "config": CONFIG_FILE}
        lora.save_adapter(
            accelerator, adapted, optimizer, out_dir, config=config, state=new_state, run=run,
            files=files,
        )  # fmt: skip
    else:
        if adapted is not None:
            lora.merge(adapted, out_dir)  # merged full weights; the adapter's moments dropped
        fold_scales(accelerator.unwrap_model(scorer).lm)
        opt_state = None
        if adapted is None:
            opt_state = (
                gather_optimizer_state(scorer, optimizer.optimizer, names, main)
                if fsdp
                else optimizer.state_dict()
            )
        save_checkpoint(
            accelerator,
            scorer,
            opt_state,
            out_dir,
            model_dir=lora.base_of(model_dir),
            config=config,
            state=new_state,
            run=run,
        )
    say(f"checkpoint: {out_dir}")
    if push is not None and main:
        version = push_weights(push, out_dir)
        record(global_step, "policy_version", float(version))
        say(f"pushed to {push.url}: policy version {version}")
    return TrainResult(global_step, updated, out_dir, version, metrics, pi_old)
