"""Checkpoints: every format, saved by the library that writes it, loads into vitkit with that library's
logits; resized loads match timm's own; bad files are refused clearly; exports load back in timm."""

import argparse
import os
import re
from pathlib import Path

import pytest
import timm
import torch
import torchvision
from safetensors.torch import save_file
from torch.testing import assert_close

import vitkit
from vitkit.checkpoints import CheckpointError, CheckpointMismatchError, UnsafeCheckpointError

VIT = "vit_tiny_patch16_224"
VIT_KW = dict(img_size=32, patch_size=8, depth=2, num_classes=10)
SWIN = "swin_tiny_patch4_window7_224"
SWIN_KW = dict(img_size=64, embed_dim=32, depths=(2, 2, 2), num_heads=(2, 4, 4), window_size=4, num_classes=10)


def _randomize(model: torch.nn.Module) -> torch.nn.Module:
    """Random values everywhere (libraries init heads and norms to constants that hide mistakes)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def _same_logits(ours, theirs, size, chans=3, atol=1e-4):
    x = torch.randn(2, chans, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = theirs(x)
        ref = getattr(ref, "logits", ref)
        assert_close(ours.eval()(x), ref, atol=atol, rtol=0)


@pytest.fixture(scope="module")
def timm_vit():
    return _randomize(timm.create_model(VIT, **VIT_KW))


@pytest.fixture(scope="module")
def timm_swin():
    return _randomize(timm.create_model(SWIN, **SWIN_KW))


# --- timm files in the shapes training scripts write -------------------------------------------------

@pytest.mark.parametrize("layout", ["pth", "bin_module_prefix", "safetensors_compiled", "train_ckpt",
                                    "deit_official", "ema"])
def test_timm_state_dicts_in_every_wrapper(layout, timm_vit, tmp_path):
    sd = timm_vit.state_dict()
    path, kw = tmp_path / "w.pth", {}
    if layout == "pth":
        torch.save(sd, path)
    elif layout == "bin_module_prefix":  # DDP
        path = tmp_path / "pytorch_model.bin"
        torch.save({f"module.{k}": v for k, v in sd.items()}, path)
    elif layout == "safetensors_compiled":  # torch.compile
        path = tmp_path / "w.safetensors"
        save_file({f"_orig_mod.{k}": v.contiguous() for k, v in sd.items()}, path)
    elif layout == "train_ckpt":  # timm's train.py: argparse Namespace beside the weights
        torch.save({"epoch": 3, "arch": VIT, "state_dict": sd, "args": argparse.Namespace(lr=0.1)}, path)
    elif layout == "deit_official":
        torch.save({"model": sd}, path)
    else:
        junk = {k: torch.zeros_like(v) for k, v in sd.items()}
        torch.save({"state_dict": junk, "state_dict_ema": sd}, path)
        kw = dict(use_ema=True)
    ours = vitkit.create_model(VIT, checkpoint=path, **{k: v for k, v in VIT_KW.items() if k != "num_classes"}, **kw)
    assert ours.cfg.num_classes == 10  # kept from the checkpoint's head
    _same_logits(ours, timm_vit, 32)


def test_timm_save_for_hf_folder_needs_no_name(tmp_path):
    theirs = _randomize(timm.create_model(VIT, **VIT_KW))
    timm.models.save_for_hf(theirs, tmp_path, safe_serialization=True)
    # the preset, size and classes come from config.json; timm records no depth or patch-size override
    ours = vitkit.create_model(checkpoint=tmp_path, depth=2, patch_size=8)
    assert ours.name == VIT and ours.load_report.format == "timm"
    _same_logits(ours, theirs, 32)


def test_swin_timm_and_official_layouts(timm_swin, tmp_path):
    kw = {k: v for k, v in SWIN_KW.items() if k != "num_classes"}
    torch.save(timm_swin.state_dict(), tmp_path / "timm.pth")
    _same_logits(vitkit.create_model(SWIN, checkpoint=tmp_path / "timm.pth", **kw), timm_swin, 64)
    # microsoft/Swin-Transformer: patch merging at the end of a stage, `head.*`, persisted index and mask
    official = {}
    for k, v in timm_swin.state_dict().items():
        k = re.sub(r"layers\.(\d+)\.downsample", lambda m: f"layers.{int(m[1]) - 1}.downsample", k)
        official[k.replace("head.fc.", "head.")] = v
    official["layers.0.blocks.0.attn.relative_position_index"] = torch.zeros(16, 16, dtype=torch.long)
    official["layers.0.blocks.1.attn_mask"] = torch.zeros(16, 16, 16)
    torch.save({"model": official}, tmp_path / "swin_tiny_patch4_window7_224.pth")
    ours = vitkit.create_model(SWIN, checkpoint=tmp_path / "swin_tiny_patch4_window7_224.pth", **kw)
    assert ours.load_report.format == "official-swin"
    _same_logits(ours, timm_swin, 64)


# --- torchvision ----------------------------------------------------------------------------------

def test_torchvision_vit(tmp_path):
    from torchvision.models.vision_transformer import VisionTransformer

    theirs = _randomize(VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=3, hidden_dim=192,
                                          mlp_dim=768, num_classes=10))
    torch.save(theirs.state_dict(), tmp_path / "vit.pth")
    ours = vitkit.create_model(VIT, checkpoint=tmp_path / "vit.pth", img_size=32, patch_size=8, depth=2)
    assert ours.load_report.format == "torchvision-vit"
    _same_logits(ours, theirs, 32)


def test_torchvision_swin(tmp_path):
    from torchvision.models.swin_transformer import SwinTransformer

    theirs = _randomize(SwinTransformer(patch_size=[4, 4], embed_dim=32, depths=[2, 2, 2], num_heads=[2, 4, 4],
                                        window_size=[4, 4], num_classes=10))
    torch.save(theirs.state_dict(), tmp_path / "swin.pth")
    ours = vitkit.create_model(SWIN, checkpoint=tmp_path / "swin.pth",
                               **{k: v for k, v in SWIN_KW.items() if k != "num_classes"})
    assert ours.load_report.format == "torchvision-swin"
    _same_logits(ours, theirs, 64)


@pytest.mark.slow
@pytest.mark.parametrize("tv_name, name", [("vit_b_16", "vit_base_patch16_224"),
                                           ("swin_t", "swin_tiny_patch4_window7_224")])
def test_torchvision_full_size(tv_name, name, tmp_path):
    theirs = _randomize(getattr(torchvision.models, tv_name)())
    torch.save(theirs.state_dict(), tmp_path / "w.pth")
    _same_logits(vitkit.create_model(name, checkpoint=tmp_path / "w.pth"), theirs, 224)


# --- transformers ---------------------------------------------------------------------------------

def test_transformers_vit_folder(tmp_path):
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, image_size=32,
                    patch_size=8, num_labels=5, id2label={i: f"c{i}" for i in range(5)})
    theirs = _randomize(ViTForImageClassification(cfg))
    theirs.save_pretrained(tmp_path)
    ours = vitkit.create_model(checkpoint=tmp_path)
    assert ours.load_report.format == "transformers-vit"
    assert ours.cfg.norm_eps == 1e-12 and ours.class_names == [f"c{i}" for i in range(5)]
    _same_logits(ours, theirs, 32)


def test_transformers_distilled_deit_folder(tmp_path):
    """transformers' DeiT (``model_type: deit``, the facebook/deit-*-distilled-* folders): class and distillation
    tokens and both heads; its logits, the two heads' mean, are the distilled preset's. The fine-tuning class,
    whose one classifier reads the class token, loads with a new distillation head for a new class count."""
    from transformers import DeiTConfig, DeiTForImageClassification, DeiTForImageClassificationWithTeacher

    cfg = DeiTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, image_size=32,
                     patch_size=8, num_labels=5)
    theirs = _randomize(DeiTForImageClassificationWithTeacher(cfg))
    theirs.save_pretrained(tmp_path / "teacher")
    ours = vitkit.create_model(checkpoint=tmp_path / "teacher")
    assert ours.load_report.format == "transformers-vit" and ours.name == "deit_base_distilled_patch16_224"
    assert ours.num_prefix_tokens == 2 and ours.cfg.embed_dim == 64 and ours.cfg.depth == 2
    _same_logits(ours, theirs, 32)
    _randomize(DeiTForImageClassification(cfg)).save_pretrained(tmp_path / "plain")
    tuned = vitkit.create_model(checkpoint=tmp_path / "plain", num_classes=3)
    assert sorted(tuned.load_report.new_head) == ["head.bias", "head.weight", "head_dist.bias", "head_dist.weight"]


def test_transformers_swin_folder(tmp_path):
    from transformers import SwinConfig, SwinForImageClassification

    cfg = SwinConfig(embed_dim=32, depths=[2, 2, 2], num_heads=[2, 4, 4], image_size=64, patch_size=4, window_size=4,
                     num_labels=5)
    theirs = _randomize(SwinForImageClassification(cfg))
    theirs.save_pretrained(tmp_path)
    ours = vitkit.create_model(checkpoint=tmp_path)
    assert ours.load_report.format == "transformers-swin"
    _same_logits(ours, theirs, 64)


@pytest.mark.parametrize("name", ["vit", "swin"])
def test_transformers_4x_key_names(name):
    """Folders written by transformers 4.46 (``encoder.layer.N.attention.attention.query``, ...), the
    names most checkpoints on disk carry; made by tests/fixtures/make_transformers4.py."""
    folder = Path(__file__).parent / "fixtures" / f"transformers4_{name}"
    expected = torch.load(folder / "expected.pt", weights_only=True)
    ours = vitkit.create_model(checkpoint=folder).eval()
    assert ours.load_report.format == f"transformers-{name}" and ours.load_report.ok
    with torch.no_grad():
        assert_close(ours(expected["input"]), expected["logits"], atol=1e-4, rtol=0)


# --- adaptation: timm's own resized load is the reference --------------------------------------------

def _timm_load(name, file, **kw):
    """timm's own pretrained load of ``file`` (it adapts positions, windows and channels itself)."""
    overlay = dict(file=str(file), custom_load=False, num_classes=kw["num_classes"])
    return timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, **kw).eval()


