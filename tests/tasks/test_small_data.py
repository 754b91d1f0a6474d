"""A pretrained backbone on a few labelled images, as a user meets it through the command: ``finetune_small_data``
fits the head on the frozen features first (the logistic regression ``vitkit evaluate --linear-probe`` scores),
logs and saves that probe, and ends above it; batches fit the data; LoRA through peft trains adapters whose merged
model timm loads strictly and whose adapter folder peft loads, both to the same logits.

The backbone is pre-trained here on the digits 0-4 (scikit-learn's real 8x8 digits as a folder of 32 px PNGs);
the small labelled set is 20 images of each of the digits 5-9, validated on the rest of them."""

import csv
import json
import re
import sys
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file

import vitkit
from tests.commands import one_error_line, run_cli
from vitkit.cli.train import cli_main

from .conftest import run_in_repo
from .test_folder_digits import write_digits

CPU = ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.precision", "32-true",
       "--trainer.enable_progress_bar", "false"]


@pytest.fixture(scope="module")
def backbone(tmp_path_factory) -> Path:
    """The digits recipe trained on the digits 0-4 of a folder: a Lightning checkpoint with a 5-class head."""
    root = tmp_path_factory.mktemp("backbone")
    cli_main(["fit", "-c", "vit_tiny_digits", "--data", "vitkit.lit.ImageFolderDataModule", "--data.root",
              str(write_digits(root / "old", 32, classes=range(5))), "--data.img_size", "32",
              "--trainer.max_epochs", "6", "--trainer.limit_val_batches", "1", "--trainer.default_root_dir",
              str(root / "run"), *CPU])
    return root / "run/checkpoints/last.ckpt"


@pytest.fixture(scope="module")
def few(tmp_path_factory) -> Path:
    return write_digits(tmp_path_factory.mktemp("few"), 32, per_class=20, classes=range(5, 10))


def _top1(root: Path) -> list[float]:
    rows = list(csv.DictReader(open(next(root.glob("logs/version_0/metrics.csv")))))
    return [float(r["val/top1"]) for r in rows if r.get("val/top1")]


def _probe_as_logged_and_evaluated(run: Path, few: Path, tmp_path: Path, capsys, baseline: float,
                                   score: str) -> float:
    """The run logged its probe's score once, as val/probe_baseline; what `vitkit evaluate` of probe.ckpt gives as
    ``score``."""
    rows = list(csv.DictReader(open(run / "logs/version_0/metrics.csv")))
    assert [float(r["val/probe_baseline"]) for r in rows if r.get("val/probe_baseline")] == \
        [pytest.approx(baseline, abs=1e-4)]
    status, err = run_cli(["evaluate", "--checkpoint", str(run / "checkpoints/probe.ckpt"), "--data.root", str(few),
                           "--data.img_size", "32", "-o", str(tmp_path / "probe_ckpt")], capsys)
    assert status == 0, err
    return json.loads((tmp_path / "probe_ckpt/metrics.json").read_text())[score]


