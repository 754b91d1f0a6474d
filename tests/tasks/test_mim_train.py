"""Pre-training through the training command: every MAE / SimMIM recipe runs, the digits recipe learns features
that beat random weights with few labels, writes its pictures and a checkpoint that is a backbone everywhere a
checkpoint goes, resumes exactly and skips a NaN step; bad input ends in one line with nothing written."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

import vitkit
from tests.commands import one_error_line, run_cli
from vitkit.cli import main
from vitkit.cli.train import cli_main

from .conftest import ROOT, TINY_VIT

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
MIM_CONFIGS = [c for c in CONFIGS if yaml.safe_load(c.read_text())["model"]["class_path"].endswith(
    "MaskedImageModeling")]
TINY_SWIN = '{"embed_dim": 16, "depths": [1, 1], "num_heads": [1, 2], "window_size": 4, "patch_size": 2}'
TINY_DECODER = ["--model.decoder_embed_dim", "16", "--model.decoder_depth", "1", "--model.decoder_num_heads", "2"]


def _cpu(root: Path, *extra: str) -> list[str]:
    return ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.num_nodes", "1",
            "--trainer.strategy", "auto", "--trainer.precision", "32-true", "--trainer.default_root_dir", str(root),
            *extra]


@pytest.mark.parametrize("config", MIM_CONFIGS, ids=lambda p: p.stem)
def test_fast_dev_run_every_pretraining_recipe_on_an_unlabeled_folder(config, image_folder, tmp_path):
    """Each recipe as it ships, with a tiny encoder, on a folder read without its labels."""
    cfg = yaml.safe_load(config.read_text())["model"]["init_args"]
    swin = cfg["objective"] == "simmim"
    model = ["--model.model_overrides", TINY_SWIN, "--model.mask_patch_size", "8"] if swin else \
        ["--model.model_overrides", TINY_VIT, *TINY_DECODER]
    cli = cli_main(["fit", "--config", str(config), *_cpu(tmp_path), "--trainer.fast_dev_run", "2", *model,
                    "--data", "vitkit.lit.UnlabeledImageDataModule", "--data.root", str(image_folder),
                    "--data.img_size", "32", "--data.batch_size", "4", "--data.num_workers", "0",
                    "--trainer.logger", "false"])
    assert cli.trainer.global_step == 2 // cli.trainer.accumulate_grad_batches
    assert type(cli.model.model).__name__ == ("SimMIM" if swin else "MaskedAutoencoder")
    assert torch.isfinite(cli.trainer.callback_metrics["val/loss"])
    assert len(cli.datamodule.files) == 36  # every image of both splits: no labels read


PRETRAIN_EPOCHS = 20


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """The digits recipe as it ships (the demo's model), 20 of its 30 epochs, validated on one batch."""
    root = tmp_path_factory.mktemp("mae_digits")
    cli_main(["fit", "-c", "mae_vit_tiny_digits", *_cpu(root / "run"), "--trainer.max_epochs", str(PRETRAIN_EPOCHS),
              "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false"])
    return root / "run"


@pytest.mark.slow
def test_the_pretraining_run_logs_draws_and_checkpoints(pretrained):
    pictures = sorted((pretrained / "reconstructions").glob("epoch_*.png"))
    assert [p.name for p in pictures] == [f"epoch_{e:03d}.png" for e in range(PRETRAIN_EPOCHS)]
    with Image.open(pictures[-1]) as im:
        assert im.format == "PNG" and min(im.size) > 200
    rows = (pretrained / "logs/version_0/metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    val = [float(r.split(",")[header.index("val/loss")]) for r in rows[1:] if r.split(",")[header.index("val/loss")]]
    assert len(val) == PRETRAIN_EPOCHS and val[-1] < val[0] * 0.8, val  # fixed masks: epochs compare
    assert (pretrained / "checkpoints/last.ckpt").exists()


@pytest.mark.slow
def test_the_checkpoint_is_the_presets_backbone_everywhere_a_checkpoint_goes(pretrained, tmp_path, capsys):
    last = pretrained / "checkpoints/last.ckpt"
    encoder = vitkit.create_model(checkpoint=last)  # name and sizes from the checkpoint
    assert encoder.name == "vit_tiny_patch16_224" and encoder.num_classes == 0 and encoder.load_report.ok
    assert (encoder.cfg.embed_dim, encoder.cfg.depth, encoder.cfg.patch_size) == (96, 2, 4)
    state = torch.load(last, weights_only=True)["state_dict"]
    for k, v in encoder.state_dict().items():
        assert torch.equal(v, state[f"model.encoder.{k}"]), k
    assert main(["convert", str(last), str(tmp_path / "encoder")]) == 0
    capsys.readouterr()
    import timm

    theirs = timm.create_model(f"local-dir:{tmp_path / 'encoder'}", pretrained=True).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(theirs(x), encoder.eval()(x))
    img = tmp_path / "digit.png"
    Image.fromarray((np.random.default_rng(0).random((32, 32, 3)) * 255).astype(np.uint8)).save(img)
    assert main(["reconstruct", str(img), str(img), "--checkpoint", str(last), "-o", str(tmp_path / "r.png")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "r.png")
    with Image.open(tmp_path / "r.png") as im:
        assert im.format == "PNG"
    again = vitkit.create_mim(checkpoint=last)  # the decoder too: pre-training can go on
    assert again.heads_report.ok and again.cfg.decoder_embed_dim == 64


def _tune(root: Path, checkpoint: Path | None, freeze: bool, seed: int) -> float:
    """The demo's recipe on 10 labelled digits per class for 30 epochs, pooling by average as MAE fine-tunes and
    probes, from the pre-trained encoder or from random weights."""
    source = ["--model.checkpoint", str(checkpoint)] if checkpoint else []
    mode = ["--model.adaptation", "Frozen", "--model.recipe.lr", "3e-2"] if freeze else ["--model.recipe.lr", "1e-3"]
    cli = cli_main(["fit", "-c", "vit_tiny_digits", *_cpu(root), "--trainer.max_epochs", "30",
                    "--trainer.logger", "false", "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]",
                    "--trainer.check_val_every_n_epoch", "30", "--seed_everything", str(seed),
                    "--data.train_per_class", "10", "--data.batch_size", "32", "--model.recipe.warmup_epochs", "1",
                    "--model.model_overrides.global_pool=avg", *mode, *source])
    return float(cli.trainer.callback_metrics["val/top1"])


@pytest.mark.slow
@pytest.mark.parametrize("freeze", [False, True], ids=["fine_tune", "linear_probe"])
def test_pretraining_on_the_unlabeled_digits_beats_random_weights_with_ten_labels_per_class(pretrained, tmp_path,
                                                                                            freeze):
    """Over seeds 0-4 (pre-training and fine-tuning alike), val top-1 on 360 digits after 30 epochs on 100 labels,
    from the encoder pre-trained on all 1,617 training digits without labels / from random weights / gap:
    fine-tuned 0.622-0.725 / 0.356-0.406 / 0.266-0.353, linear probe 0.569-0.669 / 0.228-0.303 / 0.313-0.380
    (scripts in the note of this change; 2-core AMD EPYC). The bounds sit well outside that spread."""
    tuned = _tune(tmp_path / "tuned", pretrained / "checkpoints/last.ckpt", freeze, 0)
    scratch = _tune(tmp_path / "scratch", None, freeze, 0)
    print(f"freeze={freeze}: pre-trained {tuned:.3f}, random {scratch:.3f}")
    assert tuned >= 0.45 and tuned >= scratch + 0.15, (tuned, scratch)


def _mim_fit(root: Path, *extra: str):
    return cli_main(["fit", "-c", "mae_vit_tiny_digits", *_cpu(root), "--model.model_overrides", TINY_VIT,
                     *TINY_DECODER, "--model.num_pictures", "2", "--trainer.limit_train_batches", "3",
                     "--trainer.limit_val_batches", "2", "--trainer.deterministic", "true", *extra])


@pytest.mark.slow
def test_a_resumed_pretraining_run_ends_where_the_uninterrupted_one_does(tmp_path):
    """The masks, augmentation and schedule of a resumed run are those the uninterrupted run drew."""
    full = _mim_fit(tmp_path / "full", "--trainer.max_epochs", "4")
    _mim_fit(tmp_path / "resumed", "--trainer.max_epochs", "4",
             "--trainer.callbacks+=tests.tasks.ddp_probe.StopAfterEpoch", "--trainer.callbacks.epoch", "2")
    resumed = _mim_fit(tmp_path / "resumed", "--trainer.max_epochs", "4", "--ckpt_path", "last")
    assert resumed.trainer.global_step == full.trainer.global_step == 12
    for (k, a), b in zip(resumed.model.state_dict().items(), full.model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=k)


def test_a_nan_step_is_skipped_and_the_run_goes_on(tmp_path):
    cli = _mim_fit(tmp_path, "--trainer.max_epochs", "2", "--model.recipe.nonfinite_loss", "skip",
                   "--trainer.callbacks+=tests.tasks.ddp_probe.NanLogitsOnce", "--trainer.callbacks.step", "2")
    assert cli.trainer.global_step == 6 and cli.model.bad_steps == 0
    assert all(torch.isfinite(p).all() for p in cli.model.parameters())
    with pytest.raises(FloatingPointError, match="non-finite training loss"):
        _mim_fit(tmp_path / "stop", "--trainer.max_epochs", "1",
                 "--trainer.callbacks+=tests.tasks.ddp_probe.NanLogitsOnce", "--trainer.callbacks.step", "1")


def _place(arg: str, places: dict) -> str:
    for name, path in places.items():
        arg = arg.replace("{" + name + "}", str(path))
    return arg


def _unlabeled(root: Path, n: int, size: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.fromarray((np.random.default_rng(i).random((size, size, 3)) * 255).astype(np.uint8)).save(
            root / f"{i}.png")
    return root


@pytest.mark.parametrize("what, args, says", [
    ("no images", ["--data.root", "{empty}"], "no images under"),
    ("image smaller than a patch", ["--data.root", "{photos}", "--data.img_size", "4"],
     "img_size (4, 4) is smaller than patch_size 8"),
    ("image smaller than the mask block", ["-c", "simmim_swin_base_in1k", "--model.model_name",
                                           "swin_tiny_patch4_window7_224", "--model.model_overrides", TINY_SWIN,
                                           "--model.mask_patch_size", "64", "--data.root", "{photos}"],
     "multiples of the mask block (mask_patch_size) (64 px)"),
    ("mask ratio", ["--model.mask_ratio", "1.5", "--data.root", "{photos}"], "mask_ratio must be in (0, 1)"),
    ("decoder heads", ["--model.decoder_num_heads", "3", "--data.root", "{photos}"],
     "decoder_embed_dim 16 must be divisible by decoder_num_heads 3"),
    ("MAE on Swin", ["--model.model_name", "swin_tiny_patch4_window7_224", "--model.objective", "mae",
                     "--model.model_overrides", TINY_SWIN, "--data.root", "{photos}"], "pre-train Swin with SimMIM"),
    ("another architecture", ["--model.checkpoint", "{swin}", "--data.root", "{photos}"], "does not fit the model"),
])
def test_bad_input_ends_in_one_line_and_nothing_is_written(what, args, says, tmp_path, capfd):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no images here")
    swin = vitkit.save_pretrained(vitkit.create_model("swin_tiny_patch4_window7_224", **json.loads(TINY_SWIN),
                                                      img_size=32, num_classes=0), tmp_path / "swin")
    places = dict(empty=empty, photos=_unlabeled(tmp_path / "photos", 6, 40), swin=swin)
    root = tmp_path / "run"
    recipe = args[:2] if args[0] == "-c" else ["-c", "mae_vit_base_in1k", "--model.model_overrides", TINY_VIT,
                                                 *TINY_DECODER]
    argv = ["train", "fit", *recipe, *_cpu(root), "--data.img_size", "32", "--data.batch_size", "2",
            "--data.num_workers", "0", "--trainer.max_epochs", "1", "--trainer.logger", "false",
            *[_place(a, places) for a in (args[2:] if args[0] == "-c" else args)]]
    line = one_error_line(*run_cli(argv, capfd))
    assert says in line, line
    assert not root.exists() or not list(root.rglob("*.ckpt")), what
