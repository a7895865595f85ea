"""`fixtures/models/tiny-agent` and the transcripts it was supervised on
(`experiments/make_agent_model.py`, its bugs from `fixtures/bugs.py`).

* The transcripts never show a held-out bug, and each one really fixes its bug.
* Their token ids are exactly what the proxy records when the real `mini` harness runs those
  turns in a real `local` sandbox: the engine there is `forced` (a fake shipping in the
  package: it replays the transcript's completions, scored by a real forward pass), and
  `verify` grades the result in a fresh sandbox.
* The committed model is a small Qwen3 with the foundation tokenizer and a model card.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from itertools import groupby
from pathlib import Path

import pytest
from conftest import run_task

from experiments import make_agent_model as mam
from fixtures import bugs as bug_gen
from fixtures import make_tasks as mt
from legorl.align import align
from legorl.engines import make_engine
from legorl.harnesses import make_harness
from legorl.proxy.tokens import ChatTokenizer
from legorl.records import Task, Trajectory, Turn, read_jsonl
from legorl.rollout import inprocess_proxy
from legorl.sandbox import make_backend
from legorl.verify import verify

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "fixtures" / "tasks"
AGENT = ROOT / "fixtures" / "models" / "tiny-agent"
BASE = ROOT / "fixtures" / "models" / "tiny-qwen3"


@pytest.fixture(scope="module")
def bugs() -> list[bug_gen.Solved]:
    solved, _ = bug_gen.collect_bugs()
    return solved


def _tasks(split: str) -> list[Task]:
    return list(read_jsonl(TASKS / f"{split}.jsonl", Task))


def _changed_line(patch: str, sign: str) -> str:
    return next(
        ln[1:].strip()
        for ln in patch.splitlines()
        if ln.startswith(sign) and not ln.startswith(sign * 3)
    )


def test_transcripts_never_show_a_heldout_bug(bugs: list[bug_gen.Solved]) -> None:
    rng = random.Random(0)
    renamed = [c for c in (bug_gen.renamed(s, rng) for s in bugs) if c is not None]
    shown = {(s.buggy_line.strip(), s.fixed_line.strip()) for s in bugs + renamed}
    texts = {s.problem for s in bugs + renamed}
    train_ids = {t.instance_id for t in _tasks("train")}
    for task in _tasks("heldout"):
        gold = (_changed_line(task.patch, "-"), _changed_line(task.patch, "+"))
        assert gold not in shown, task.instance_id
        assert task.problem_statement not in texts, task.instance_id
    origins = {s.origin.removeprefix("task:") for s in bugs if s.origin.startswith("task:")}
    assert origins and origins <= train_ids
    assert {s.origin for s in bugs} >= {"synthetic"}
    assert len(renamed) > len(bugs) // 2


def test_every_transcript_fixes_its_bug(bugs: list[bug_gen.Solved]) -> None:
    sources = {m.name: mt._code(m.source) for m in mt.modules()}
    for s in bugs:
        assert s.buggy_source.count(s.buggy_line) == 1, s
        assert s.buggy_source.replace(s.buggy_line, s.fixed_line) == sources[s.module], s
        (view, edit, submit) = mam.transcript(s)
        assert s.buggy_line in view[2] and f"def {s.function}(" in view[2]
        assert edit[1] == {
            "path": f"/testbed/{s.module}.py",
            "old": s.buggy_line,
            "new": s.fixed_line,
        }
        assert submit[0] == "submit" and submit[2] is None


@pytest.mark.parametrize("random_names", [False, True])
def test_renamed_copies_stay_consistent(bugs: list[bug_gen.Solved], random_names: bool) -> None:
    rng = random.Random(1)
    pool = bug_gen.word_pieces() if random_names else None
    for s in bugs[:60]:
        copy = bug_gen.renamed(s, rng, pool)
        if copy is None:
            continue
        assert copy.module != s.module and f"`{copy.function}`" in copy.problem
        assert copy.buggy_source.count(copy.buggy_line) == 1
        assert copy.buggy_line in bug_gen.function_view(copy.buggy_source, copy.function)
        # the fix still changes exactly the one line
        before = copy.buggy_source.splitlines()
        after = copy.buggy_source.replace(copy.buggy_line, copy.fixed_line).splitlines()
        assert sum(a != b for a, b in zip(before, after, strict=True)) == 1


def _shown_call(problem: str) -> str:
    """The reproduction's last line, as the issue shows it."""
    return [ln[4:] for ln in problem.splitlines() if ln.startswith(">>> ")][-1]


