"""The align stage on sessions captured through the real proxy: samples are exactly the engine's
tokens, with the right segments and masks, across re-serialised tool calls, stripped thinking,
compaction and sub-agents; `--check`'s figures at fp32 and bf16, beside a naive re-tokenisation
of the harness's final messages. Bad input is named by trajectory and turn.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from align_sessions import EXPECTED, EXPECTED_WITH_AUX, MODEL, REWARDS, Captured, capture_once

from legorl.align import (
    INVALID,
    NO_REWARD,
    NO_TRAINABLE_TURNS,
    NO_TURNS,
    AlignError,
    AlignStats,
    FidelityCheck,
    align,
    check_fidelity,
)
from legorl.engines.models import load_model, token_logprobs
from legorl.records import Sample, Trajectory, Turn, TurnFlags, to_json


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> Captured:
    return capture_once(tmp_path_factory)


@pytest.fixture(scope="module")
def captured_bf16(tmp_path_factory: pytest.TempPathFactory) -> Captured:
    return capture_once(tmp_path_factory, "bfloat16")


@pytest.fixture(scope="module")
def fp32_model():
    return load_model(MODEL, dtype="float32", device="cpu")


def _expected_sequence(cap: Captured, indices: list[int]) -> tuple[list[int], list[int]]:
    """input_ids and loss_mask from the engine's own requests and completions."""
    last = indices[-1]
    ids = cap.requests[last].prompt_ids + cap.completions[last]
    mask = [0] * len(ids)
    for i in indices:
        start = len(cap.requests[i].prompt_ids)
        assert ids[:start] == cap.requests[i].prompt_ids  # each prompt extends the sequence
        assert ids[start : start + len(cap.completions[i])] == cap.completions[i]
        mask[start : start + len(cap.completions[i])] = [1] * len(cap.completions[i])
    return ids, mask


@pytest.mark.parametrize("include_aux", [False, True])
def test_samples_are_exactly_the_engines_tokens(captured: Captured, include_aux: bool) -> None:
    stats = AlignStats()
    samples = list(
        align(captured.trajectories, include_aux=include_aux, base_dir=captured.folder, stats=stats)
    )
    expected = EXPECTED_WITH_AUX if include_aux else EXPECTED
    by_episode: dict[str, list[Sample]] = {}
    for s in samples:
        by_episode.setdefault(s.episode_id, []).append(s)
    assert list(by_episode) == list(expected)  # episodes in input order
    turns = {t.trajectory_id: t for t in captured.trajectories}
    for episode, plan in expected.items():
        got = by_episode[episode]
        assert [s.segment_index for s in got] == list(range(len(plan)))
        assert {s.segment_count for s in got} == {len(plan)}
        for sample, (session, _segment, indices, aux) in zip(got, plan, strict=True):
            for i in indices:  # the engine served this sample's requests for this sub-session
                assert captured.requests[i].cache_key.startswith(session)
            ids, mask = _expected_sequence(captured, indices)
            assert sample.input_ids == ids
            assert sample.loss_mask == mask
            assert sample.aux is aux
            assert sample.reward == REWARDS[episode]
            assert sample.group_id == turns[episode].group_id
            assert sample.sample_id == f"{episode}/{sample.segment_index}"
            sample.check()  # the record's own invariants
    # rollout log-probs are the recorded ones, token for token, in order
    reser = by_episode["s-reser"][0]
    recorded = [lp for t in captured.trajectories[0].turns or [] for lp in t.completion_logprobs]
    assert reser.rollout_logprobs == recorded
    # the proxy repaired history in the re-serialised and stripped-thinking sessions
    assert stats.realigned_turns >= 4 and stats.breaks == 0
    assert stats.aux_turns_excluded == (0 if include_aux else 3)
    assert stats.samples == len(samples) and stats.episodes == 4
    assert stats.trained_tokens == sum(sum(s.loss_mask) for s in samples)
    assert stats.total_tokens == sum(len(s.input_ids) for s in samples)


