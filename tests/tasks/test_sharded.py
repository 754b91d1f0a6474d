"""FSDP2 on two CPU processes (gloo): the same training as DDP, step by step, with every part of the recipe on;
a strategy that would leave gradients unsynchronised is refused before the first step."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from .conftest import PROBES, TINY_VIT, launch, run_in_turn
from .depth_scenes import write_depth_folder
from .detection_scenes import write_coco
from .segmentation_digits import write_digit_masks

TINY_SWIN = '{"embed_dim": 16, "depths": [1, 1], "num_heads": [1, 2], "window_size": 4, "patch_size": 2}'
RECIPE = ["--trainer.accumulate_grad_batches", "2", "--trainer.gradient_clip_val", "0.5",
          "--trainer.gradient_clip_algorithm", "norm", "--model.recipe.layer_decay", "0.75", "--model.labels.mixup",
          "0.8",
          "--model.labels.cutmix", "1.0", "--model.recipe.ema_decay", "0.9", "--model.labels.label_smoothing", "0.1"]


MODELS = {"vit": ("vit_tiny_patch16_224", TINY_VIT.replace('"depth": 1', '"depth": 2')),
          "swin": ("swin_tiny_patch4_window7_224", TINY_SWIN)}


def _classifier(root: Path, strategy: str, family: str, *extra: str) -> list[str]:
    """fp32, 2 ranks, 6 batches: accumulation over 2, clipping by norm, layer-wise LR decay, drop path, mixup and
    cutmix, label smoothing, EMA."""
    model, overrides = MODELS[family]
    return ["fit", "--config", "configs/vit_tiny_digits.yaml", "--trainer.strategy", strategy,
            "--trainer.limit_train_batches", "6", "--trainer.limit_val_batches", "1", "--model.model_name", model,
            "--model.model_overrides", overrides[:-1] + ', "drop_path_rate": 0.2}', *RECIPE, *extra, *_common(root)]


LORA = ["--model.adaptation", "LoRA", "--model.adaptation.rank", "4", "--model.adaptation.parts", "qv",
        "--model.recipe.lr", "3e-2"]  # steps that move the adapters


def _packed(data: Path) -> list[str]:
    """The classifier's data as images of their own shapes (``_digit_shapes``), packed 3 to a sequence of 52 slots
    within 16 patches each, a quarter of each training image's patches dropped; mixup and cutmix off (packing
    refuses them)."""
    return ["--model.labels.mixup", "0", "--model.labels.cutmix", "0", "--data", "vitkit.lit.ImageFolderDataModule",
            "--data.root", str(data), "--data.img_size", "32", "--data.batch_size", "8", "--data.num_workers", "0",
            "--data.packing", "true", "--data.max_tokens", "52", "--data.token_drop", "0.25"]


def _digit_shapes(root: Path, train: int = 120, val: int = 20) -> Path:
    """scikit-learn's digits, each resized to its own height and width (16 to 48 px, at most 2:1), as a folder."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(0)
    for i in range(train + val):
        h = int(rng.integers(16, 49))
        w = int(np.clip(h * rng.uniform(0.5, 2.0), max(16, h / 2), min(48, 2 * h)))
        folder = root / ("train" if i < train else "val") / str(digits.target[i])
        folder.mkdir(parents=True, exist_ok=True)
        image = Image.fromarray((digits.images[i] * 15).astype(np.uint8)).convert("RGB")
        image.resize((w, h), Image.Resampling.BICUBIC).save(folder / f"{i}.png")
    return root


def _seq2seq(root: Path, strategy: str) -> list[str]:
    return ["fit", "--config", "configs/seq2seq_reverse.yaml", "--trainer.strategy", strategy,
            "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "2", "--model.val_max_len", "12",
            *_common(root)]


def _mim(root: Path, strategy: str, *extra: str) -> list[str]:
    """MAE on the digits, fp32, 6 batches accumulated over 2, clipped, with the decoder on the same core."""
    return ["fit", "--config", "configs/mae_vit_tiny_digits.yaml", "--trainer.strategy", strategy,
            "--trainer.limit_train_batches", "6", "--trainer.limit_val_batches", "1", "--model.model_overrides",
            TINY_VIT.replace('"depth": 1', '"depth": 2'), "--model.decoder_embed_dim", "32", "--model.num_pictures",
            "0", "--trainer.accumulate_grad_batches", "2", "--trainer.gradient_clip_val", "0.5", *extra,
            *_common(root)]


