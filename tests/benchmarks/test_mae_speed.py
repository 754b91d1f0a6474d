"""benchmarks/mae_speed.py: a tiny run writes its row, and the activation count is the cost of one more image."""

import sys

import pytest
import torch

from tests.tasks.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import mae_speed  # noqa: E402


@pytest.mark.slow
def test_a_tiny_run_writes_the_row_with_its_ratio_and_memory(tmp_path):
    out = tmp_path / "mae.md"
    mae_speed.main(["--models", "vit_tiny_patch16_224", "--batch-size", "2", "--rounds", "1", "--iters", "1",
                    "--out", str(out)])
    row = out.read_text().splitlines()[-1].strip("|").split("|")
    name, cls_ips, mae_ips, speed, ratio, _, cls_act, mae_act, state = (c.strip() for c in row)
    assert name == "vit_tiny_patch16_224" and float(cls_ips) > 0 and float(mae_ips) > 0
    # ViT-Ti is narrower than the paper's decoder (512 wide, 8 blocks over every position): MAE costs it more
    median, spread = speed.split(" ")
    low, high = (float(v) for v in spread.strip("()").split("-"))
    assert 0.1 < float(ratio) < 0.5 and low == float(median.rstrip("x")) == high > 0, (ratio, speed)  # one round
    assert float(mae_act) > float(cls_act) > 0, (cls_act, mae_act)
    cls_state, mae_state = (float(v) for v in state.split("/"))
    assert 0 < cls_state < mae_state, state


@pytest.mark.slow
def test_the_activation_count_grows_by_the_same_amount_per_image():
    """Counted at 1 and 2 images and at 2 and 4: the same bytes per image (the weights, saved too, cancel in the
    difference, as do other per-step tensors)."""
    cpu = torch.device("cpu")
    for kind in ("cls", "mae"):
        one, two = (mae_speed.activation_mib(kind, "vit_tiny_patch16_224", 224, "fp32", cpu, batch=b) for b in (1, 2))
        assert abs(one - two) / two < 0.01, (kind, one, two)


def test_a_count_below_one_is_one_line(capsys):
    for flag in ("--rounds", "--iters", "--batch-size"):
        with pytest.raises(SystemExit) as exit_:
            mae_speed.main(["--models", "vit_tiny_patch16_224", flag, "0"])
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.endswith(f"{flag} expects a whole number >= 1, got 0"), err