def test_vit_resolution_change_matches_timm(timm_vit, tmp_path):
    torch.save(timm_vit.state_dict(), tmp_path / "w.pth")
    kw = dict(VIT_KW, img_size=48)
    ours = vitkit.create_model(VIT, checkpoint=tmp_path / "w.pth", **kw)
    assert any("pos_embed: resampled" in n for n in ours.load_report.adapted)
    _same_logits(ours, _timm_load(VIT, tmp_path / "w.pth", **kw), 48)


def test_swin_window_change_matches_timm(timm_swin, tmp_path):
    torch.save(timm_swin.state_dict(), tmp_path / "w.pth")
    kw = dict(SWIN_KW, img_size=96, window_size=6)
    ours = vitkit.create_model(SWIN, checkpoint=tmp_path / "w.pth", **kw)
    assert sum("relative-position table resized" in n for n in ours.load_report.adapted) == 6
    _same_logits(ours, _timm_load(SWIN, tmp_path / "w.pth", **kw), 96)


def test_in_chans_change_matches_timm(timm_vit, tmp_path):
    torch.save(timm_vit.state_dict(), tmp_path / "w.pth")
    for chans in (1, 4):
        kw = dict(VIT_KW, in_chans=chans)
        ours = vitkit.create_model(VIT, checkpoint=tmp_path / "w.pth", **kw)
        _same_logits(ours, _timm_load(VIT, tmp_path / "w.pth", **kw), 32, chans=chans)