@pytest.mark.slow
def test_the_recipe_fits_the_probe_first_and_ends_above_it(backbone, few, tmp_path, capsys, said, monkeypatch):
    """The digits 5-9 with 20 labels each, from the backbone of the digits 0-4. In this test's order of the data
    (seed 0) the probe scores 0.508 and the run's best, the EMA the recipe keeps, 0.597 (a
    tiny 2-block model at 32 px takes a larger step than the recipe's 1e-4 for ViT-S/B backbones, as the digits
    recipes do)."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    status, err = run_cli(["train", "fit", "-c", "finetune_small_data", "--model.checkpoint", str(backbone),
                           "--data.root", str(few), "--data.img_size", "32", "--model.recipe.lr", "1e-3",
                           "--trainer.default_root_dir", str(run), *CPU], capsys)
    assert status == 0, err
    lines = said.messages
    assert "data: 100 training images give 3 step(s) of batch 32 an epoch; batch 10 gives 10" in lines, lines
    assert "lr: 0.001 for a total batch of 32; this run's is 10 (1 process(es) x batch 10 x 1 accumulated): lr " \
           "0.000559 (x sqrt(10/32))" in lines, lines  # the recipe's rule for AdamW on a small batch
    probe_line = next(m for m in lines if m.startswith("probe: "))
    baseline = float(re.search(r"val/top1 (\d\.\d+)", probe_line).group(1))
    # the baseline is the probe `vitkit evaluate --linear-probe` scores on the backbone's features
    status, err = run_cli(["evaluate", "--checkpoint", str(backbone), "--data.root", str(few), "--data.img_size", "32",
                           "--linear-probe", "-o", str(tmp_path / "probe_eval")], capsys)
    assert status == 0, err
    scored = json.loads((tmp_path / "probe_eval/metrics.json").read_text())["linear_probe_top1"]
    assert baseline == pytest.approx(scored, abs=1e-4)
    # the probe is a classifier checkpoint: evaluate scores it as the baseline
    assert _probe_as_logged_and_evaluated(run, few, tmp_path, capsys, baseline, "top1") == \
        pytest.approx(baseline, abs=0.01)
    best = max(_top1(run))
    print(f"probe {baseline:.3f}, fine-tuned best {best:.3f}")
    assert best >= baseline + 0.02, (baseline, _top1(run))
    assert re.fullmatch(rf"best val/top1 {best:.4f} at epoch \d+: \S+best-\S+\.ckpt \(the probe on frozen "
                        rf"features: {baseline:.4f}\)", lines[-1]), lines[-1]


@pytest.mark.slow
def test_the_average_the_recipe_validates_begins_at_the_probe(backbone, few, tmp_path):
    """finetune_small_data validates an EMA of the weights, begun at the probe once its head is fitted: with steps
    that change nothing (lr 1e-12) its first validation is the probe's score, where an average begun at the model
    as built (the backbone file's head) is not."""
    cli = cli_main(["fit", "-c", "finetune_small_data", "--model.checkpoint", str(backbone), "--data.root", str(few),
                    "--data.img_size", "32", "--model.recipe.lr", "1e-12", "--trainer.max_epochs", "1",
                    "--trainer.default_root_dir", str(tmp_path), *CPU])
    assert cli.model.ema_is_model and _top1(tmp_path) == [pytest.approx(cli.model.probe_baseline, abs=1e-6)]


@pytest.mark.slow
def test_a_run_that_does_not_beat_the_probe_ends_with_the_probe(backbone, few, tmp_path, said):
    """An LR that wrecks the backbone in its one epoch: the best checkpoint is the probe's."""
    cli = cli_main(["fit", "-c", "finetune_small_data", "--model.checkpoint", str(backbone), "--data.root", str(few),
                    "--data.img_size", "32", "--model.recipe.lr", "1.0", "--trainer.max_epochs", "1",
                    "--trainer.default_root_dir", str(tmp_path), *CPU])
    probe = tmp_path / "checkpoints/probe.ckpt"
    assert cli.trainer.checkpoint_callback.best_model_path == str(probe)
    assert said.messages[-1].endswith(f"{probe} (the probe on frozen features; training did not beat it)")


@pytest.mark.slow
def test_a_multi_label_run_on_one_label_folders_scores_its_probe_by_map(backbone, few, tmp_path, capsys, said,
                                                                         monkeypatch):
    """--model.labels MultiLabel on a folder of one label per image: the probe is one regression per class, scored by
    the mAP the run validates by, logs and saves; `vitkit evaluate` of probe.ckpt gives the same mAP, and the run's
    last line sets mAP beside mAP."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    status, err = run_cli(["train", "fit", "-c", "finetune_small_data", "--model.checkpoint", str(backbone),
                           "--data.root", str(few), "--data.img_size", "32", "--model.labels", "MultiLabel",
                           "--trainer.max_epochs", "1", "--trainer.default_root_dir", str(run), *CPU], capsys)
    assert status == 0, err
    probe_line = next(m for m in said.messages if m.startswith("probe: "))
    baseline = float(re.search(r"val/mAP (\d\.\d+)", probe_line).group(1))
    last = said.messages[-1]
    assert _probe_as_logged_and_evaluated(run, few, tmp_path, capsys, baseline, "mAP") == \
        pytest.approx(baseline, abs=0.01)
    assert re.fullmatch(r"best val/mAP \d\.\d{4}.*: \S+\.ckpt \(the probe on frozen features(: "
                        rf"{baseline:.4f}|; training did not beat it)\)", last), last


NOISE = ("💡 Tip", "weights_only", "smaller than the logging interval", "in eval mode at the start of training",
         "LeafSpec", "not supported by the model summary", "No positive samples", "is an Enum subclass",
         "Total FLOPs")  # Lightning's summary counts no FLOPs without an example input: no column of zeros


@pytest.mark.slow
def test_a_run_prints_vitkits_lines_and_not_other_libraries_noise(backbone, few, tmp_path, monkeypatch):
    """The lines Lightning and torchmetrics print in every run (tips, the probe's save, a logging interval longer
    than a small epoch, a frozen backbone in eval mode, what importing torchao logs for LoRA, ...) stay hidden from a
    run started as a user starts it; --verbose shows them."""
    monkeypatch.delenv("VITKIT_VERBOSE", raising=False)
    base = ["--model.checkpoint", str(backbone), "--data.root", str(few), "--data.img_size", "32",
            "--trainer.max_epochs", "1", *CPU]
    cmd = ["-m", "vitkit.cli", "train", "fit", "-c"]
    lora = ["--model.adaptation", "LoRA", "--model.adaptation.rank", "4"]  # peft, which imports torchao
    for recipe, ours, extra in (("linear_probe", "best val/top1", []),
                                ("finetune_small_data", "probe: a logistic regression", lora)):
        done = run_in_repo([*cmd, recipe, *base, *extra, "--trainer.default_root_dir", str(tmp_path / recipe)])
        said = done.stdout + done.stderr
        assert done.returncode == 0, said[-3000:]
        assert ours in said and "trainable" in said and not [n for n in NOISE if n in said], said[-3000:]
    done = run_in_repo([*cmd, "linear_probe", *base, "--trainer.default_root_dir", str(tmp_path / "v"), "--verbose"])
    assert "💡 Tip" in done.stdout + done.stderr and "in eval mode" in done.stdout + done.stderr


@pytest.mark.slow
def test_the_ordinary_recipes_name_the_small_data_recipe_on_small_data(backbone, few, tmp_path, said):
    cli_main(["fit", "-c", "linear_probe", "--model.checkpoint", str(backbone), "--data.root", str(few),
              "--data.img_size", "32", "--trainer.fast_dev_run", "1", *CPU])
    assert any(m.startswith("note: 100 training images, about 20 per class: on a set this small, `vitkit train fit "
                            "-c finetune_small_data`") for m in said.messages), said.messages


# -- LoRA -------------------------------------------------------------------------------------------------------

TINY = {  # every family vitkit loads, at a tiny size
    "vit_small_patch16_224": dict(depth=2, img_size=32, embed_dim=64, num_heads=2),
    "deit_small_distilled_patch16_224": dict(depth=2, img_size=32, embed_dim=64, num_heads=2),
    "swin_tiny_patch4_window7_224": dict(depths=(1, 1), num_heads=(1, 2), embed_dim=16, window_size=4, img_size=32),
    "vit_base_patch16_clip_224": dict(depth=2, img_size=32, embed_dim=64, num_heads=2),
    "vit_base_patch16_siglip_224": dict(depth=2, img_size=32, embed_dim=64, num_heads=2),
    "vit_small_patch14_dinov2": dict(depth=2, img_size=28, embed_dim=64, num_heads=2),
    # timm's Eva class: LayerScale as gamma_1 / gamma_2, EVA-02's q, k, v projections apart, its SwiGLU packed
    "eva02_tiny_patch14_224": dict(depth=2, img_size=28),
    "eva02_base_patch14_224": dict(depth=2, img_size=28, embed_dim=64, num_heads=2),
    "vit_small_patch16_dinov3": dict(depth=2, img_size=32, embed_dim=64, num_heads=2),
}
MLP = {"eva02_tiny_patch14_224": ["mlp.fc1_g", "mlp.fc1_x"], "vit_small_patch16_224": ["mlp.fc1"]}
# timm's Eva computes a fused qkv that has q and v biases from qkv.weight directly: an adapter there is refused
FUSED_WITH_BIASES = ("eva02_tiny_patch14_224",)


@pytest.mark.parametrize("name", list(TINY))
def test_lora_merges_to_the_same_logits_and_its_adapter_folder_loads_in_peft(name, tmp_path):
    """The merged model loads strictly into timm's model of the preset and gives the adapted model's logits; the
    adapter folder, put by peft onto timm's model with the backbone's weights, gives them too, and so does vitkit's
    own reading of it (:func:`vitkit.checkpoints.adapters.load_adapter`). Adapters on the query and value rows
    alone, and for two presets on the MLP too (EVA-02's SwiGLU halves, which timm packs into one layer)."""
    from peft import PeftModel

    from vitkit.checkpoints.adapt import classifier_names
    from vitkit.checkpoints.adapters import load_adapter, save_adapter
    from vitkit.models.lora import DEFAULT_TARGETS, LoraSettings, add_lora, merge_lora

    torch.manual_seed(0)
    kw = {**TINY[name], "num_classes": 3}
    model = vitkit.create_model(name, **kw).eval()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    targets = [t for t in DEFAULT_TARGETS if name not in FUSED_WITH_BIASES or t != "attn.qkv"] + MLP.get(name, [])
    names = add_lora(model, LoraSettings(rank=4, alpha=8, parts="qv", targets=targets))
    assert names and all(n.endswith(tuple(targets)) for n in names)
    with torch.no_grad():  # as after training: adapters away from their zero start, a new head
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
        head = model.get_classifier()
        (head[0] if isinstance(head, tuple) else head).weight.normal_()  # DeiT's class head of its two
    size = kw["img_size"]
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        before = model(x)
    heads = classifier_names(model)
    heads = [heads] if isinstance(heads, str) else list(heads)
    save_adapter(model, tmp_path / "adapter", name, heads)
    trained = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k or k.split(".")[0] in heads}
    if "attn.qkv" in targets:
        qkv = model.get_submodule(next(n for n in names if n.endswith("qkv"))).lora_B["default"].weight
        third = qkv.shape[0] // 3
        assert qkv[third:2 * third].abs().max() == 0 and qkv[:third].abs().max() > 0  # the key rows not adapted
    merged = merge_lora(model)
    assert not [n for n in merged.state_dict() if "lora" in n or "base_layer" in n]
    with torch.no_grad():
        torch.testing.assert_close(merged(x), before, atol=1e-5, rtol=1e-5)
    vitkit.save_pretrained(merged, tmp_path / "merged")
    theirs = timm.create_model(name, **kw).eval()
    theirs.load_state_dict(load_file(tmp_path / "merged/model.safetensors"), strict=True)
    plain = timm.create_model(name, **kw).eval()
    ours = vitkit.create_model(name, **kw).eval()
    ours.load_state_dict(base, strict=True)
    vitkit.save_pretrained(ours, tmp_path / "base")  # the backbone's weights in timm's names
    plain.load_state_dict(load_file(tmp_path / "base/model.safetensors"), strict=True)
    load_adapter(ours, tmp_path / "adapter")
    assert sorted(k for k, v in ours.state_dict().items() if k in trained) == sorted(trained)
    with torch.no_grad():
        torch.testing.assert_close(theirs(x), before, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vitkit.create_model(checkpoint=tmp_path / "merged").eval()(x), before,
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(PeftModel.from_pretrained(plain, tmp_path / "adapter").eval()(x), before,
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours(x), before, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_a_lora_run_keeps_what_trained_and_converts_merged_or_as_an_adapter(backbone, few, tmp_path, capsys):
    from peft import PeftModel

    run = tmp_path / "run"
    cli = cli_main(["fit", "-c", "finetune_small_data", "--model.checkpoint", str(backbone), "--data.root", str(few),
                    "--data.img_size", "32", "--model.adaptation", "LoRA", "--model.adaptation.rank", "4",
                    "--trainer.max_epochs", "2", "--trainer.default_root_dir", str(run), *CPU])
    last = run / "checkpoints/last.ckpt"
    ck = torch.load(last, weights_only=True)
    # what trained, twice: the average the recipe keeps as the model, and the weights being trained (for resuming)
    assert sorted({k.split(".lora_")[0].split(".")[-1] if ".lora_" in k else k for k in ck["state_dict"]}) == \
        ["ema.module.head.bias", "ema.module.head.weight", "model.head.bias", "model.head.weight", "proj", "qkv"]
    assert ck["hyper_parameters"]["checkpoint"] == str(backbone.resolve())  # the backbone it applies to
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ours = cli.model.eval()(x)
    from vitkit.lit import ImageClassifier

    with torch.no_grad():  # the module rebuilt from the checkpoint: its backbone read again from the file it names
        torch.testing.assert_close(ImageClassifier.load_from_checkpoint(last).eval()(x), ours)
    resumed = cli_main(["fit", "-c", "finetune_small_data", "--model.checkpoint", str(backbone), "--data.root",
                        str(few), "--data.img_size", "32", "--model.adaptation", "LoRA", "--model.adaptation.rank", "4",
                        "--trainer.max_epochs", "3", "--trainer.default_root_dir", str(run), "--ckpt_path", "last",
                        *CPU])
    assert resumed.trainer.global_step == cli.trainer.global_step * 3 // 2
    last_after = torch.load(last, weights_only=True)["state_dict"]
    assert not torch.equal(last_after["model.head.weight"], ck["state_dict"]["model.head.weight"])
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ours = resumed.model.eval()(x)
    assert run_cli(["convert", str(last), "-o", str(tmp_path / "merged")], capsys)[0] == 0
    config = json.loads((tmp_path / "merged/config.json").read_text())
    theirs = timm.create_model(config["architecture"], **config["model_args"]).eval()
    theirs.load_state_dict(load_file(tmp_path / "merged/model.safetensors"), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(theirs(x), ours, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vitkit.create_model(checkpoint=last).eval()(x), ours, atol=1e-5, rtol=1e-5)
    full = tmp_path / "full.ckpt"
    assert run_cli(["convert", str(last), str(full.with_suffix(".pth"))], capsys)[0] == 0
    assert last.stat().st_size * 2 < full.with_suffix(".pth").stat().st_size
    assert run_cli(["convert", str(last), "--adapter", "-o", str(tmp_path / "adapter")], capsys)[0] == 0
    plain = timm.create_model(config["architecture"], **config["model_args"]).eval()
    plain.load_state_dict(vitkit.create_model(checkpoint=str(backbone), num_classes=5).state_dict(), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(PeftModel.from_pretrained(plain, tmp_path / "adapter").eval()(x), ours,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("args, expected", [
    (["--model.adaptation", "LoRA", "--model.adaptation.rank", "-1"],
     "LoRA adapts the backbone with adapters of rank >= 1 (lora_rank), got -1"),
    (["--model.adaptation", "LoRA", "--model.adaptation.rank", "4", "--model.adaptation.targets", "[attn.query]"],
     "lora_targets ['attn.query'] match no linear layer of vit_tiny_patch16_224; its linear layers are named like: "
     "attn.qkv, attn.proj, mlp.fc1, mlp.fc2, head"),
    (["--model.adaptation", "LoRA", "--model.adaptation.rank", "4", "--model.adaptation.parts", "qx"],
     "lora_parts must name some of q, k and v once each"),
    (["--model.adaptation", "LoRA", "--model.adaptation.rank", "4", "--model.adaptation.lr_scale", "0"],
     "lora_lr_scale must be > 0 (the adapters' LR over lr), "
     "got 0.0"),
    (["--data.img_size", "[32, 0]"], "img_size must be a positive int or two of them (H W, e.g. [224, 448]), got "
     "(32, 0)"),
    (["--data.crop_mode", "letterbox"], "letterbox"),
])
def test_bad_lora_settings_end_in_one_line(backbone, few, tmp_path, capsys, args, expected):
    line = one_error_line(*run_cli(["train", "fit", "-c", "finetune_small_data", "--model.checkpoint", str(backbone),
                                    "--data.root", str(few), "--trainer.default_root_dir", str(tmp_path), *CPU,
                                    *args], capsys))
    assert expected in line, line


def test_an_adapter_timm_would_ignore_is_refused(tmp_path):
    from vitkit.checkpoints.adapters import save_adapter
    from vitkit.models.lora import LoraSettings, add_lora

    model = vitkit.create_model("eva02_tiny_patch14_224", **TINY["eva02_tiny_patch14_224"], num_classes=3)
    add_lora(model, LoraSettings(rank=4))
    with pytest.raises(ValueError, match=r"^blocks\.0\.attn\.qkv: timm's eva02_tiny_patch14_224 computes its qkv from "
                                         r"qkv\.weight directly .* leave attn\.qkv out$"):
        save_adapter(model, tmp_path / "adapter", "eva02_tiny_patch14_224", ["head"])


def test_an_adapter_vitkits_fused_layers_cannot_hold_is_refused(tmp_path):
    """timm's EVA-02 B adapted with a different lora_A on q_proj and v_proj: vitkit's one qkv cannot take it."""
    from safetensors.torch import save_file

    from vitkit.checkpoints.adapters import load_adapter, save_adapter
    from vitkit.models.lora import LoraSettings, add_lora

    kw = {**TINY["eva02_base_patch14_224"], "num_classes": 3}
    model = vitkit.create_model("eva02_base_patch14_224", **kw)
    add_lora(model, LoraSettings(rank=4, parts="qv"))
    save_adapter(model, tmp_path / "adapter", "eva02_base_patch14_224", ["head"])
    weights = load_file(tmp_path / "adapter/adapter_model.safetensors")
    key = "base_model.model.blocks.0.attn.v_proj.lora_A.weight"
    save_file({**weights, key: weights[key] + 1}, tmp_path / "adapter/adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"the adapters of blocks\.0\.attn's q_proj, k_proj and v_proj have "
                                         r"different lora_A; vitkit's fused qkv takes one"):
        load_adapter(vitkit.create_model("eva02_base_patch14_224", **kw), tmp_path / "adapter")


def test_an_adapter_folder_for_another_model_is_refused_in_one_line(tmp_path):
    from vitkit.checkpoints.adapters import load_adapter, save_adapter
    from vitkit.models.lora import LoraSettings, add_lora

    small = vitkit.create_model("vit_small_patch16_224", **TINY["vit_small_patch16_224"], num_classes=3)
    add_lora(small, LoraSettings(rank=4))
    save_adapter(small, tmp_path / "adapter", "vit_small_patch16_224", ["head"])
    other = vitkit.create_model("vit_small_patch16_224", depth=2, img_size=32, embed_dim=128, num_heads=2)
    with pytest.raises(ValueError, match=r"does not fit vit_small_patch16_224 \(blocks\.0\.attn\.proj\.lora_A\.default"
                                         r"\.weight: adapter \(4, 64\) vs model \(4, 128\)\); base model of the "
                                         r"adapter: vit_small_patch16_224"):
        load_adapter(other, tmp_path / "adapter")
    same = vitkit.create_model("vit_small_patch16_224", **TINY["vit_small_patch16_224"], num_classes=3)
    assert load_adapter(same, tmp_path / "adapter")
    (tmp_path / "adapter/adapter_config.json").write_text('{"peft_type": "LORA", "r": 4')  # cut short
    with pytest.raises(ValueError, match="is not a peft adapter config with r and target_modules"):
        load_adapter(vitkit.create_model("vit_small_patch16_224", **TINY["vit_small_patch16_224"]),
                     tmp_path / "adapter")


def test_lora_without_peft_installed_says_what_to_install_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # as where peft is not installed
    line = one_error_line(*run_cli(["train", "fit", "-c", "vit_tiny_digits", "--model.adaptation", "LoRA",
                                    "--model.adaptation.rank", "4",
                                    "--trainer.default_root_dir", str(tmp_path), *CPU], capsys))
    assert line.endswith("pip install 'vitkit[lora]'"), line
