"""``--data.packing``: a classifier trains and validates on images of their own sizes and aspect ratios, packed into
sequences; ``vitkit evaluate`` scores the checkpoint on the same packed batches; what cannot pack is refused in one
line."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from timm.data.naflex_transforms import get_image_size_for_seq

from tests.commands import error_line_of, run_cli
from vitkit.cli import main
from vitkit.cli.train import cli_main
from vitkit.models.packing import PackedBatch

from .conftest import ROOT, TINY_VIT
from .test_train import _cpu

KINDS = ("rows", "columns")  # the class: stripes across or down the image


def _stripes(kind: str, h: int, w: int, rng: np.random.Generator) -> Image.Image:
    period = int(rng.integers(6, 12))
    line = (np.arange(h if kind == "rows" else w) // (period // 2)) % 2
    grid = np.broadcast_to(line[:, None] if kind == "rows" else line[None, :], (h, w))
    colour = rng.integers(40, 256, size=3)
    return Image.fromarray((grid[..., None] * colour).astype(np.uint8))


@pytest.fixture(scope="module")
def shapes_folder(tmp_path_factory) -> Path:
    """Stripes across or down, on images from 1:3 to 3:1 and 24 to 96 px a side; one unreadable file."""
    root = tmp_path_factory.mktemp("shapes")
    rng = np.random.default_rng(0)
    for split, n in (("train", 24), ("val", 10)):
        for kind in KINDS:
            d = root / split / kind
            d.mkdir(parents=True)
            for i in range(n):
                h, w = (int(s) for s in rng.integers(24, 97, size=2))
                if max(h, w) > 3 * min(h, w):
                    h = min(h, 3 * w)
                    w = min(w, 3 * h)
                _stripes(kind, h, w, rng).save(d / f"{i}.png")
    (root / "train/rows/broken.png").write_bytes(b"not a png")
    return root


def _fit(root: Path, tmp_path: Path, *extra: str):
    return cli_main(["fit", "--config", str(ROOT / "configs/vit_tiny_digits.yaml"), *_cpu(tmp_path),
                     "--model.model_overrides", TINY_VIT, "--data", "vitkit.lit.ImageFolderDataModule",
                     "--data.root", str(root), "--data.img_size", "32", "--data.batch_size", "8",
                     "--data.num_workers", "0", "--data.packing", "true", "--data.max_tokens", "40", *extra])


@pytest.mark.slow  # a run through the command, then evaluate
def test_a_classifier_trains_on_packed_images_and_evaluate_scores_them_the_same(shapes_folder, tmp_path, capsys):
    cli = _fit(shapes_folder, tmp_path, "--trainer.max_epochs", "12", "--data.token_drop", "0.25")
    metrics = cli.trainer.callback_metrics
    assert metrics["val/top1"] >= 0.9  # stripes across or down, learned from packed batches
    assert metrics["train/skipped_files"] == 1 and cli.trainer.current_epoch == 12  # the broken file, each epoch
    x, y, skipped = next(iter(cli.datamodule.train_dataloader()))
    assert isinstance(x, PackedBatch) and len(x) + skipped == 8 and x.patches.shape[1] == 40
    for i, (rows, cols) in enumerate(x.grids):  # each image within the budget of 32 px at 8-px patches, its aspect
        assert rows * cols <= 16  # ratio kept, and a quarter of its patches dropped in training
        assert int(((x.image == i) & (x.index >= 1)).sum()) == max(1, round(rows * cols * 0.75))
    val = next(iter(cli.datamodule.val_dataloader()))[0]
    files = sorted((shapes_folder / "val/columns").glob("*.png"))[:len(val)]  # the folder's order
    for image, file in zip(val.images(), files, strict=True):  # the whole image, at timm's NaFlex size for 16 patches
        w, h = Image.open(file).size
        assert tuple(image.shape[-2:]) == get_image_size_for_seq((h, w), 8, 16)[1]
    ckpt = Path(cli.trainer.checkpoint_callback.dirpath) / "last.ckpt"
    status, _ = run_cli(["evaluate", "--checkpoint", str(ckpt), "--data.root", str(shapes_folder),
                         "--data.packing", "true", "--data.max_tokens", "40", "--out", str(tmp_path / "ev")], capsys)
    assert status == 0
    scored = json.loads((tmp_path / "ev" / "metrics.json").read_text())["top1"]
    assert scored == pytest.approx(float(metrics["val/top1"]), abs=1e-6)
    row = (tmp_path / "ev" / "predictions.csv").read_text().splitlines()[1].split(",")  # source, label, top1, p1
    capsys.readouterr()
    assert main(["predict", "--checkpoint", str(ckpt), row[0], "--max-patches", "16", "--topk", "1"]) == 0
    assert capsys.readouterr().out.strip() == f"{row[0]}: {row[2]} {float(row[3]):.3f}"
    # the run's budget is the model's: predict and evaluate take its images whole without being told
    assert main(["predict", "--checkpoint", str(ckpt), row[0], "--topk", "1"]) == 0
    assert capsys.readouterr().out.strip() == f"{row[0]}: {row[2]} {float(row[3]):.3f}"
    status, _ = run_cli(["evaluate", "--checkpoint", str(ckpt), "--data.root", str(shapes_folder),
                         "--data.max_tokens", "40", "--out", str(tmp_path / "ev2")], capsys)
    assert status == 0 and json.loads((tmp_path / "ev2" / "metrics.json").read_text())["top1"] == scored
    status, _ = run_cli(["evaluate", "--checkpoint", str(ckpt), "--data.root", str(shapes_folder),
                         "--precision", "bf16-mixed", "--out", str(tmp_path / "ev_bf16")], capsys)  # under autocast
    assert status == 0 and abs(json.loads((tmp_path / "ev_bf16" / "metrics.json").read_text())["top1"] - scored) < 0.1
    # its ONNX export records the budget, and onnxruntime takes each image whole as the checkpoint does
    assert main(["export", str(ckpt), "-o", str(tmp_path / "m.onnx")]) == 0
    capsys.readouterr()
    assert main(["predict", "--onnx", str(tmp_path / "m.onnx"), row[0], "--topk", "1"]) == 0
    assert capsys.readouterr().out.strip() == f"{row[0]}: {row[2]} {float(row[3]):.3f}"
    assert "exported with --packed" in error_line_of(["predict", "--onnx", str(tmp_path / "m.onnx"), row[0],
                                                      "--max-patches", "16"])
    status, _ = run_cli(["evaluate", "--onnx", str(tmp_path / "m.onnx"), "--data.root", str(shapes_folder),
                         "--out", str(tmp_path / "ev_plain")], capsys)  # and evaluate too, image by image
    assert status == 0
    assert json.loads((tmp_path / "ev_plain" / "metrics.json").read_text())["top1"] == pytest.approx(scored, abs=1e-6)
    # exported on packed batches, onnxruntime scores the split as the checkpoint does, in packed batches
    assert main(["export", str(ckpt), "--packed", "-o", str(tmp_path / "p.onnx")]) == 0
    status, _ = run_cli(["evaluate", "--onnx", str(tmp_path / "p.onnx"), "--data.root", str(shapes_folder),
                         "--data.max_tokens", "40", "--out", str(tmp_path / "ev3")], capsys)
    assert status == 0
    assert json.loads((tmp_path / "ev3" / "metrics.json").read_text())["top1"] == pytest.approx(scored, abs=1e-6)
    # a folder of class folders alone (no train/ beside them) is scored as it is
    status, _ = run_cli(["evaluate", "--onnx", str(tmp_path / "p.onnx"), "--data.root", str(shapes_folder / "val"),
                         "--data.max_tokens", "40", "--out", str(tmp_path / "ev4")], capsys)
    assert status == 0
    assert json.loads((tmp_path / "ev4" / "metrics.json").read_text())["top1"] == pytest.approx(scored, abs=1e-6)
    ours, *theirs = ((tmp_path / d / "predictions.csv").read_text().splitlines() for d in ("ev", "ev3", "ev_plain"))
    for rows in theirs:
        assert [r.split(",")[:3] for r in ours] == [r.split(",")[:3] for r in rows]  # source, label, top-1
    assert main(["predict", "--onnx", str(tmp_path / "p.onnx"), row[0], "--topk", "1"]) == 0
    assert capsys.readouterr().out.strip() == f"{row[0]}: {row[2]} {float(row[3]):.3f}"


def test_a_hugging_face_stream_trains_on_packed_images(shapes_folder, tmp_path, monkeypatch):
    """The same images as a Hugging Face dataset (save_to_disk), streamed: each batch packed at the images' own
    aspect ratios, and the classifier learns from them as it does from the folder."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    splits = {}
    for split, name in (("train", "train"), ("val", "validation")):
        files = sorted(f for f in (shapes_folder / split).glob("*/*.png") if f.name != "broken.png")
        splits[name] = datasets.Dataset.from_dict(
            {"image": [str(f) for f in files], "label": [KINDS.index(f.parent.name) for f in files]},
            features=datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(KINDS))}))
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "saved"))
    cli = cli_main(["fit", "--config", str(ROOT / "configs/vit_tiny_digits.yaml"), *_cpu(tmp_path),
                    "--model.model_overrides", TINY_VIT, "--data", "vitkit.lit.HFDataModule",
                    "--data.name", str(tmp_path / "saved"), "--data.streaming", "true", "--data.img_size", "32",
                    "--data.batch_size", "8", "--data.num_workers", "0", "--data.packing", "true",
                    "--data.max_tokens", "40", "--trainer.max_epochs", "20", "--trainer.max_steps", "120"])
    assert cli.trainer.callback_metrics["val/top1"] >= 0.9
    x = next(iter(cli.datamodule.train_dataloader()))[0]
    assert isinstance(x, PackedBatch) and len(x) == 8 and x.patches.shape[1] == 40
    assert all(rows * cols <= 16 for rows, cols in x.grids) and len(set(x.grids)) > 1  # each at its own shape


