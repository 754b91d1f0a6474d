"""Segmentation heads against their peers: transformers' UperNet on Swin (its folder loaded, every logit), Meta's
DINOv2 linear head (its file's layout, on timm's backbone as Meta's ``get_intermediate_layers`` feeds it), and
DPT on a plain ViT."""

import pytest
import timm
import torch
from torch.nn import functional as F

import vitkit
from vitkit.builder import create_segmenter, load_segmenter
from vitkit.checkpoints import CheckpointError
from vitkit.models.segmentation import build_segmenter

TINY_SWIN = dict(embed_dim=16, depths=[1, 1, 2, 1], num_heads=[1, 2, 2, 4], window_size=7, image_size=224)


def _randomise(model: torch.nn.Module) -> None:
    """Weights far from their init (norms near 1, BatchNorm statistics off 0 / 1), so that a wrong key shows."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if p.ndim == 1 and ("norm" in name or "bn" in name) and name.endswith("weight") else 0.0,
                      0.1)
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)


@pytest.fixture(scope="module")
def upernet(tmp_path_factory):
    from transformers import SwinConfig, UperNetConfig, UperNetForSemanticSegmentation

    backbone = SwinConfig(**TINY_SWIN, out_features=["stage1", "stage2", "stage3", "stage4"])
    config = UperNetConfig(backbone_config=backbone, hidden_size=32, auxiliary_channels=16, num_labels=5,
                           use_auxiliary_head=True, id2label={i: f"c{i}" for i in range(5)})
    model = UperNetForSemanticSegmentation(config).eval()
    _randomise(model)
    folder = tmp_path_factory.mktemp("upernet")
    model.save_pretrained(folder)
    return model, folder


def test_upernet_on_swin_gives_transformers_logits(upernet):
    theirs, folder = upernet
    ours = load_segmenter(folder).eval()
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(pixel_values=x).logits
        maps = theirs.backbone(x).feature_maps
        expected_aux = F.interpolate(theirs.auxiliary_head(maps), size=(224, 224), mode="bilinear")
        out = ours.forward_train(x)
        logits, aux = out.logits, out.aux_logits
    assert expected.abs().max() > 1  # weights that make a wrong key visible
    torch.testing.assert_close(ours(x), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(aux, expected_aux, atol=1e-4, rtol=0)
    assert ours.class_names == [f"c{i}" for i in range(5)]


def _as_mmsegmentation(folder, path) -> None:
    """transformers' UperNet-Swin written as mmsegmentation's checkpoints hold it: its Swin names
    (``stages.I.blocks.J.attn.w_msa``, a fused qkv, ``ffn.layers``), patch merging in ``nn.Unfold``'s channel order
    (each channel's 4 pixels together: what mmsegmentation's swin2mmseg converter does to the original Swin's), the
    per-stage norms as ``backbone.normI``, ``bn`` and ``conv_seg``, the class names in ``meta``. From the folder
    transformers saved, in the names its converter writes."""
    from safetensors.torch import load_file

    sd = load_file(folder / "model.safetensors")
    out = {}
    rename = {"layernorm_before": "norm1", "layernorm_after": "norm2", "attention.output.dense": "attn.w_msa.proj",
              "intermediate.dense": "ffn.layers.0.0", "output.dense": "ffn.layers.1",
              "attention.self.relative_position_bias_table": "attn.w_msa.relative_position_bias_table"}

    def unfold_order(x):  # (out, 4C) or (4C,): four blocks of C (pixels 0, 2, 1, 3 of a 2x2) -> C groups of four
        return x.reshape(-1, 4, x.shape[-1] // 4)[:, [0, 2, 1, 3]].transpose(1, 2).reshape(x.shape)

    for key, value in sd.items():
        if key.startswith("backbone.encoder.layers."):
            i, rest = key.removeprefix("backbone.encoder.layers.").split(".", 1)
            if rest.startswith("downsample."):
                out[f"backbone.stages.{i}.{rest}"] = unfold_order(value)
                continue
            _, j, part = rest.split(".", 2)
            stem = f"backbone.stages.{i}.blocks.{j}."
            for src, dst in rename.items():
                if part == src or part.startswith(src + "."):
                    out[stem + dst + part[len(src):]] = value
            if part.startswith("attention.self.query."):
                end = part.removeprefix("attention.self.query.")
                out[f"{stem}attn.w_msa.qkv.{end}"] = torch.cat(
                    [sd[f"{key[:-len(part)]}attention.self.{k}.{end}"] for k in ("query", "key", "value")])
        elif key.startswith("backbone.hidden_states_norms.stage"):
            stage, part = key.removeprefix("backbone.hidden_states_norms.stage").split(".")
            out[f"backbone.norm{int(stage) - 1}.{part}"] = value
        elif key.startswith("backbone.embeddings."):
            out[key.replace("embeddings.patch_embeddings.projection", "patch_embed.projection").replace(
                "embeddings.norm", "patch_embed.norm")] = value
        elif key.startswith(("decode_head.", "auxiliary_head.")):
            out[key.replace(".batch_norm.", ".bn.").replace("classifier.", "conv_seg.")] = value
    torch.save({"meta": {"CLASSES": tuple(f"m{i}" for i in range(5))}, "state_dict": out}, path)


def test_an_mmsegmentation_upernet_swin_checkpoint_gives_transformers_logits(upernet, tmp_path):
    """mmsegmentation's layout of the same weights (transformers' converter reads it: renamed keys, split qkv,
    patch merging back from ``nn.Unfold``'s order) loads strictly and gives the same logits."""
    theirs, folder = upernet
    _as_mmsegmentation(folder, tmp_path / "upernet_swin.pth")
    ours = load_segmenter(tmp_path / "upernet_swin.pth").eval()
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(pixel_values=x).logits, atol=1e-4, rtol=0)
    assert ours.class_names == [f"m{i}" for i in range(5)]
    torch.save({"state_dict": {"backbone.layers.0.weight": torch.zeros(1)}}, tmp_path / "other.pth")
    with pytest.raises(CheckpointError, match="neither a transformers UperNet folder nor an mmsegmentation"):
        load_segmenter(tmp_path / "other.pth")
    cut = torch.load(tmp_path / "upernet_swin.pth", weights_only=True)
    del cut["state_dict"]["backbone.norm2.weight"]
    torch.save(cut, tmp_path / "cut.pth")
    with pytest.raises(CheckpointError, match="cut.pth: an mmsegmentation UperNet-Swin checkpoint without "
                                              "backbone.norm2.weight"):
        load_segmenter(tmp_path / "cut.pth")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_segmenter(tmp_path / "missing.pth")