def test_loss_mask_covers_sampled_tokens_only(captured: Captured) -> None:
    from proxy_harness import tokenizer

    tok = tokenizer()
    (sample,) = [s for s in align(captured.trajectories[:1], base_dir=captured.folder)]
    trained = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
    text = tok.decode(trained)
    # every sampled completion, thinking and end-of-turn tokens included, and nothing else
    assert "I should look at the files first." in text and text.count("<|im_end|>") == 3
    assert "<tool_response>" not in text and "<|im_start|>" not in text
    assert "List the files" not in text


def test_check_is_deterministic_on_the_forced_engines_own_numbers(
    captured: Captured, fp32_model
) -> None:
    """A determinism test, not a fidelity one: the forced engine's log-probs come from the same
    full forward pass the check recomputes, so this proves the alignment picks exactly the
    sampled positions and the recompute is repeatable. Fidelity against an engine's own decode
    path (KV cache, incremental steps) is proved on the embedded engine in
    tests/test_check.py (`check_fidelity`) and on real vLLM in tests/engines/test_vllm_real.py."""
    samples = list(align(captured.trajectories, base_dir=captured.folder, include_aux=True))
    report, checks = check_fidelity(samples, fp32_model)
    print(f"\nfp32 engine vs fp32 check: {report}")
    assert report["pearson"] >= 0.9999
    assert report["tokens"] == sum(sum(s.loss_mask) for s in samples)
    assert report["max_abs_diff"] < 1e-4 and abs(report["k3_kl"]) < 1e-8
    assert len(checks) == len(samples) and all(c.pearson >= 0.9999 for c in checks)


def test_check_bf16_engine_fp32_trainer(captured_bf16: Captured, fp32_model) -> None:
    samples = list(align(captured_bf16.trajectories, base_dir=captured_bf16.folder))
    report, _ = check_fidelity(samples, fp32_model)
    print(f"\nbf16 engine vs fp32 check: {report}")
    assert report["pearson"] >= 0.99
    assert report["max_abs_diff"] > 1e-3  # really a bf16 rollout: the numbers differ


def _naive_pearson(cap: Captured, model) -> tuple[float, int, int]:
    """The baseline: render the harness's final messages with the chat template, take the
    assistant spans as loss tokens, pair them position by position with the rollout's
    log-probs of each turn, score with the model."""
    from transformers import AutoTokenizer

    from legorl.align import _Moments

    hf = AutoTokenizer.from_pretrained(str(MODEL))
    messages, tools = cap.final_messages["s-reser"], cap.tools["s-reser"]
    text = hf.apply_chat_template(messages, tools=tools, tokenize=False)
    enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    opener, end = "<|im_start|>assistant\n", "<|im_end|>"
    spans, at = [], 0
    while (at := text.find(opener, at)) >= 0:
        lo = at + len(opener)
        hi = text.index(end, lo) + len(end)
        spans.append([i for i, (a, _) in enumerate(offsets) if lo <= a < hi])
        at = hi
    trainer = token_logprobs(model, ids, start=1, temperature=1.0)
    turns = cap.trajectories[0].turns or []
    assert len(spans) == len(turns)
    m, same = _Moments(), 0
    for span, turn in zip(spans, turns, strict=True):
        for j, (pos, rollout_lp) in enumerate(zip(span, turn.completion_logprobs, strict=False)):
            x, y = math.exp(rollout_lp), math.exp(trainer[pos - 1])
            m.merge(_Moments(1, x, y, 0.0, 0.0, 0.0))
            same += ids[pos] == turn.completion_ids[j]
    pearson = m.pearson()
    assert pearson is not None
    return pearson, same, m.n


def test_naive_retokenisation_scores_lower_on_the_reserialised_session(
    captured: Captured, fp32_model
) -> None:
    (sample,) = align(captured.trajectories[:1], base_dir=captured.folder)
    ours = FidelityCheck(fp32_model).score(sample)
    naive, same, paired = _naive_pearson(captured, fp32_model)
    print(
        f"\nre-serialised session s-reser: align Pearson {ours.pearson:.6f} on {ours.tokens} "
        f"loss tokens; naive re-tokenisation Pearson {naive:.6f} ({same} of {paired} paired "
        "tokens are the sampled ones)"
    )
    assert ours.pearson is not None and ours.pearson >= 0.9999
    assert naive < 0.9 and same < paired