def _dino(root: Path, strategy: str, *extra: str) -> list[str]:
    """DINO with iBOT and KoLeo on the digits, fp32, 6 batches accumulated over 2, clipped: the student's steps,
    the teacher's moving average and the running centers (mean centering), prototypes unfrozen."""
    return ["fit", "--config", "configs/dino_vit_tiny_digits.yaml", "--trainer.strategy", strategy,
            "--trainer.limit_train_batches", "6", "--trainer.limit_val_batches", "1", "--model.model_overrides",
            TINY_VIT.replace('"depth": 1', '"depth": 2'), "--model.head.out_dim", "64", "--model.head.hidden_dim", "32",
            "--model.head.bottleneck_dim", "16", "--model.crops.local_crops", "2", "--model.loss.centering", "mean",
            "--model.freeze_last_layer_epochs", "0", "--model.loss.warmup_teacher_temp_epochs", "1",
            "--trainer.accumulate_grad_batches", "2", *extra, *_common(root)]


def _distilled(root: Path, strategy: str, teacher: Path, *extra: str) -> list[str]:
    """A student taught by a frozen teacher (soft loss), with mixup: the teacher replicated on every rank."""
    return ["fit", "--config", "configs/vit_tiny_digits.yaml", "--trainer.strategy", strategy,
            "--trainer.limit_train_batches", "6", "--trainer.limit_val_batches", "1", "--model.model_overrides",
            TINY_VIT, "--model.teacher.name", str(teacher), "--model.teacher.distillation", "soft",
            "--model.teacher.alpha", "0.5",
            "--model.teacher.tau", "2.0", "--model.labels.mixup", "0.8", "--trainer.accumulate_grad_batches", "2",
            *extra,
            *_common(root)]


def _segmenter(root: Path, strategy: str, data: Path) -> list[str]:
    """UperNet (BatchNorm, a pooling pyramid) on a ViT, the whole model trained with Dice beside the cross-entropy,
    layer decay, EMA, accumulation over 2 and clipping, on digit masks: 6 batches per rank."""
    return ["fit", "--config", "configs/seg_linear_probe.yaml", "--trainer.strategy", strategy,
            "--trainer.precision", "32-true", "--trainer.limit_train_batches", "6", "--trainer.limit_val_batches",
            "1", "--model.model_name", "vit_tiny_patch16_224", "--model.model_overrides",
            TINY_VIT.replace('"depth": 1', '"depth": 2'), "--model.head", "UperNet", "--model.head.channels",
            "16", "--model.adaptation", "Full", "--model.loss.dice_weight", "0.5",
            "--model.recipe.layer_decay", "0.75", "--model.recipe.ema_decay", "0.9", "--data.root", str(data),
            "--data.num_classes", "4", "--data.img_size", "32", "--data.batch_size", "2", "--data.num_workers", "0",
            "--trainer.accumulate_grad_batches", "2", "--trainer.gradient_clip_val", "0.5", *_common(root)]


def _detector(root: Path, strategy: str, data: Path) -> list[str]:
    """RF-DETR (windows, query groups, two-stage selection, deformable attention, Hungarian matching per rank) on a
    tiny ViT, the whole model trained with layer decay, EMA, accumulation over 2 and clipping: 6 batches per rank."""
    rf_detr = {"out_indices": [1, 2], "windows": 2, "d_model": 32, "queries": 8, "groups": 2, "decoder_layers": 2,
               "ffn_dim": 64, "self_heads": 4, "cross_heads": 4, "c2f_blocks": 1}
    return ["fit", "--config", "configs/det_rf_detr_base.yaml", "--trainer.strategy", strategy,
            "--trainer.precision", "32-true", "--trainer.limit_train_batches", "6", "--trainer.limit_val_batches",
            "1", "--model.model_name", "vit_tiny_patch16_224", "--model.model_overrides",
            '{"patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2}', "--model.rf_detr", json.dumps(rf_detr),
            "--model.recipe.layer_decay", "0.75", "--model.recipe.ema_decay", "0.9", "--data.root", str(data),
            "--data.img_size", "64", "--data.batch_size", "2", "--data.num_workers", "0",
            "--trainer.accumulate_grad_batches", "2", "--trainer.gradient_clip_val", "0.5", *_common(root)]


