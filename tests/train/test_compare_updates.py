"""`experiments/compare_updates.py`: trainer updates compared side by side on one batch of samples,
each checkpoint scored on fresh generated bugs by a real forward pass."""

from __future__ import annotations

import json
from pathlib import Path

from train_helpers import ROOT, make_samples

from experiments import compare_updates
from legorl.records import to_json

AGENT = ROOT / "fixtures" / "models" / "tiny-agent"


def test_each_update_is_trained_from_the_same_weights_and_scored(tmp_path: Path, capsys) -> None:
    samples = tmp_path / "samples.jsonl"
    samples.write_bytes(b"".join(to_json(s) + b"\n" for s in make_samples(AGENT, n_new=4)))
    code = compare_updates.main(
        [
            str(samples),
            "--model",
            str(AGENT),
            "--bugs",
            "3",
            "--work",
            str(tmp_path / "work"),
            "--update",
            "lr=1e-12",
            "--update",
            r"train_params=^model\.norm\. lr=0.5",
        ]
    )
    assert code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["update"] for r in rows] == [
        "start",
        "lr=1e-12",
        r"train_params=^model\.norm\. lr=0.5",
    ]
    for r in rows:
        assert 0 <= r["p_all"] <= r["p_edit"] <= 1 and 0 <= r["greedy"] <= 1
    start, tiny, norm = rows
    assert tiny["p_all"] == start["p_all"]  # a step of 1e-12 changes nothing visible
    assert norm["p_all"] != start["p_all"]  # the norm gains moved, and so did the scores
    assert (tmp_path / "work" / "update-1" / "model.safetensors").is_file()


def test_a_bad_update_is_named(tmp_path: Path, capsys) -> None:
    samples = tmp_path / "samples.jsonl"
    samples.write_bytes(b"".join(to_json(s) + b"\n" for s in make_samples(AGENT, n_new=2)))
    code = compare_updates.main([str(samples), "--bugs", "1", "--update", "lr=fast"])
    assert code == 2
    assert (
        "--update 'lr=fast': override 'lr=fast': lr: expected a number" in capsys.readouterr().err
    )


def test_model_folders_are_scored_as_they_are(tmp_path: Path, capsys) -> None:
    code = compare_updates.main(["--bugs", "2", "--score", str(AGENT)])
    assert code == 0
    start, scored = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert scored.pop("score") == str(AGENT)
    assert scored == {k: v for k, v in start.items() if k != "update"}  # the same weights
    assert compare_updates.main(["--update", "lr=1e-4"]) == 2
    assert "--update needs the samples" in capsys.readouterr().err
    assert compare_updates.main(["--score", str(tmp_path)]) == 2
    assert f"--score {tmp_path}: not a model folder" in capsys.readouterr().err