@pytest.mark.parametrize("size", [(256, 256), (288, 352)])
def test_upernet_swin_at_sizes_that_are_not_whole_windows_gives_transformers_logits(upernet, size):
    """Maps that are not a whole number of 7x7 windows (64x64 at 256 px; 72x88) are padded; transformers' and
    mmsegmentation's Swin attend the padding as zero vectors, and the loaded model does the same (its config's
    ``attend_padding``), eager, scripted and traced (the windows planned for the size), within 1e-4."""
    theirs, folder = upernet
    ours = load_segmenter(folder, img_size=size).eval()
    assert ours.backbone.cfg.attend_padding
    x = torch.randn(1, 3, *size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = theirs(pixel_values=x).logits
        torch.testing.assert_close(ours(x), expected, atol=1e-4, rtol=0)
        backbone = ours.backbone
        eager = backbone.forward_features(x)
        torch.testing.assert_close(torch.jit.script(backbone).forward_features(x), eager, atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.fx.symbolic_trace(backbone)(x), backbone(x), atol=1e-5, rtol=0)
        masked = load_segmenter(folder, img_size=size).eval()
        masked.backbone.configure(attend_padding=False)
        assert (masked(x) - expected).abs().max() > 1e-2  # masking the padding instead is another model


@pytest.fixture(scope="module")
def small_windows(tmp_path_factory):
    """An UperNet-Swin whose last stages are no larger than their window at its own size (4 px windows, 128 px)."""
    from transformers import SwinConfig, UperNetConfig, UperNetForSemanticSegmentation

    backbone = SwinConfig(embed_dim=40, depths=[1, 1, 3, 1], num_heads=[1, 2, 2, 4], window_size=4, image_size=128,
                          out_features=["stage1", "stage2", "stage3", "stage4"])
    config = UperNetConfig(backbone_config=backbone, hidden_size=32, auxiliary_channels=16, num_labels=9,
                           use_auxiliary_head=True)
    model = UperNetForSemanticSegmentation(config).eval()
    _randomise(model)
    folder = tmp_path_factory.mktemp("upernet_small_windows")
    model.save_pretrained(folder)
    return model, folder


@pytest.mark.parametrize("size", [(128, 128), (96, 160), (64, 64), (36, 52)])
def test_upernet_swin_keeps_transformers_windows_where_a_stage_is_smaller_than_its_window(small_windows, size):
    """transformers' SwinBackbone (and mmsegmentation's Swin) keep the configured window and shift at every map size
    and pad, where a classification Swin (timm's) shrinks a window larger than the map and stops shifting. A loaded
    UperNet keeps its backbone's rule (``always_partition``), built at the file's size or at the input's, eager and
    scripted; at the sizes where the rules part, timm's rule gives another model."""
    theirs, folder = small_windows
    x = torch.randn(1, 3, *size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = theirs(pixel_values=x).logits
        for built_at in (None, size):
            ours = load_segmenter(folder, img_size=built_at).eval()
            assert ours.backbone.cfg.always_partition
            torch.testing.assert_close(ours(x), expected, atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.jit.script(ours.backbone).forward_features(x),
                                   ours.backbone.forward_features(x), atol=1e-5, rtol=0)
        ours.backbone.configure(always_partition=False)
        shrunk = (ours(x) - expected).abs().max()
    assert shrunk < 1e-4 if size == (128, 128) else shrunk > 1e-3, shrunk  # the rules agree at the file's size only


def test_a_segmenter_built_alike_but_not_loaded_differs(upernet):
    """The parity above is the weights', not a property of any two models of this shape."""
    theirs, _ = upernet
    backbone = vitkit.create_model("swin_tiny_patch4_window7_224", num_classes=0, embed_dim=16,
                                   depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4))
    ours = build_segmenter(backbone, "upernet", 5, channels=32, aux_args=dict(channels=16)).eval()
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        assert (ours(x) - theirs(pixel_values=x).logits).abs().max() > 1


def _dinov2_pair():
    """timm's DINOv2 ViT (2 blocks) and vitkit's, with the same weights."""
    theirs = timm.create_model("vit_small_patch14_dinov2", pretrained=False, depth=4, img_size=56, num_classes=0)
    _randomise(theirs)
    ours = vitkit.create_model("vit_small_patch14_dinov2", num_classes=0, depth=4, img_size=56)
    ours.load_state_dict(theirs.state_dict())
    return theirs.eval(), ours


@pytest.mark.parametrize("layers", [1, 4])
def test_dinov2_linear_head_file_gives_metas_computation(layers, tmp_path, monkeypatch):
    """Meta's head file (mmsegmentation: ``meta`` and ``state_dict`` of ``decode_head.bn`` and ``.conv_seg``) on
    the backbone's last ``layers`` maps with the final norm, as Meta's ``get_intermediate_layers`` gives them,
    BatchNorm, 1x1 conv, bilinear to the image."""
    theirs, ours = _dinov2_pair()
    width = 384 * layers
    g = torch.Generator().manual_seed(2)
    head = {"decode_head.conv_seg.weight": torch.randn(7, width, 1, 1, generator=g) * 0.1,
            "decode_head.conv_seg.bias": torch.randn(7, generator=g),
            "decode_head.bn.weight": 1 + 0.1 * torch.randn(width, generator=g),
            "decode_head.bn.bias": 0.1 * torch.randn(width, generator=g),
            "decode_head.bn.running_mean": 0.1 * torch.randn(width, generator=g),
            "decode_head.bn.running_var": 1 + 0.2 * torch.rand(width, generator=g),
            "decode_head.bn.num_batches_tracked": torch.tensor(80000)}
    path = tmp_path / "dinov2_vits14_ade20k_linear_head.pth"
    torch.save({"meta": {"CLASSES": [f"c{i}" for i in range(7)], "PALETTE": [[0, 0, 0]] * 7},
                "state_dict": head}, path)
    monkeypatch.setattr(vitkit.builder, "create_model", lambda *a, **k: ours)
    model = create_segmenter("vit_small_patch14_dinov2", head="linear", num_classes=7, head_checkpoint=path).eval()
    x = torch.randn(2, 3, 56, 56, generator=g)
    with torch.no_grad():
        maps = theirs.forward_intermediates(x, indices=layers, norm=True, intermediates_only=True)
        feats = torch.cat(maps, dim=1)
        feats = F.batch_norm(feats, head["decode_head.bn.running_mean"], head["decode_head.bn.running_var"],
                             head["decode_head.bn.weight"], head["decode_head.bn.bias"], eps=1e-5)
        logits = F.conv2d(feats, head["decode_head.conv_seg.weight"], head["decode_head.conv_seg.bias"])
        expected = F.interpolate(logits, size=(56, 56), mode="bilinear", align_corners=False)
        torch.testing.assert_close(model(x), expected, atol=1e-4, rtol=0)


def _shapes(n: int, size: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Images of coloured rectangles on grey noise, and their masks: 0 background, k + 1 where channel k is lit."""
    x = 0.3 * torch.randn(n, 3, size, size, generator=g)
    mask = torch.zeros(n, size, size, dtype=torch.long)
    for i in range(n):
        for k in range(2):
            top, left = torch.randint(0, size // 2, (2,), generator=g).tolist()
            h, w = torch.randint(size // 4, size // 2, (2,), generator=g).tolist()
            x[i, k, top:top + h, left:left + w] += 2.0
            mask[i, top:top + h, left:left + w] = k + 1
    return x, mask


@pytest.mark.slow
def test_dpt_on_a_plain_vit_gives_a_map_per_pixel_and_learns_it():
    torch.manual_seed(0)
    backbone = vitkit.create_model("vit_tiny_patch16_224", num_classes=0, depth=4, img_size=64)
    model = build_segmenter(backbone, "dpt", 3, channels=32)
    assert model.indices == [0, 1, 2, 3]
    x, target = _shapes(8, 64, torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for _ in range(30):
        loss = F.cross_entropy(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        out = model(x)
    assert out.shape == (8, 3, 64, 64)
    background = (target == 0).float().mean().item()
    assert (out.argmax(1) == target).float().mean().item() > background + 0.4 * (1 - background)


def test_segmentation_files_that_do_not_fit_are_named(tmp_path, upernet):
    import json
    import shutil

    _, folder = upernet
    other = tmp_path / "vit_upernet"
    shutil.copytree(folder, other)
    config = json.loads((other / "config.json").read_text())
    config["backbone_config"]["model_type"] = "convnext"
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="'convnext' backbone; vitkit reads UperNet on Swin"):
        load_segmenter(other)
    head = tmp_path / "head.pth"
    torch.save({"state_dict": {"decode_head.conv_seg.weight": torch.zeros(3, 100, 1, 1),
                               "decode_head.bn.running_mean": torch.zeros(100)}}, head)
    with pytest.raises(CheckpointError, match="over 100 channels does not fit a backbone of width 192"):
        create_segmenter("vit_tiny_patch16_224", head="linear", num_classes=3, head_checkpoint=head)
    with pytest.raises(ValueError, match=r"indices \[12\] are not layers of vit_tiny_patch16_224, which has 2"):
        build_segmenter(vitkit.create_model("vit_tiny_patch16_224", num_classes=0, depth=2), "linear", 3, [12])
    with pytest.raises(ValueError, match=r"indices must name distinct layers in increasing order .*, got \[1, 0\]"):
        build_segmenter(vitkit.create_model("vit_tiny_patch16_224", num_classes=0, depth=2), "upernet", 3, [-1, 0])
    with pytest.raises(ValueError, match="head must be one of"):
        build_segmenter(vitkit.create_model("vit_tiny_patch16_224", num_classes=0, depth=1), "fcn", 3)


def test_a_vit_segmenter_exports_to_onnx_at_any_size(tmp_path):
    """(UperNet's pooling pyramid exports at any size too: the learning test in tests/tasks exports one.)"""
    from vitkit.deploy.export import export_onnx
    from vitkit.deploy.onnx_model import OnnxModel

    backbone = vitkit.create_model("vit_tiny_patch16_224", num_classes=0, depth=1, img_size=64)
    model = build_segmenter(backbone, "linear", 4).eval()
    report = export_onnx(model, tmp_path / "seg.onnx")  # checked against PyTorch at 64 x 64 and another size
    assert report.dynamic == ["batch", "height", "width"] and len(report.checks) == 3
    onnx = OnnxModel(tmp_path / "seg.onnx")
    assert onnx.meta["task"] == "segmentation" and onnx(torch.randn(1, 3, 96, 48).numpy()).shape == (1, 4, 96, 48)


@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "swin_tiny_patch4_window7_224"])
def test_layer_decay_ranks_a_segmenters_backbone_as_the_backbone_alone(name):
    """The segmenter's layer groups are its backbone's under ``backbone.``; the heads rank with the last layer, and
    the backbone's names without weight decay keep none."""
    from vitkit.training.optim import layer_ids, param_groups

    backbone = vitkit.create_model(name, num_classes=0, **({"depth": 2} if name.startswith("vit") else {}))
    model = build_segmenter(backbone, "upernet", 3, channels=16)
    ids, alone = layer_ids(model), layer_ids(backbone)
    assert {k: ids[f"backbone.{k}"] for k in alone} == alone
    top = max(ids.values())
    assert top == max(alone.values()) + 1 and {ids[k] for k in ids if not k.startswith("backbone.")} == {top}
    names = {n for g in param_groups(model, 0.05, 0.75) if g["weight_decay"] == 0 for n in g["names"]}
    assert {f"backbone.{n}" for n in backbone.no_weight_decay()} & set(ids) <= names