def _depth(root: Path, strategy: str, data: Path) -> list[str]:
    """DPT's depth head on a tiny ViT, relative depth (the affine-invariant loss with gradient matching), the whole
    model trained with layer decay, EMA, accumulation over 2 and clipping: 6 batches per rank."""
    return ["fit", "--config", "configs/depth_dpt_finetune.yaml", "--trainer.strategy", strategy,
            "--trainer.precision", "32-true", "--trainer.limit_train_batches", "6", "--trainer.limit_val_batches",
            "1", "--model.model_name", "vit_tiny_patch16_224", "--model.model_overrides",
            TINY_VIT.replace('"depth": 1', '"depth": 4'), "--model.channels", "16", "--model.recipe.layer_decay",
            "0.75", "--model.recipe.ema_decay", "0.9", "--data.root", str(data), "--data.img_size", "32",
            "--data.batch_size", "2", "--data.num_workers", "0", "--trainer.accumulate_grad_batches", "2",
            "--trainer.gradient_clip_val", "0.5", *_common(root)]


def _teacher(root: Path) -> Path:
    import vitkit

    torch.manual_seed(5)
    net = vitkit.create_model("vit_tiny_patch16_224", num_classes=10, img_size=32, depth=1, embed_dim=48,
                              num_heads=3, patch_size=8)
    return vitkit.save_pretrained(net, root / "teacher")


def _common(root: Path) -> list[str]:
    root.mkdir(parents=True)
    return ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.max_epochs", "1",
            "--trainer.logger", "false", "--trainer.default_root_dir", str(root),
            "--trainer.callbacks+=ddp_probe.RecordTraining", "--trainer.callbacks.out_dir", str(root)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Every run of this file's comparisons, DDP's and FSDP2's, one after another in one pair of processes (so
    that they start once): the training command's runs, ``cli_main(ARGS)`` with the command's arguments."""
    root = tmp_path_factory.mktemp("sharded")
    every = [_classifier(root / f"{family}_{strategy}", strategy, family) for family in MODELS
             for strategy in ("ddp", "fsdp2")]
    every += [_classifier(root / f"lora_{strategy}", strategy, "vit", *LORA) for strategy in ("ddp", "fsdp2")]
    shapes = _digit_shapes(root / "shapes")
    every += [_classifier(root / f"packed_lora_{strategy}", strategy, "vit", *LORA, *_packed(shapes))
              for strategy in ("ddp", "fsdp2")]
    every += [_classifier(root / f"multi_{strategy}", strategy, "vit", "--model.labels", "MultiLabel")
              for strategy in ("ddp", "fsdp2")]
    every += [_seq2seq(root / f"seq2seq_{strategy}", strategy) for strategy in ("ddp", "fsdp2")]
    teacher = _teacher(root)
    for strategy in ("ddp", "fsdp2"):
        every += [_mim(root / f"mim_{strategy}", strategy), _distilled(root / f"distill_{strategy}", strategy, teacher),
                  _dino(root / f"dino_{strategy}", strategy)]
    data = write_digit_masks(root / "masks", train=24, val=2, size=32, glyph_size=16)
    every += [_segmenter(root / f"seg_{strategy}", strategy, data) for strategy in ("ddp", "fsdp2")]
    boxes = write_coco(root / "boxes", {"train": 24, "val": 2}, seed=2)
    every += [_detector(root / f"det_{strategy}", strategy, boxes) for strategy in ("ddp", "fsdp2")]
    depths = write_depth_folder(root / "depths", {"train": 24, "val": 2}, size=32, seed=2)
    every += [_depth(root / f"depth_{strategy}", strategy, depths) for strategy in ("ddp", "fsdp2")]
    bf16 = ["--trainer.precision", "bf16-mixed"]
    every += [_mim(root / "mim_bf16", "fsdp2", *bf16), _distilled(root / "distill_bf16", "fsdp2", teacher, *bf16),
              _dino(root / "dino_bf16", "fsdp2", *bf16)]
    run_in_turn(every, root)
    return root


def _ran(root: Path) -> list:
    return json.loads((root / "ran.json").read_text())


def _losses(root: Path, rank: int) -> list[float]:
    return [float(line.split()[1]) for line in (root / f"losses{rank}.txt").read_text().splitlines()]


def _fsdp2_equals_ddp(ddp_root: Path, fsdp_root: Path, invariant: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The strategies ran as named (FSDP2 sharding every parameter), each rank's 6 losses and the final weights
    are DDP's within 1e-5; returns DDP's weights. ``invariant``: weights whose gradient the loss makes zero but
    for rounding, compared within 1e-4 (AdamW scales that rounding up to steps of the LR's size)."""
    assert _ran(ddp_root) == ["DDPStrategy", False] and _ran(fsdp_root) == ["FSDP2Strategy", True]
    for rank in (0, 1):
        ddp, fsdp = _losses(ddp_root, rank), _losses(fsdp_root, rank)
        assert len(ddp) == 6 and len(set(ddp)) == 6
        torch.testing.assert_close(torch.tensor(fsdp), torch.tensor(ddp), atol=1e-5, rtol=0)
    ddp, fsdp = (torch.load(r / "weights.pt") for r in (ddp_root, fsdp_root))
    assert sorted(ddp) == sorted(fsdp)
    for k in ddp:
        a, b = fsdp[k], ddp[k]
        if k.endswith("attn.qkv.bias"):  # the keys' bias apart: its gradient is zero but for rounding (softmax over
            # keys ignores a shift that is the same for every key), which AdamW scales up to steps of the LR's size,
            # so there the two reductions' rounding shows (1e-5 seen, every other weight within 3e-7)
            (qa, ka, va), (qb, kb, vb) = a.chunk(3), b.chunk(3)
            torch.testing.assert_close(ka, kb, atol=1e-4, rtol=0, msg=lambda m, k=k: f"{k} (keys): {m}")
            a, b = torch.cat([qa, va]), torch.cat([qb, vb])
        tolerance = 1e-4 if k.endswith(invariant) and invariant else 1e-5
        torch.testing.assert_close(a, b, atol=tolerance, rtol=0, msg=lambda m, k=k: f"{k}: {m}")
    return ddp


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", list(MODELS))
def test_fsdp2_trains_as_ddp_does_with_the_whole_recipe_on(runs, family):
    """The whole recipe (see :func:`_classifier`): every rank's loss at every batch, and the final weights and EMA
    weights, equal DDP's within 1e-5."""
    ddp_root, fsdp_root = runs / f"{family}_ddp", runs / f"{family}_fsdp2"
    ddp = _fsdp2_equals_ddp(ddp_root, fsdp_root)
    assert any(k.startswith("ema.module.") for k in ddp)