def test_procedural_bugs_are_real_fresh_and_never_a_heldout_fix() -> None:
    pool = bug_gen.word_pieces()
    generated = bug_gen.procedural_bugs(140, 5, pool=pool)
    again = bug_gen.procedural_bugs(140, 5, pool=pool)
    assert generated == again  # the same seed, the same bugs
    families = {f: sum(s.family == f for s in generated) for f in bug_gen.FAMILIES}
    assert families == {f: 20 for f in bug_gen.FAMILIES}
    toy = bug_gen.toy_names()
    heldout_fixes = {
        (_changed_line(t.patch, "-"), _changed_line(t.patch, "+")) for t in _tasks("heldout")
    }
    for s in generated:
        assert s.origin == "procedural" and s.module not in toy and s.function not in toy
        assert (s.buggy_line.strip(), s.fixed_line.strip()) not in heldout_fixes
        assert s.buggy_source.count(s.buggy_line) == 1
        assert s.buggy_line in bug_gen.function_view(s.buggy_source, s.function)
        fixed = s.buggy_source.replace(s.buggy_line, s.fixed_line)
        call = _shown_call(s.problem)
        assert call.startswith(f"{s.function}(") and f">>> from {s.module} import " in s.problem
        # the call really shows the bug: the buggy module gives what the issue says
        # it gives, the fixed one what the issue expects
        got = mt.outcome(mt.load(s.module, s.buggy_source), [s.function], call)
        want = mt.outcome(mt.load(s.module, fixed), [s.function], call)
        assert got != want and not want[1]
        said = (f"Expected: `{want[0]}`\nActual: `{got[0]}`", f"I expected `{want[0]}`, but")
        assert any(text in s.problem for text in said), s.problem
    assert len({s.function for s in generated}) > 100  # fresh names, not a short list


def test_transcript_tokens_are_what_the_proxy_records_in_a_real_run(
    tmp_path: Path, bugs: list[bug_gen.Solved]
) -> None:
    tok = ChatTokenizer(BASE)
    by_id = {t.instance_id: t for t in _tasks("train")}
    chosen = [s for s in bugs if s.origin.startswith("task:")][:2]
    assert len(chosen) == 2

    async def run(s: bug_gen.Solved) -> Trajectory:
        task = by_id[s.origin.removeprefix("task:")]
        # forced: a fake engine shipping in the package, replaying the transcript's turns
        script = [{"text": mam._call_text(name, args)} for name, args, _ in mam.transcript(s)]
        engine = make_engine("forced", model_path=str(BASE), script=script)
        try:
            async with inprocess_proxy(BASE, engine, tmp_path / "turns") as (endpoint, _):
                traj = await run_task(
                    task,
                    make_harness("mini", max_turns=4),
                    make_backend("local"),
                    endpoint,
                    refs=tmp_path,
                    model="tiny-agent",
                    wall_s=120,
                    run_id="legorl-test-agent-model",
                )
            graded = [
                g
                async for g in verify(
                    [traj],
                    {task.instance_id: task},
                    backend=make_backend("local"),
                    tasks_dir=str(TASKS),
                    run_id="legorl-test-agent-model",
                    load_turns=lambda t: list(read_jsonl(tmp_path / t.turns_ref[0], Turn)),
                )
            ]
            return graded[0]
        finally:
            await engine.close()

    for s in chosen:
        traj = asyncio.run(run(s))
        assert traj.status == "ok", traj.evidence
        assert traj.reward == 1.0, traj.verdict  # the transcript really solves the task
        samples = list(align([traj], base_dir=tmp_path))
        assert len(samples) == 1
        ids, mask = mam.encode(tok, s)
        assert tok.decode(samples[0].input_ids) == tok.decode(ids)  # a readable diff first
        assert samples[0].input_ids == ids
        assert [int(m) for m in samples[0].loss_mask] == mask


