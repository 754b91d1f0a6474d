"""A backbone family is one row of ``FAMILIES``: what it can do is read from the row, not from its name."""

from pathlib import Path

import pytest
import torch

import vitkit
from vitkit.checkpoints.load import Checkpoint
from vitkit.checkpoints.match import fitting_presets
from vitkit.checkpoints.names import capabilities
from vitkit.errors import UsageError
from vitkit.models.encoders import vision_encoder
from vitkit.models.registry import FAMILIES, Family
from vitkit.models.vit import VisionTransformer, ViTConfig

TOY = {"toy_tiny_patch8_32": dict(patch_size=8, embed_dim=32, depth=1, num_heads=2, img_size=32, num_classes=3)}


class ToyNet(VisionTransformer):
    """A family of its own (a ViT underneath, so that it runs)."""


def test_the_families_say_what_they_can_do():
    assert capabilities("vit_small_patch16_224.augreg_in21k").mim == ("mae", "simmim")
    assert capabilities("swin_tiny_patch4_window7_224").mim == ("simmim",)
    assert capabilities("swin_tiny_patch4_window7_224").export_sizes == "padded"
    assert capabilities("vit_tiny_patch16_224").images and capabilities("vit_tiny_patch16_224").dino
    assert [name for name, f in FAMILIES.items() if not f.images] == ["seq2seq"]


def test_a_new_family_is_one_row_and_its_capabilities_decide(monkeypatch):
    from vitkit.deploy.export import ExportError, export_sizes, prepare

    monkeypatch.setitem(FAMILIES, "toy", Family(ViTConfig, ToyNet, TOY))  # no MIM, no DINO, no export
    model = vitkit.create_model("toy_tiny_patch8_32")
    assert type(model) is ToyNet and model(torch.randn(1, 3, 32, 32)).shape == (1, 3)
    assert vitkit.family("toy_tiny_patch8_32") == "toy"
    assert type(vision_encoder("toy_tiny_patch8_32")) is ToyNet  # the image-to-text encoder takes it by the row
    # a bare state dict of the family is matched to its preset by the row's width, patch and depth
    bare = {k: v for k, v in model.state_dict().items() if not k.startswith("head.")}
    assert fitting_presets(Checkpoint(Path("toy.pt"), "vitkit", bare))[:1] == ["toy_tiny_patch8_32"]
    with pytest.raises(UsageError, match="not pre-trained with MAE: its family takes no masked image modeling"):
        vitkit.create_mim("toy_tiny_patch8_32")
    assert export_sizes(model) is None
    with pytest.raises(ExportError, match="ToyNet"):
        prepare(model, None)

    monkeypatch.setitem(FAMILIES, "toy", Family(ViTConfig, ToyNet, TOY, mim=("mae",), export_sizes="patch_multiples"))
    assert vitkit.create_mim("toy_tiny_patch8_32").cfg.encoder == "toy_tiny_patch8_32"
    assert export_sizes(model) == "patch_multiples" and prepare(model, None)[1] is True