def test_what_cannot_pack_is_refused_in_one_line(shapes_folder, tmp_path):
    fit = ["train", "fit", "--config", str(ROOT / "configs/vit_tiny_digits.yaml"), *_cpu(tmp_path),
           "--model.model_overrides", TINY_VIT, "--data", "vitkit.lit.ImageFolderDataModule",
           "--data.root", str(shapes_folder), "--data.img_size", "32", "--trainer.fast_dev_run", "1"]
    assert "add --data.packing true" in error_line_of(fit + ["--data.max_tokens", "40"])
    assert "add --data.packing true" in error_line_of(fit + ["--data.token_drop", "0.5"])
    assert "token_drop is the share of each image's patches left out in training, in [0, 1); got 1.0" in \
        error_line_of(fit + ["--data.packing", "true", "--data.token_drop", "1.0"])
    assert "--data.max_tokens 10 is smaller than one image's budget of 16 patches and 1 prefix token(s); give at " \
           "least 17" in error_line_of(fit + ["--data.packing", "true", "--data.max_tokens", "10"])
    assert "cannot run mixup / cutmix" in error_line_of(fit + ["--data.packing", "true", "--model.labels.mixup", "0.8"])
    swin = fit + ["--model.model_name", "swin_tiny_patch4_window7_224", "--model.model_overrides", "null",
                  "--data.packing", "true"]
    assert "cannot pack images of their own sizes" in error_line_of(swin)