def test_lora_trains_under_fsdp2_as_under_ddp(runs):
    """LoRA on q and v of the fused qkv and on proj, with the whole recipe: the adapters and the head train the
    same under both strategies, and the keys' rows of lora_B stay zero."""
    ddp = _fsdp2_equals_ddp(runs / "lora_ddp", runs / "lora_fsdp2")
    b = ddp["model.blocks.0.attn.qkv.lora_B.default.weight"]
    third = b.shape[0] // 3
    assert b[third:2 * third].abs().max() == 0 and b[:third].abs().max() > 0


def test_packed_images_of_their_own_shapes_train_lora_under_fsdp2_as_under_ddp(runs):
    """LoRA with the recipe on packed batches of digits of their own shapes, token dropping on: the same losses,
    adapters, head and EMA under both strategies, and both runs record their patch budget in the checkpoint."""
    ddp = _fsdp2_equals_ddp(runs / "packed_lora_ddp", runs / "packed_lora_fsdp2")
    assert ddp["model.blocks.0.attn.qkv.lora_B.default.weight"].abs().max() > 0
    from vitkit.checkpoints import read_checkpoint

    for strategy in ("ddp", "fsdp2"):
        assert read_checkpoint(runs / f"packed_lora_{strategy}/checkpoints/last.ckpt").overrides["max_patches"] == 16