def test_new_head_keeps_the_backbone_and_says_so(timm_vit, tmp_path):
    torch.save(timm_vit.state_dict(), tmp_path / "w.pth")
    ours = vitkit.create_model(VIT, checkpoint=tmp_path / "w.pth", **dict(VIT_KW, num_classes=3))
    assert ours.head.out_features == 3
    assert [n for n in ours.load_report.adapted if "new classifier" in n] == [
        "head.weight: new classifier (3, 192) (checkpoint has (10, 192)), initialised fresh",
        "head.bias: new classifier (3,) (checkpoint has (10,)), initialised fresh"]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert_close(ours.forward_features(x), timm_vit.forward_features(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name, kw, size", [(VIT, VIT_KW, 32), (SWIN, SWIN_KW, 64)], ids=["vit", "swin"])
def test_a_headless_backbone_file_loads_with_a_new_head_and_stays_strict_elsewhere(name, kw, size, tmp_path):
    """A backbone saved by timm with num_classes=0 (as DINO, CLIP towers and MAE ship): alone it builds a headless
    model (timm's features), with num_classes it gets a new head at the model's initialisation, by every path
    that loads a file; a missing or unexpected backbone key is still refused."""
    theirs = _randomize(timm.create_model(name, **dict(kw, num_classes=0)))
    sd = {k: v.contiguous() for k, v in theirs.state_dict().items()}
    assert not [k for k in sd if k.startswith("head.")]
    save_file(sd, tmp_path / "backbone.safetensors")
    path = tmp_path / "backbone.safetensors"
    bare = vitkit.create_model(name, checkpoint=path, **{k: v for k, v in kw.items() if k != "num_classes"})
    assert bare.cfg.num_classes == 0 and bare.load_report.ok and not bare.load_report.new_head
    _same_logits(bare, theirs, size)  # pooled features, as timm's num_classes=0 model returns
    heads = ["head.fc.bias", "head.fc.weight"] if name == SWIN else ["head.bias", "head.weight"]
    for load in (dict(checkpoint=path), dict(pretrained=str(path))):
        torch.manual_seed(0)
        ours = vitkit.create_model(name, **load, **dict(kw, num_classes=5))
        report = ours.load_report
        assert report.ok and "head: new (not in the checkpoint)" in report.adapted and report.new_head == heads
        assert "the classifier (" in str(report) and "keeps the model's initialisation" in str(report)
        torch.manual_seed(0)
        fresh = vitkit.create_model(name, **dict(kw, num_classes=5))  # the same initialisation, no weights
        for k in heads:
            assert_close(ours.state_dict()[k], fresh.state_dict()[k], rtol=0, atol=0)
        x = torch.randn(2, 3, size, size)
        with torch.no_grad():
            assert_close(ours.eval().forward_head(ours.forward_features(x), pre_logits=True), bare(x), atol=1e-5,
                         rtol=0)
    block = next(k for k in sd if ".norm1.weight" in k)
    save_file({k: v for k, v in sd.items() if k != block}, tmp_path / "missing.safetensors")
    with pytest.raises(CheckpointMismatchError, match=rf"missing from the checkpoint \(1\):\n    {re.escape(block)}"):
        vitkit.create_model(name, checkpoint=tmp_path / "missing.safetensors", **dict(kw, num_classes=5))
    save_file({**sd, "extra.weight": torch.zeros(2)}, tmp_path / "extra.safetensors")
    with pytest.raises(CheckpointMismatchError, match=r"unexpected in the checkpoint \(1\):\n    extra.weight"):
        vitkit.create_model(name, checkpoint=tmp_path / "extra.safetensors", **dict(kw, num_classes=5))
    save_file({**sd, heads[1]: torch.zeros(5, bare.num_features)}, tmp_path / "half_head.safetensors")
    with pytest.raises(CheckpointMismatchError, match=rf"missing from the checkpoint \(1\):\n    {heads[0]}"):
        vitkit.create_model(name, checkpoint=tmp_path / "half_head.safetensors", **dict(kw, num_classes=5))


# --- safety and errors ----------------------------------------------------------------------------

class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def test_pickle_that_carries_code_is_refused_and_never_runs(timm_vit, tmp_path):
    marker = tmp_path / "code_ran"
    path = tmp_path / "evil.pth"
    torch.save({"state_dict": timm_vit.state_dict(), "extra": _Payload(str(marker))}, path)
    with pytest.raises(UnsafeCheckpointError, match=r"refused to load .*evil\.pth.*makedirs"):
        vitkit.create_model(VIT, checkpoint=path, **VIT_KW)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["w.pth", "w.safetensors"])
def test_truncated_file_is_a_clear_error(name, timm_vit, tmp_path):
    path = tmp_path / name
    sd = {k: v.contiguous() for k, v in timm_vit.state_dict().items()}
    torch.save(sd, path) if name.endswith("pth") else save_file(sd, path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=rf"{name} is not a readable .*(truncated or corrupt)"):
        vitkit.create_model(VIT, checkpoint=path, **VIT_KW)


def test_a_path_under_the_home_folder_reads_as_a_data_root_does(timm_vit, tmp_path, monkeypatch):
    """``model.checkpoint: ~/runs/w.pth`` in a config (where no shell expands ``~``) reads the file there."""
    monkeypatch.setenv("HOME", str(tmp_path))
    torch.save(timm_vit.state_dict(), tmp_path / "w.pth")
    ours = vitkit.create_model(VIT, checkpoint="~/w.pth", **VIT_KW)
    assert ours.load_report.ok
    with pytest.raises(CheckpointError, match="checkpoint '~no_such_user_here/w.pth' does not exist"):
        vitkit.read_checkpoint("~no_such_user_here/w.pth")


def test_missing_and_empty_paths(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        vitkit.read_checkpoint(tmp_path / "nope.pth")
    with pytest.raises(CheckpointError, match="holds no single weight file"):
        vitkit.read_checkpoint(tmp_path)


def test_wrong_architecture_gets_one_readable_report(timm_vit, tmp_path):
    torch.save(timm_vit.state_dict(), tmp_path / "w.pth")
    with pytest.raises(CheckpointMismatchError) as err:
        vitkit.create_model(VIT, checkpoint=tmp_path / "w.pth", **dict(VIT_KW, depth=3, embed_dim=96, num_heads=3))
    msg = str(err.value)
    assert "format: timm" in msg
    assert "missing from the checkpoint (12):\n    blocks.2.norm1.weight" in msg
    assert "shape mismatches" in msg and "cls_token: checkpoint (1, 1, 192) vs model (1, 1, 96)" in msg
    report = vitkit.load_checkpoint(vitkit.create_model(VIT, **dict(VIT_KW, depth=3)), tmp_path / "w.pth",
                                    strict=False)
    assert len(report.missing) == 12 and not report.mismatched  # what fits was loaded


# --- export -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, kw, size", [(VIT, VIT_KW, 32), (SWIN, SWIN_KW, 64)], ids=["vit", "swin"])
def test_save_pretrained_loads_back_in_vitkit_and_timm(name, kw, size, tmp_path):
    ours = _randomize(vitkit.create_model(name, **kw))
    vitkit.save_pretrained(ours, tmp_path / "export", class_names=[f"c{i}" for i in range(10)])
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["config.json", "model.safetensors"]
    back = vitkit.create_model(checkpoint=tmp_path / "export")
    assert back.load_report.format == "vitkit" and back.class_names[3] == "c3"
    _same_logits(back, ours, size, atol=0)
    _same_logits(_timm_load(name, tmp_path / "export" / "model.safetensors", **kw), ours, size)
    # timm from the folder alone: config.json's model_args carry the sizes that differ from the preset
    _same_logits(timm.create_model(f"local-dir:{tmp_path / 'export'}", pretrained=True).eval(), ours, size)


class _Evil:
    def __reduce__(self):
        return (print, ("executed",))


def test_a_sharded_checkpoint_whose_shard_would_run_code_is_refused(tmp_path, capsys):
    """torch's own conversion unpickles a shard's non-tensor items with weights_only=False; vitkit's reader does
    not: an item that would call ``print`` is refused by name, and nothing runs."""
    import torch.distributed.checkpoint as dcp

    model = vitkit.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1, num_classes=3)
    dcp.save({"state_dict": model.state_dict(), "note": _Evil()}, checkpoint_id=tmp_path / "evil", no_dist=True)
    capsys.readouterr()
    refused = r"evil: its item 'note' asks to import and call (builtins\.)?print"
    with pytest.raises(UnsafeCheckpointError, match=refused):
        vitkit.read_checkpoint(tmp_path / "evil")
    assert "executed" not in capsys.readouterr().out
    dcp.save({"state_dict": model.state_dict(), "note": {"epoch": 3}}, checkpoint_id=tmp_path / "fine", no_dist=True)
    ck = vitkit.read_checkpoint(tmp_path / "fine")
    assert all(torch.equal(ck.state_dict[k], v) for k, v in model.state_dict().items())


def test_a_file_written_atomically_gets_the_permissions_of_a_new_file(tmp_path):
    from vitkit.checkpoints.files import atomic_write

    atomic_write(tmp_path / "x.bin", lambda tmp: tmp.write_bytes(b"1"))
    (tmp_path / "plain.bin").write_bytes(b"1")
    assert (tmp_path / "x.bin").stat().st_mode & 0o777 == (tmp_path / "plain.bin").stat().st_mode & 0o777