def test_mae_pretrains_on_packed_images_of_their_own_shapes(shapes_folder, tmp_path):
    """The MAE recipe on packed images of their own shapes: each image hides three quarters of its patches, the
    reconstruction loss falls on the held-out images; SimMIM and token dropping are refused in one line."""
    import torch

    from tests.tasks.test_mim_train import TINY_DECODER

    def fit(*extra: str):
        return cli_main(["fit", "-c", "mae_vit_tiny_digits", *_cpu(tmp_path), "--model.model_overrides", TINY_VIT,
                         *TINY_DECODER, "--data", "vitkit.lit.UnlabeledImageDataModule", "--data.root",
                         str(shapes_folder), "--data.img_size", "32", "--data.batch_size", "8", "--data.num_workers",
                         "0", "--data.packing", "true", "--data.max_tokens", "40", *extra])

    cli = fit("--trainer.max_epochs", "20")
    x = next(iter(cli.datamodule.train_dataloader()))[0]
    assert isinstance(x, PackedBatch) and x.patches.shape[1] == 40 and len({g for g in x.grids}) > 1
    with open(Path(cli.trainer.loggers[0].log_dir) / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("val/loss")]
    losses = [float(r["val/loss"]) for r in rows]
    # per-patch normalised targets: predicting nothing scores 1.0; the same run on square crops ends near 0.93
    assert len(losses) == 20 and losses[-1] < 0.95 and losses[-1] < 0.9 * losses[0], losses
    assert torch.isfinite(cli.trainer.callback_metrics["val/loss"])
    with pytest.raises(ValueError, match="SimMIM masks blocks of one fixed grid"):
        fit("--trainer.fast_dev_run", "1", "--model.objective", "simmim", "--model.mask_patch_size", "16",
            *(a for k in ("norm_pix_loss", "decoder_embed_dim", "decoder_depth", "decoder_num_heads",
                          "decoder_mlp_ratio") for a in (f"--model.{k}", "null")))
    with pytest.raises(ValueError, match="--data.token_drop 0.5 would drop patches before MAE hides its own share"):
        fit("--trainer.fast_dev_run", "1", "--data.token_drop", "0.5")