def test_several_labels_per_image_train_under_fsdp2_as_under_ddp(runs):
    """``multi_label`` with the whole recipe (BCE, mixup and cutmix of multi-hot rows): the same losses and weights,
    and the per-class thresholds, chosen on the validation predictions gathered from both ranks, are the same in
    both runs' checkpoints."""
    _fsdp2_equals_ddp(runs / "multi_ddp", runs / "multi_fsdp2")
    from vitkit.checkpoints import read_checkpoint

    ddp, fsdp = (read_checkpoint(runs / f"multi_{s}/checkpoints/last.ckpt").thresholds for s in ("ddp", "fsdp2"))
    assert len(ddp) == 10 and ddp != [0.5] * 10  # FSDP2's: a sharded checkpoint's folder, read as one
    torch.testing.assert_close(torch.tensor(fsdp), torch.tensor(ddp), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_a_model_parallel_strategy_without_sharding_is_refused(tmp_path):
    """Lightning's ModelParallelStrategy with a module whose configure_model shards nothing: the ranks would
    train apart, so the run stops before the first step and names the unsharded parameters."""
    script = tmp_path / "unsharded.py"
    script.write_text(_UNSHARDED.format(root=str(tmp_path)))
    for rank in launch([str(script)], 1, 2, env=PROBES):  # both ranks started as a launcher does: each refuses
        assert rank.returncode != 0
        assert "20 trainable parameter(s) are not sharded (first: cls_token)" in rank.stderr
        assert "gradients would not be synchronised" in rank.stderr


_UNSHARDED = """
import lightning as L
from lightning.pytorch.strategies import ModelParallelStrategy
from vitkit.lit import DigitsDataModule, ImageClassifier

class Plain(ImageClassifier):
    def configure_model(self):  # shards nothing
        pass

trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2,
                    tensor_parallel_size=1), max_steps=1, logger=False, enable_checkpointing=False,
                    default_root_dir="{root}")
trainer.fit(Plain(model_overrides=dict(depth=1, embed_dim=32, num_heads=2, patch_size=8), num_classes=10,
                  img_size=32), DigitsDataModule())
"""


@pytest.mark.timeout(900)
def test_the_encoder_decoder_trains_as_under_ddp_and_decodes_in_validation(runs):
    """Seq2SeqModule under FSDP2 on 2 processes: the same per-batch losses as DDP, and validation's greedy decoding,
    which stops on each rank when its own batch is done, runs on gathered weights instead of waiting on the other
    rank's collectives (it ran: the processes ended)."""
    assert _ran(runs / "seq2seq_ddp") == ["DDPStrategy", False]
    assert _ran(runs / "seq2seq_fsdp2") == ["FSDP2Strategy", True]
    for rank in (0, 1):
        ddp, fsdp = _losses(runs / "seq2seq_ddp", rank), _losses(runs / "seq2seq_fsdp2", rank)
        assert len(ddp) == 4
        torch.testing.assert_close(torch.tensor(fsdp), torch.tensor(ddp), atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_segmenter_trains_under_fsdp2_as_under_ddp(runs):
    """Per-batch losses and final weights (BatchNorm statistics and the EMA included) equal DDP's within 1e-5."""
    ddp = _fsdp2_equals_ddp(runs / "seg_ddp", runs / "seg_fsdp2")
    assert "ema.module.decode_head.bottleneck.bn.running_mean" in ddp  # the head's BatchNorm, averaged too


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("task", ["det", "depth"])
def test_a_detector_and_a_depth_model_train_under_fsdp2_as_under_ddp(runs, task):
    """RF-DETR (its matching on each rank's own objects, query groups, the two-stage proposals) and DPT's depth
    head: per-batch losses and final weights, the EMA's included, equal DDP's within 1e-5. The depth loss is blind
    to a shift of the output, which is what the head's last biases make where the hidden units are all active."""
    shift = ("head.conv2.bias", "head.conv3.bias") if task == "depth" else ()
    ddp = _fsdp2_equals_ddp(runs / f"{task}_ddp", runs / f"{task}_fsdp2", shift)
    assert any(k.startswith("ema.module.") for k in ddp)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["mim", "distill", "dino"])
def test_pretraining_and_distillation_train_under_fsdp2_as_under_ddp(runs, kind):
    """MAE (masks drawn per rank from the same seeds), a distilled student (the teacher outside the sharded
    module, replicated) and DINO (crops and masks drawn per rank, the teacher a moving average of the sharded
    student, the centers averaged over ranks): per-batch losses and final weights, DINO's teacher and centers
    included, equal DDP's within 1e-5, with accumulation over 2; and a bf16-mixed FSDP2 run of each trains with
    finite losses."""
    ddp_root, fsdp_root = runs / f"{kind}_ddp", runs / f"{kind}_fsdp2"
    ddp = _fsdp2_equals_ddp(ddp_root, fsdp_root)
    if kind == "dino":  # the teacher moved (3 steps), and so did the centers
        centers = ("model.dino_loss.center.center", "model.ibot_loss.center.center")
        assert all(ddp[k].abs().max() > 0 for k in centers)
        teacher = {k.removeprefix("model.teacher."): v for k, v in ddp.items() if k.startswith("model.teacher.")}
        assert any(not torch.equal(v, ddp["model.student." + k]) for k, v in teacher.items())
    else:
        assert not any("teacher" in k for k in ddp)
    bf16 = runs / f"{kind}_bf16"
    assert _ran(bf16) == ["FSDP2Strategy", True]
    losses = _losses(bf16, 0) + _losses(bf16, 1)
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    start = _losses(fsdp_root, 0)[0]
    assert abs(_losses(bf16, 0)[0] - start) < 0.05 * abs(start) + 0.05  # the same first batch, in bf16
