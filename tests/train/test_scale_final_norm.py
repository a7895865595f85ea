"""`experiments/scale_final_norm.py`: a copy whose logits are the original's times the factor, the
same as sampling the original at temperature 1 / factor (checked with a real forward pass)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from train_helpers import ROOT

from experiments import scale_final_norm

AGENT = ROOT / "fixtures" / "models" / "tiny-agent"


def test_the_copy_scales_every_logit_by_the_factor(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    assert scale_final_norm.main([str(AGENT), "1.5", str(tmp_path / "x")]) == 0
    ids = torch.tensor([[5, 17, 230, 999, 42, 7, 1200, 64]])
    with torch.no_grad():
        logits = [
            AutoModelForCausalLM.from_pretrained(str(m), dtype=torch.float32)(ids).logits
            for m in (AGENT, tmp_path / "x")
        ]
    assert not torch.allclose(logits[0], logits[1])
    torch.testing.assert_close(logits[1], 1.5 * logits[0], rtol=1e-5, atol=1e-5)
    assert (tmp_path / "x" / "tokenizer.json").is_file()  # the rest of the folder is copied


@pytest.mark.parametrize(
    ("args", "message"),
    [(["0"], "factor: must be a number > 0, got 0.0"), (["nan"], "factor: must be a number > 0")],
)
def test_a_bad_factor_exits_2_before_writing(tmp_path: Path, capsys, args, message) -> None:
    with pytest.raises(SystemExit) as info:
        scale_final_norm.main([str(AGENT), *args, str(tmp_path / "x")])
    assert info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