def test_dino_pretrains_on_crops_of_their_own_shapes_packed(shapes_folder, tmp_path):
    """The DINO recipe on packed images: each global and local crop keeps its own aspect ratio within the patch
    budget of a square crop, the crops are packed (several to a sequence) with iBOT's hidden patches, and the loss on
    the held-out images falls as the student learns to match its teacher."""
    from tests.tasks.test_dino_train import TINY_HEAD
    from tests.tasks.test_dino_train import _cpu as dino_cpu

    cli = cli_main(["fit", "-c", "dino_vit_tiny_digits", *dino_cpu(tmp_path), "--model.model_overrides", TINY_VIT,
                    *TINY_HEAD, "--model.crops.local_size", "16", "--data", "vitkit.lit.UnlabeledImageDataModule",
                    "--data.root", str(shapes_folder), "--data.img_size", "32", "--data.batch_size", "8",
                    "--data.num_workers", "0", "--data.packing", "true", "--data.max_tokens", "40",
                    "--trainer.max_epochs", "12"])
    x = next(iter(cli.datamodule.train_dataloader()))[0]
    glob, local, hidden = cli.model._crops(x)
    assert isinstance(glob, PackedBatch) and len(glob) == 2 * len(x) and len(local) == 2 * len(x)
    assert len(set(glob.grids)) > 1 and all(r * c <= 16 for r, c in glob.grids)  # 32 px crops: 16 patches
    assert all(r * c <= 4 for r, c in local.grids) and glob.patches.shape[0] < len(glob)  # 16 px: 4 patches
    assert hidden.shape == glob.image.shape and hidden.any() and not (hidden & (glob.index < 1)).any()
    with open(Path(cli.trainer.loggers[0].log_dir) / "metrics.csv") as f:
        losses = [float(r["val/loss"]) for r in csv.DictReader(f) if r.get("val/loss")]
    assert len(losses) == 12 and losses[-1] < 0.85 * losses[0], losses
    with pytest.raises(ValueError, match="--data.token_drop 0.5 would blank patches of the images DINO crops"):
        cli_main(["fit", "-c", "dino_vit_tiny_digits", *dino_cpu(tmp_path), "--model.model_overrides", TINY_VIT,
                  *TINY_HEAD, "--data", "vitkit.lit.UnlabeledImageDataModule", "--data.root", str(shapes_folder),
                  "--data.img_size", "32", "--data.batch_size", "8", "--data.packing", "true",
                  "--data.token_drop", "0.5", "--data.num_workers", "0", "--trainer.fast_dev_run", "1"])


def test_the_probe_fits_the_head_on_each_images_own_features_when_packed(shapes_folder):
    """``head_init: probe`` with packed data: the features it fits on are each image's own, at its own shape in the
    eval transform (the model run on that image alone), and the head it sets is the regression on them."""
    import torch

    import vitkit
    from vitkit.evaluation.probe import fit_linear_probe
    from vitkit.lit import ImageFolderDataModule
    from vitkit.tasks.classification.small_data import eval_views, fit_head, pooled_features

    torch.manual_seed(0)
    model = vitkit.create_model("vit_tiny_patch16_224", num_classes=2, img_size=32, **json.loads(TINY_VIT)).eval()
    dm = ImageFolderDataModule(str(shapes_folder), img_size=32, batch_size=8, num_workers=0, packing=True,
                               max_tokens=40, model_name="vit_tiny_patch16_224")
    dm.packed_model = model
    train, val = eval_views(dm)
    got, labels = pooled_features(model, dm, train, torch.device("cpu"))
    model.set_dynamic_img_size(True)
    alone = [(model.forward_head(model.forward_features(x[None]), pre_logits=True)[0], y)
             for x, y in (s for s in train if s is not None)]
    model.set_dynamic_img_size(False)
    assert len({tuple(x.shape) for x, _ in (s for s in train if s is not None)}) >= 4  # images of their shapes
    torch.testing.assert_close(got, torch.stack([f for f, _ in alone]), atol=1e-5, rtol=1e-5)
    assert labels.tolist() == [y for _, y in alone]
    top1 = fit_head(model, dm, torch.device("cpu"))
    val_x, val_y = pooled_features(model, dm, val, torch.device("cpu"))
    weight, bias, expected = fit_linear_probe(got, labels, val_x, val_y, 2)
    assert top1 == expected
    torch.testing.assert_close(model.get_classifier().weight, weight)