# ---- hand-made turns: merging rules and bad input ------------------------------------------


def _turn(session: str, n: int, seg: int, offset: int, delta: list[int], comp: list[int], **kw):
    lps = kw.pop("lps", [-0.5] * len(comp))
    return Turn(
        session=session,
        turn=n,
        segment=seg,
        api="openai_chat",
        model="tiny",
        prompt_offset=offset,
        prompt_delta=delta,
        completion_ids=comp,
        completion_logprobs=lps,
        finish_reason="stop",
        **kw,
    )


def _traj(tid: str, turns: list[Turn] | None, **kw) -> Trajectory:
    fields = {"status": "ok", "reward": 1.0, **kw}
    return Trajectory(
        trajectory_id=tid,
        task_id="t",
        group_id="g",
        sample_index=0,
        harness="scripted",
        turns=turns,
        **fields,
    )


def test_merges_while_prompts_extend_and_breaks_when_they_stop() -> None:
    turns = [
        _turn("s", 0, 0, 0, [1, 2, 3], [4, 5]),
        _turn("s", 1, 0, 5, [6], [7]),  # extends: delta after everything held
        _turn("s", 2, 0, 3, [4, 5, 6, 7, 8], [9]),  # re-sends tokens it holds: still extends
        _turn("s", 3, 0, 2, [99], [10]),  # rewrites token 2: not an extension, new sample
        _turn("s", 4, 0, 4, [11], [12], policy_version=1),
    ]
    stats = AlignStats()
    a, b = align([_traj("e", turns)], stats=stats)
    assert a.input_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert a.loss_mask == [0, 0, 0, 1, 1, 0, 1, 0, 1]
    assert b.input_ids == [1, 2, 99, 10, 11, 12]  # its own left context
    assert b.loss_mask == [0, 0, 0, 1, 0, 1]
    assert (a.segment_index, b.segment_index, a.segment_count) == (0, 1, 2)
    assert stats.breaks == 1 and stats.mixed_policy_samples == 1


def test_drops_are_counted_by_reason_never_zeroed() -> None:
    good = [_turn("s", 0, 0, 0, [1], [2])]
    aux_only = [_turn("x", 0, 0, 0, [1], [2], flags=TurnFlags(aux=True))]
    trajs = [
        _traj("crash", None, status="sandbox_error", reward=None),
        _traj("harness", good, status="harness_crash", reward=None),
        _traj("ungraded", good, reward=None),
        _traj("empty", []),
        _traj("aux-only", aux_only),
        _traj("timeout", good, status="timeout", reward=0.0),  # the agent's fault: trained on
    ]
    stats = AlignStats()
    samples = list(align(trajs, stats=stats))
    assert [s.episode_id for s in samples] == ["timeout"] and samples[0].reward == 0.0
    assert stats.dropped == {
        "sandbox_error": 1,
        "harness_crash": 1,
        NO_REWARD: 1,
        NO_TURNS: 1,
        NO_TRAINABLE_TURNS: 1,
    }
    assert stats.summary()["episodes_in"] == 6


