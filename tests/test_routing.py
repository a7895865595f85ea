"""MoE routing capture and bookkeeping: the embedded engine records the experts each MoE layer
chose, the proxy writes them to a sidecar beside the Turns, align carries them into Samples
position by position; bad sidecars are refused naming the file.

Real parts: the tiny Qwen3-MoE fixture (2 MoE layers, top-2 of 4 experts) served by the
embedded engine, the real proxy core, align over the real Turn files. The reference routing
is a plain fp32 forward of the whole sample through transformers with a hook on each router.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import orjson
import pytest

from legorl.align import AlignError, AlignStats, align
from legorl.engines import EmbeddedEngine, make_engine
from legorl.engines.models import load_model
from legorl.protocols import GenerationRequest
from legorl.proxy.core import ProxyConfig, ProxyCore
from legorl.records import RoutingRef, Trajectory, Turn, read_jsonl
from legorl.routing import (
    ChunkReader,
    RoutingCapture,
    RoutingError,
    RoutingLayout,
    RoutingWriter,
    layout_of,
    read_chunk,
    router_modules,
)

ROOT = Path(__file__).resolve().parents[1]
MOE = ROOT / "fixtures" / "models" / "tiny-qwen3-moe"
DENSE = ROOT / "fixtures" / "models" / "tiny-qwen3"
LAYOUT = RoutingLayout(2, 2, 4)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]


def reference_routing(ids: list[int]) -> np.ndarray:
    """[T, layers, k] expert ids of a plain fp32 forward over ``ids``."""
    import torch

    model = load_model(MOE)
    got: list[torch.Tensor] = []
    hooks = [
        r.register_forward_hook(lambda m, i, o: got.append(o[2])) for r in router_modules(model)
    ]
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return torch.stack(got).permute(1, 0, 2).numpy()


def same_sets(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[T] True where every layer chose the same set of experts."""
    return (np.sort(a, -1) == np.sort(b, -1)).all(-1).all(-1)


# ---- the sidecar format ------------------------------------------------------------------------


def test_sidecar_round_trips_and_refuses_corruption_and_other_shapes(tmp_path: Path) -> None:
    path = tmp_path / "s.routing"
    a = np.array([[[0, 1], [2, 3]], [[3, 2], [1, 0]]], dtype=np.uint8)  # [2, L, k]
    b = np.array([[[1, 2], [0, 3]]], dtype=np.uint8)
    with RoutingWriter(path, LAYOUT) as w:
        (ra, sa), (rb, sb) = w.append(a), w.append(b)
    with RoutingWriter(path, LAYOUT) as w:  # reopened: appends after what is there
        rc, _ = w.append(b)
    assert (ra, rb, rc) == (0, 2, 3)
    assert (read_chunk(path, ra, 2, sa, LAYOUT) == a).all()
    assert (read_chunk(path, rb, 1, sb, LAYOUT) == b).all()
    # each check names the file
    with pytest.raises(
        RoutingError,
        match=rf"{path}: routing of 2 layers x top-2 of 4 experts, but the model has 3 layers",
    ):
        read_chunk(path, ra, 2, sa, RoutingLayout(3, 2, 4))
    with pytest.raises(RoutingError, match=rf"{path}: holds routing of 2 layers"):
        RoutingWriter(path, RoutingLayout(2, 2, 8))
    with pytest.raises(RoutingError, match="past the end"):
        read_chunk(path, 3, 5, sb, LAYOUT)
    raw = bytearray(path.read_bytes())
    raw[16] ^= 1  # first row's first id
    path.write_bytes(bytes(raw))
    with pytest.raises(RoutingError, match=rf"{path}: checksum mismatch in rows 0..2"):
        read_chunk(path, ra, 2, sa, LAYOUT)
    assert (read_chunk(path, rb, 1, sb, LAYOUT) == b).all()  # other chunks are unharmed
    with pytest.raises(RoutingError, match="routing sidecar not found"):
        read_chunk(tmp_path / "gone.routing", 0, 1, sa)
    (tmp_path / "x.routing").write_bytes(b"not a sidecar at all")
    with pytest.raises(RoutingError, match="not a legorl routing sidecar"):
        read_chunk(tmp_path / "x.routing", 0, 1, sa)


