"""MoE routing replay in the trainer (``router_replay=r3``): the forward runs the experts the
rollout engine chose, gate weights from the trainer's own router; what it buys against a bf16
engine; the bad inputs it refuses.

Samples are real: a bf16 embedded engine serving tiny-qwen3-moe samples sessions through the
proxy (``legorl.bench.routing.routed_sessions``), align carries the recorded routing into them.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_helpers import MODEL, MOE, ROOT, legorl, load_weights

from legorl.bench.routing import routed_samples
from legorl.engines.models import load_model
from legorl.monitors import Monitor, MonitorConfig
from legorl.records import Metric, Sample, read_jsonl, write_jsonl
from legorl.routing import RoutingLayout, RoutingWriter, router_modules
from legorl.train.checkpoint import TrainError
from legorl.train.config import TrainConfig
from legorl.train.routing import RouterReplay
from legorl.train.trainer import train

pytestmark = pytest.mark.xdist_group("moe-routing")


@pytest.fixture(scope="module")
def samples(tmp_path_factory: pytest.TempPathFactory) -> list[Sample]:
    return routed_samples(tmp_path_factory.mktemp("bf16"), dtype="bfloat16", groups=2)


def _run(samples: list[Sample], **overrides: object) -> dict[tuple[int, str], float | None]:
    config = TrainConfig(**overrides)  # type: ignore[arg-type]
    result = train(samples, model=MOE, out=None, config=config, dry_run=True)
    return {(m.step, m.name): m.value for m in result.metrics}


def test_replay_closes_the_routing_gap_to_a_bf16_engine(samples: list[Sample]) -> None:
    assert all(s.routing for s in samples)
    off = _run(samples, router_replay="off")
    r3 = _run(samples, router_replay="r3")
    # the control: without replay the fp32 trainer routes some tokens elsewhere than the engine
    assert off[(1, "routing_mismatch")] is not None and off[(1, "routing_mismatch")] > 0
    assert off[(1, "router_disagreement")] == off[(1, "routing_mismatch")]
    # with it, every recorded token runs the engine's experts; the trainer's own router would
    # still disagree (that is what replay overrides)
    assert r3[(1, "routing_mismatch")] == 0.0
    # (not exactly as often: replayed experts in one layer change the next layer's input)
    assert (r3[(1, "router_disagreement")] or 0) > 0
    p_off, p_r3 = off[(1, "rollout_trainer_pearson")], r3[(1, "rollout_trainer_pearson")]
    assert p_off is not None and p_r3 is not None and p_r3 >= p_off
    big_off, big_r3 = off[(1, "logprob_diff_over_0.1")], r3[(1, "logprob_diff_over_0.1")]
    assert big_off is not None and big_r3 is not None and big_r3 <= big_off
    # the monitor alerts on the run without replay, and not on the one with it
    for run, kinds in ((off, ["routing"]), (r3, [])):
        monitor = Monitor(MonitorConfig(max_routing_mismatch=0.005), stream=None)
        for (step, name), value in run.items():
            monitor.observe_metric(Metric(step=step, name=name, value=value))
        assert [a.kind for a in monitor.alerts if a.kind == "routing"] == kinds


def test_replay_hook_runs_the_recorded_experts_and_keeps_the_router_gradient() -> None:
    lm = load_model(MOE)
    lm.requires_grad_(True)
    ids = torch.tensor([list(range(20, 60))])
    own: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, i, o: own.append(o[2])) for r in router_modules(lm)]
    with torch.no_grad():
        base = lm(input_ids=ids).logits
    for h in hooks:
        h.remove()
    routing = torch.stack(own)  # [L, T, k], the model's own choice
    replay = RouterReplay(lm, replay=True)
    replay.use(routing)
    same = lm(input_ids=ids).logits
    assert torch.equal(same, base)  # its own routing, replayed: the same arithmetic
    same.float().logsumexp(-1).sum().backward()
    gate = router_modules(lm)[0].weight
    assert gate.grad is not None and float(gate.grad.abs().sum()) > 0  # the router still learns
    assert replay.take() == (40, 0, 0)
    other = routing.clone()
    other[:, 10:] = (other[:, 10:] + 1) % 4  # other experts from position 10 on
    replay.use(other)
    with torch.no_grad():
        moved = lm(input_ids=ids).logits
    assert torch.equal(moved[:, :10], base[:, :10]) and not torch.allclose(moved, base)
    unrecorded = other.clone()
    unrecorded[:, 10:] = -1  # no recording there: the model's own routing
    replay.use(unrecorded)
    with torch.no_grad():
        assert torch.equal(lm(input_ids=ids).logits, base)


@pytest.mark.parametrize("algorithm", ["gspo", "grpo", "drgrpo"])
def test_replay_trains_with_packing_micro_batches_and_pi_old_passes(
    samples: list[Sample], algorithm: str, tmp_path: Path
) -> None:
    # micro-batches of one sample, two mini-batches: the second's π_old is a no-grad pass, and
    # GSPO's split episodes get a current-log-prob pass
    config = TrainConfig(
        algorithm=algorithm,  # type: ignore[arg-type]
        router_replay="r3",
        steps=2,
        mini_batch_episodes=2,
        micro_batch_tokens=64,
        shuffle=False,
        lr=1e-3,
        gspo_clip_low=0.2,
        gspo_clip_high=0.2,
    )
    result = train(samples, model=MOE, out=tmp_path, config=config)
    got = {(m.step, m.name): m.value for m in result.metrics}
    assert sorted({s for s, _ in got}) == [1, 2]
    steps = [1, 2]
    for step in steps:
        assert got[(step, "routing_mismatch")] == 0.0
        assert (got[(step, "micro_batches")] or 0) > 1
        assert (got[(step, "grad_norm")] or 0) > 0
    gate = next(k for k in load_weights(MOE) if "mlp.gate.weight" in k)
    moved = load_weights(tmp_path)[gate] - load_weights(MOE)[gate]
    assert float(moved.abs().max()) > 0  # the routers trained under replay


# ---- bad input ---------------------------------------------------------------------------------


def test_replay_on_a_dense_model_is_refused(samples: list[Sample]) -> None:
    plain = [dataclasses.replace(s, routing=None) for s in samples]
    config = TrainConfig(router_replay="r3")
    with pytest.raises(TrainError, match=rf"router_replay=r3: the model at {MODEL} is dense"):
        train(plain, model=MODEL, out=None, config=config, dry_run=True)


def test_missing_routing_is_refused_or_masked_and_counted(samples: list[Sample]) -> None:
    gone = samples[1]
    broken = [dataclasses.replace(gone, routing=(gone.routing or [])[:1]), *samples[2:]]
    broken.insert(0, samples[0])
    with pytest.raises(TrainError, match=rf"sample {gone.sample_id!r} has no recorded routing"):
        _run(broken, router_replay="r3")
    logs: list[str] = []
    config = TrainConfig(router_replay="r3", router_replay_missing="mask")
    result = train(broken, model=MOE, out=None, config=config, dry_run=True, log=logs.append)
    assert any("router_replay_missing=mask:" in line and "loss tokens" in line for line in logs)
    got = {m.name: m.value for m in result.metrics}
    assert (got["masked_fraction"] or 0) > 0  # those tokens carry no loss
    # without replay, samples lacking routing are simply not compared
    _run(broken, router_replay="off")


def _with_sidecar(s: Sample, path: Path, layout: RoutingLayout, rows: int) -> Sample:
    import numpy as np

    with RoutingWriter(path, layout) as w:
        row, sha = w.append(np.zeros((rows, layout.layers, layout.k), dtype=np.uint8))
    span = dataclasses.replace((s.routing or [])[0], file=str(path), row=row, rows=rows, sha256=sha)
    span = dataclasses.replace(span, skip=0, count=min(span.count, rows))
    return dataclasses.replace(s, routing=[span])


def test_a_sidecar_of_another_shape_or_a_bad_checksum_names_the_file(
    samples: list[Sample], tmp_path: Path
) -> None:
    n = len(samples[0].input_ids)
    for layout in (RoutingLayout(3, 2, 4), RoutingLayout(2, 1, 4), RoutingLayout(2, 2, 8)):
        path = tmp_path / f"{layout.layers}-{layout.k}-{layout.experts}.routing"
        bad = [_with_sidecar(samples[0], path, layout, n), *samples[1:]]
        with pytest.raises(TrainError, match=rf"{path}: routing of {layout.describe()}, but the model has 2 layers x top-2 of 4 experts"):  # fmt: skip
            _run(bad, router_replay="r3")
    path = tmp_path / "ok.routing"
    good = _with_sidecar(samples[0], path, RoutingLayout(2, 2, 4), n)
    raw = bytearray(path.read_bytes())
    raw[20] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(TrainError, match=rf"{path}: checksum mismatch"):
        _run([good, *samples[1:]], router_replay="off")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_replay_as_one(samples: list[Sample], tmp_path: Path) -> None:
    data = tmp_path / "samples.jsonl"
    write_jsonl(data, samples)
    config = ["lr=5.0", "adam_eps=1000.0", "micro_batch_tokens=64", "shuffle=false"]
    config += ["router_replay=r3", "gspo_clip_low=0.05", "gspo_clip_high=0.05"]
    args = ["train", str(data), "--model", str(MOE), "--steps", "1", *config]
    one = legorl(*args, "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr.decode()
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(_free_port()),
        "-m", "legorl.cli.main", *args, "--out", str(tmp_path / "two"),
        "--metrics", str(tmp_path / "two.jsonl"),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    two = subprocess.run(cmd, capture_output=True, cwd=ROOT, env=env, timeout=600)
    assert two.returncode == 0, two.stderr.decode()[-3000:]
    a, b = load_weights(tmp_path / "one"), load_weights(tmp_path / "two")
    base = load_weights(MOE)
    gate = next(k for k in a if "mlp.gate.weight" in k)
    assert float((a[gate] - base[gate]).abs().max()) > 1e-4  # the router learned under replay
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    # each process replayed its share: the gathered mismatch is 0 over every recorded token
    got = {m.name: m.value for m in read_jsonl(tmp_path / "two.jsonl", Metric)}
    assert got["routing_mismatch"] == 0.0 and (got["router_disagreement"] or 0) > 0


def test_trainer_logprobs_say_which_tokens_it_routed_elsewhere(
    samples: list[Sample], tmp_path: Path
) -> None:
    from legorl.inspect.render import ROUTED_ELSEWHERE, token_text

    result = train(samples, model=MOE, out=None, config=TrainConfig(), dry_run=True)
    by_id = {s.sample_id: s for s in samples}
    differs = {r.sample_id: r.routing_differs for r in result.logprobs}
    assert all(d is not None for d in differs.values())
    flagged = {sid: d for sid, d in differs.items() if d}
    assert flagged  # bf16 against fp32: some tokens route elsewhere
    total = sum(len(d) for d in flagged.values())
    positions = sum(len(s.input_ids) - 1 for s in samples)
    got = {m.name: m.value for m in result.metrics}
    assert total / positions == pytest.approx(got["router_disagreement"], abs=1e-9)
    sid, where = next(iter(flagged.items()))
    text = token_text(by_id[sid], None, None, "routing", where)
    styled = {span.start for span in text.spans if span.style == ROUTED_ELSEWHERE}
    starts = [0]
    for token_id in by_id[sid].input_ids:
        starts.append(starts[-1] + len(f"⟨{token_id}⟩"))
    assert styled == {starts[p] for p in where}
    # the control: an fp32 engine routes as the fp32 trainer does, nothing is flagged
    plain = routed_samples(tmp_path, dtype="float32", groups=1, group_size=2, calls=1)
    control = train(plain, model=MOE, out=None, config=TrainConfig(), dry_run=True)
    assert [r.routing_differs for r in control.logprobs] == [[]] * len(plain)


def test_router_replay_off_as_an_override_is_the_word_not_a_boolean() -> None:
    from legorl.train.config import build_config

    # YAML 1.1 reads a bare off as false
    assert build_config(None, ["router_replay=off"]).router_replay == "off"
    assert build_config(None, ["router_replay=r3"]).router_replay == "r3"