@pytest.mark.parametrize(
    ("turn", "message"),
    [
        (
            _turn("s", 1, 0, 2, [3], [4, 5], lps=[-1.0]),
            "2 completion tokens but 1 log-probs",
        ),
        (_turn("s", 1, 0, 2, [3], [4], lps=[math.nan]), "non-finite log-prob"),
        (_turn("s", 1, 0, 9, [3], [4]), "prompt_offset 9 points past the 2 tokens"),
        (_turn("s", 0, 0, 2, [3], [4]), "comes after turn 0 of its session"),
        (_turn("s", 1, 0, 0, [], []), "empty prompt"),
    ],
)
def test_errors_name_the_trajectory_and_the_turn(turn: Turn, message: str) -> None:
    first = _turn("s", 0, 0, 0, [1], [2])
    with pytest.raises(AlignError) as err:
        list(align([_traj("ep-7", [first, turn])]))
    assert str(err.value).startswith(f"trajectory 'ep-7', session 's' turn {turn.turn}: ")
    assert message in str(err.value)
    # with skip_bad the episode is dropped as invalid, and the rest goes on
    stats = AlignStats()
    good = _traj("ok", [first])
    kept = list(align([_traj("ep-7", [first, turn]), good], stats=stats, skip_bad=True))
    assert [s.episode_id for s in kept] == ["ok"]
    assert stats.dropped == {INVALID: 1} and "ep-7" in stats.errors[0]


def test_turns_ref_is_read_relative_to_the_trajectory_folder(tmp_path: Path) -> None:
    turns = [_turn("s", 0, 0, 0, [1, 2], [3]), _turn("s", 1, 0, 3, [4], [5])]
    (tmp_path / "turns").mkdir()
    (tmp_path / "turns" / "s.jsonl").write_bytes(b"".join(to_json(t) + b"\n" for t in turns))
    traj = _traj("e", None, turns_ref=["turns/s.jsonl"])
    (sample,) = align([traj], base_dir=tmp_path)
    assert sample.input_ids == [1, 2, 3, 4, 5]
    with pytest.raises(AlignError, match=r"turns_ref 'turns/s.jsonl': no such file"):
        list(align([traj], base_dir=tmp_path / "elsewhere"))
    # a bad line in a turns file: named by file and line, inside the trajectory's error
    with open(tmp_path / "turns" / "s.jsonl", "ab") as fh:
        fh.write(b'{"schema": "legorl/turn@1", "session": "s"}\n')
    with pytest.raises(AlignError) as err:
        list(align([traj], base_dir=tmp_path))
    assert f"{tmp_path / 'turns' / 's.jsonl'}:3: " in str(err.value)
    assert str(err.value).startswith("trajectory 'e': ")
    with pytest.raises(AlignError, match="both turns and turns_ref"):
        list(align([_traj("both", turns, turns_ref=["turns/s.jsonl"])], base_dir=tmp_path))


def test_check_figures_on_a_known_disagreement(fp32_model) -> None:
    from proxy_harness import tokenizer

    ids = tokenizer().encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nhi there")
    start = 8
    true = token_logprobs(fp32_model, ids, start=start, temperature=1.0)
    shifted = [lp - 0.1 for lp in true]  # the rollout saw every token 10% less likely
    sample = Sample(
        sample_id="k/0",
        episode_id="k",
        group_id="g",
        segment_index=0,
        segment_count=1,
        input_ids=ids,
        loss_mask=[0] * start + [1] * (len(ids) - start),
        rollout_logprobs=shifted,
        reward=1.0,
    )
    check = FidelityCheck(fp32_model).score(sample)
    assert check.tokens == len(ids) - start
    assert check.mean_abs_diff == pytest.approx(0.1, abs=1e-5)
    assert check.max_abs_diff == pytest.approx(0.1, abs=1e-5)
    assert check.k3_kl == pytest.approx(math.expm1(0.1) - 0.1, rel=1e-4)
    assert check.pearson == pytest.approx(1.0, abs=1e-9)  # probabilities scaled by one factor


def test_bench_storage_does_not_grow_with_turns() -> None:
    from legorl.bench.align import bench_align

    report = bench_align(quick=True)
    per_token = report["bytes_per_trained_token"]
    assert list(per_token) == ["25", "50", "100", "200"]
    assert report["bytes_per_trained_token_growth_200_over_25"] <= 1.0
    assert report["baseline_bytes_growth_200_over_25"] > 3.0  # per-turn full prompts: linear
    assert {"time_ratio_200_over_100", "baseline_time_ratio_200_over_100"} <= set(report)