def test_heldout_transcripts_fix_heldout_tasks_and_the_data_file_round_trips() -> None:
    heldout, total = mam.heldout_solved()
    ids = {t.instance_id: t for t in _tasks("heldout")}
    assert total == len(ids) and 0 < len(heldout) <= total
    for s in heldout:
        task = ids[s.origin.removeprefix("heldout:")]
        assert _changed_line(task.patch, "-") == s.buggy_line.strip()
        assert _changed_line(task.patch, "+") == s.fixed_line.strip()
    tok = ChatTokenizer(BASE)
    seqs = [mam.encode(tok, s) for s in heldout[:3]]
    assert mam.unpack(mam.pack(seqs)) == seqs
    # the system turn is stored once, and it carries no loss
    prefix = mam._shared_prefix(seqs)
    assert prefix > 100 and not any(m[:prefix].count(1) for _, m in seqs)


def test_gold_scores_come_from_a_real_forward_pass() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(BASE).eval()
    tok = ChatTokenizer(BASE)
    (s,) = mam.heldout_solved()[0][:1]
    ids, mask = mam.encode(tok, s)
    # each completion's [start, end) positions: the runs of loss-mask 1
    runs = [list(r) for keep, r in groupby(range(len(ids)), key=mask.__getitem__) if keep]
    spans = [(r[0], r[-1] + 1) for r in runs]
    # a second sequence whose bash and edit turns are the model's own greedy choice
    greedy_ids = list(ids)
    with torch.no_grad():
        for start, end in spans[:2]:
            for k in range(start, end):
                logits = model(input_ids=torch.tensor([greedy_ids[:k]])).logits
                greedy_ids[k] = int(logits[0, -1].argmax())
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
    by_turn = [sum(float(logp[k - 1, ids[k]]) for k in range(a, b)) for a, b in spans]
    scores = mam.gold_scores(model, [(ids, mask)], "cpu")
    assert scores["p_view"] == pytest.approx(math.exp(by_turn[0]), rel=1e-3)
    assert scores["p_edit"] == pytest.approx(math.exp(by_turn[1]), rel=1e-3)
    assert scores["p_all"] == pytest.approx(math.exp(sum(by_turn)), rel=1e-3)
    assert scores["greedy"] == 0.0  # a random model does not write the transcript
    own = mam.gold_scores(model, [(greedy_ids, mask)], "cpu")
    assert own["p_view"] > scores["p_view"] and own["p_edit"] > scores["p_edit"]


def test_cached_system_turn_gives_the_same_logits_and_training_goes_on_from_weights() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    tok = ChatTokenizer(BASE)
    seqs = [mam.encode(tok, s) for s in bug_gen.procedural_bugs(3, 1)]
    prefix = mam._shared_prefix(seqs)
    ids, _, _ = mam._padded(seqs, prefix, 0.25, "cpu")
    model = AutoModelForCausalLM.from_pretrained(AGENT).eval()
    with torch.no_grad():
        full = model(input_ids=ids).logits[:, prefix:]
        cached = mam._after_prefix(model, ids, prefix)
    assert cached.shape == full.shape
    assert torch.allclose(cached, full, atol=1e-4)
    # two fine-tuning steps from the committed weights, half the rows procedural
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tuned, steps = mam.train(
        seqs[:2],
        steps=2,
        batch=2,
        lr=1e-3,
        seed=0,
        init=AGENT,
        extra=seqs[2:],
        mix=0.5,
        cache_prefix=True,
        copy_steps=0,
        copy_rows=0,
        log_every=1,
    )
    assert steps == 2 and tuned.config.hidden_size == model.config.hidden_size
    after = tuned.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_committed_model_is_small_qwen3_with_the_foundation_tokenizer() -> None:
    config = json.loads((AGENT / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    size = sum(p.stat().st_size for p in AGENT.iterdir())
    assert size < 25 * 2**20
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (AGENT / name).read_bytes() == (BASE / name).read_bytes(), name
    card = (AGENT / "README.md").read_text()
    assert "make_agent_model.py" in card and "held-out" in card