def test_layout_of_the_fixtures() -> None:
    assert layout_of(load_model(MOE)) == LAYOUT
    assert layout_of(load_model(DENSE)) is None


# ---- the embedded engine -----------------------------------------------------------------------


def test_embedded_engine_captures_prefill_and_decode_routing_batched_and_reused() -> None:
    async def run() -> list[tuple[list[int], list[int], RoutingCapture]]:
        engine = make_engine("embedded", model_path=str(MOE), prefill_chunk=7)
        assert isinstance(engine, EmbeddedEngine)
        try:
            prompts = [list(range(5, 40)), list(range(100, 121))]

            async def one(prompt: list[int], key: str, n: int) -> tuple:
                cap = RoutingCapture()
                req = GenerationRequest(
                    prompt_ids=prompt, max_tokens=n, temperature=0, routing=cap, cache_key=key
                )
                toks = [s.token_id async for ch in engine.generate(req) for s in ch]
                return prompt, toks, cap

            # two at once: they decode in one batch
            first = await asyncio.gather(*(one(p, f"k{i}", 9) for i, p in enumerate(prompts)))
            assert engine.stats.batched_steps > 0
            p0, t0, _ = first[0]
            # the same session extends its prompt: the cached prefix is not recomputed
            again = await one(p0 + t0 + [7, 8, 9], "k0", 4)
            assert engine.stats.reused_tokens > 0
            return [*first, again]
        finally:
            await engine.close()

    (p0, t0, c0), (p1, t1, c1), (p2, t2, c2) = asyncio.run(run())
    for prompt, toks, cap in ((p0, t0, c0), (p1, t1, c1)):
        assert cap.layout == LAYOUT and cap.start == 0
        rows = cap.rows(len(prompt) + len(toks) - 1)
        assert rows.shape == (len(prompt) + len(toks) - 1, 2, 2)
        assert same_sets(rows, reference_routing(prompt + toks)[: len(rows)]).all()
    # the reusing call starts where the cache ended: the first call's tokens minus its last
    assert c2.start == len(p0) + len(t0) - 1
    rows = c2.rows(len(p2) + len(t2) - 1)
    ref = reference_routing(p2 + t2)
    assert same_sets(rows, ref[c2.start : c2.start + len(rows)]).all()


def test_dense_model_leaves_the_capture_empty() -> None:
    async def run() -> RoutingCapture:
        engine = make_engine("embedded", model_path=str(DENSE))
        cap = RoutingCapture()
        req = GenerationRequest(prompt_ids=[5, 6, 7], max_tokens=3, routing=cap)
        try:
            [s async for ch in engine.generate(req) for s in ch]
        finally:
            await engine.close()
        return cap

    assert asyncio.run(run()).layout is None


# ---- the proxy and align -----------------------------------------------------------------------


def _chat(core: ProxyCore, session: str, messages: list[dict]) -> dict:
    body = orjson.dumps(
        {"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 12, "temperature": 0}
    )
    res = asyncio.get_event_loop().run_until_complete(
        core.handle("POST", f"/s/{session}/v1/chat/completions", "", {}, body)
    )
    assert res.status == 200, res.body
    assert isinstance(res.body, bytes)
    return orjson.loads(res.body)


@pytest.fixture(scope="module")
def session_turns(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three calls of one session through the proxy on the MoE fixture; the third rewrites
    history, so it opens a new segment."""
    out = tmp_path_factory.mktemp("turns")
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    engine = make_engine("embedded", model_path=str(MOE))
    core = ProxyCore(ProxyConfig(model=MOE, out=out), engine)
    try:
        msgs = [{"role": "user", "content": "list the files please"}]
        a = _chat(core, "s1", msgs)["choices"][0]["message"]["content"]
        msgs += [{"role": "assistant", "content": a}, {"role": "user", "content": "and now?"}]
        _chat(core, "s1", msgs)
        _chat(core, "s1", [{"role": "user", "content": "something else entirely"}])
        core.close()
    finally:
        loop.run_until_complete(engine.close())
        loop.close()
    return out


def _trajectory(turns_dir: Path) -> Trajectory:
    return Trajectory(
        trajectory_id="t1",
        task_id="x",
        group_id="g",
        sample_index=0,
        harness="mini",
        status="ok",
        turns_ref=[str(turns_dir / "s1.jsonl")],
        reward=1.0,
    )


def test_proxy_writes_a_sidecar_and_align_carries_routing_position_by_position(
    session_turns: Path,
) -> None:
    turns = list(read_jsonl(session_turns / "s1.jsonl", Turn))
    assert [t.segment for t in turns] == [0, 0, 1]
    refs = [t.routing for t in turns]
    assert all(isinstance(r, RoutingRef) and r.file == "s1.routing" for r in refs)
    r0, r1, r2 = refs
    assert r0 is not None and r1 is not None and r2 is not None
    assert r0.start == 0 and r0.rows == turns[0].prompt_len + len(turns[0].completion_ids) - 1
    assert r1.start == r0.rows  # the engine reused the first call's cached tokens
    assert r1.row == r0.rows and r2.row == r0.rows + r1.rows and r2.start == 0
    stats = AlignStats()
    samples = list(align([_trajectory(session_turns)], base_dir=Path("/"), stats=stats))
    assert len(samples) == 2 and stats.routed_samples == 2 and stats.routing_gaps == 0
    reader = ChunkReader(LAYOUT)
    for s in samples:
        rows, has = reader.sample_rows(s)
        # every position but the last (never fed back) has the routing the engine computed,
        # and it is what a plain fp32 forward of the whole sample computes
        assert has[:-1].all() and not has[-1]
        assert same_sets(rows[:-1], reference_routing(s.input_ids)[:-1]).all()
    assert [len(s.routing or []) for s in samples] == [2, 1]


def test_align_reports_missing_and_corrupt_sidecars_by_file(
    session_turns: Path, tmp_path: Path
) -> None:
    for name in ("s1.jsonl", "s1.routing"):
        (tmp_path / name).write_bytes((session_turns / name).read_bytes())
    raw = bytearray((tmp_path / "s1.routing").read_bytes())
    raw[-1] ^= 1  # a row of the last call
    (tmp_path / "s1.routing").write_bytes(bytes(raw))
    traj = _trajectory(tmp_path)
    with pytest.raises(AlignError, match=rf"turn 2: {tmp_path / 's1.routing'}: checksum mismatch"):
        list(align([traj], base_dir=Path("/")))
    (tmp_path / "s1.routing").unlink()
    with pytest.raises(AlignError, match=rf"{tmp_path / 's1.routing'}: routing sidecar not found"):
        list(align([traj], base_dir=Path("/")))


def test_align_stops_a_samples_routing_at_a_gap(session_turns: Path) -> None:
    turns = list(read_jsonl(session_turns / "s1.jsonl", Turn))
    # a turn recorded without routing (another engine, an old run) leaves a gap: the sample
    # covers only the positions before it, and says so
    turns[1].routing = None
    traj = _trajectory(session_turns)
    traj.turns_ref, traj.turns = None, turns
    stats = AlignStats()
    first = next(iter(align([traj], base_dir=session_turns, stats=stats)))
    _, has = ChunkReader(LAYOUT).sample_rows(first)
    n0 = turns[0].prompt_len + len(turns[0].completion_ids) - 1
    assert has[:n0].all() and not has[n0:].any()
    assert stats.routing_gaps == 1
    # and a sample with no routing at all (a dense model's) carries none
    for t in turns:
        t.routing = None
    assert all(s.routing is None for s in align([traj], base_dir=session_turns))


def test_a_turns_routing_must_fit_its_tokens_and_old_turns_still_read(
    session_turns: Path, tmp_path: Path
) -> None:
    from legorl.records import RecordError

    line = (session_turns / "s1.jsonl").read_bytes().splitlines()[0]
    data = orjson.loads(line)
    old = {k: v for k, v in data.items() if k != "routing"}  # a Turn written before routing
    data["routing"]["rows"] += 5  # more rows than the call has tokens
    path = tmp_path / "t.jsonl"
    path.write_bytes(orjson.dumps(old) + b"\n" + orjson.dumps(data) + b"\n")
    with pytest.raises(RecordError, match=r"t.jsonl:2: routing: rows 0\.\.\d+ do not fit"):
        list(read_jsonl(path, Turn))
    assert next(iter(read_jsonl(path, Turn))).routing is None


def test_a_set_aside_turn_file_takes_its_sidecar_along(tmp_path: Path) -> None:
    from legorl.rollout import _set_aside

    turns, routing = tmp_path / "r1.jsonl", tmp_path / "r1.routing"
    turns.write_text("{}\n")
    routing.write_bytes(b"x")
    _set_aside(turns)
    assert (tmp_path / "r1.jsonl.orphan-1").exists() and (tmp_path / "r1.routing.orphan-1").exists()
    assert not routing.exists()


def test_a_sample_opened_inside_a_segment_keeps_its_left_contexts_routing(
    tmp_path: Path,
) -> None:
    # turn 1 rewinds to position 5 of its segment with other tokens: align opens a new sample
    # whose first 5 positions are turn 0's (computed by it) and the rest turn 1's own rows
    rng = np.random.default_rng(0)
    rows0 = rng.integers(0, 4, (12, 2, 2)).astype(np.uint8)
    rows1 = rng.integers(0, 4, (4, 2, 2)).astype(np.uint8)
    with RoutingWriter(tmp_path / "s.routing", LAYOUT) as w:
        (r0, h0), (r1, h1) = w.append(rows0), w.append(rows1)

    def turn(i: int, offset: int, delta: list[int], completion: list[int], ref: RoutingRef) -> Turn:
        return Turn(
            session="s", turn=i, segment=0, api="openai_chat", model="m",
            prompt_offset=offset, prompt_delta=delta, completion_ids=completion,
            completion_logprobs=[-0.5] * len(completion), finish_reason="stop", routing=ref,
        )  # fmt: skip

    turns = [
        turn(
            0,
            0,
            list(range(10, 20)),
            [20, 21, 22],
            RoutingRef(file="s.routing", row=r0, rows=12, start=0, sha256=h0),
        ),
        turn(
            1,
            5,
            [99, 98, 97],
            [50, 51],
            RoutingRef(file="s.routing", row=r1, rows=4, start=5, sha256=h1),
        ),
    ]
    traj = Trajectory(
        trajectory_id="t", task_id="x", group_id="g", sample_index=0, harness="h",
        status="ok", turns=turns, reward=1.0,
    )  # fmt: skip
    stats = AlignStats()
    first, second = align([traj], base_dir=tmp_path, stats=stats)
    assert stats.breaks == 1 and second.input_ids == [10, 11, 12, 13, 14, 99, 98, 97, 50, 51]
    reader = ChunkReader(LAYOUT)
    rows, has = reader.sample_rows(first)
    assert has[:12].all() and (rows[:12] == rows0).all()
    rows, has = reader.sample_rows(second)
    assert has[:9].all() and not has[9]
    assert (rows[:5] == rows0[:5]).all() and (rows[5:9] == rows1).all()
