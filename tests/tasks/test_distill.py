"""Knowledge distillation: a frozen teacher of any kind (a checkpoint, a vitkit preset or tag, a timm CNN) outside the
optimizer and the checkpoint, fed the student's mixed batch in its own preprocessing; DeiT's hard loss and the soft
one as their papers write them; a student with the teacher beats the same student without it on few labels."""

import shutil
from pathlib import Path

import lightning as L
import pytest
import timm
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import vitkit
from tests.commands import error_line_of
from vitkit.cli.train import cli_main
from vitkit.lit import DigitsDataModule, ImageClassifier, SingleLabel, Teacher
from vitkit.tasks.classification.distill import Preprocessing, distillation_loss, to_teacher

from ..hub_cache import cache_weights, use_offline_cache

TINY = dict(depth=1, embed_dim=32, num_heads=2, patch_size=8)


def _cpu(root: Path, *extra: str) -> list[str]:
    return ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.precision", "32-true",
            "--trainer.default_root_dir", str(root), "--trainer.logger", "false", *extra]


def _teacher_file(tmp_path: Path, **kw) -> Path:
    torch.manual_seed(1)
    net = vitkit.create_model("vit_tiny_patch16_224", **{"num_classes": 10, "img_size": 32, **TINY, **kw})
    return vitkit.save_pretrained(net, tmp_path / "teacher")


def test_the_teacher_is_frozen_and_outside_the_optimizer_the_state_dict_and_the_checkpoint(tmp_path):
    args = ["fit", "-c", "vit_tiny_digits", *_cpu(tmp_path), "--trainer.limit_val_batches", "1",
            "--model.model_overrides", str(TINY).replace("'", '"'), "--model.teacher.name",
            str(_teacher_file(tmp_path))]
    cli = cli_main([*args, "--trainer.max_steps", "2"])
    module = cli.model
    teacher = module._teacher
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    optimized = {id(p) for g in cli.trainer.optimizers[0].param_groups for p in g["params"]}
    assert not optimized & {id(p) for p in teacher.parameters()}
    assert not any(k.startswith(("_teacher", "teacher")) for k in module.state_dict())
    ckpt = torch.load(tmp_path / "checkpoints/last.ckpt", weights_only=False)
    assert ckpt["hyper_parameters"]["teacher"]["name"] == str(tmp_path / "teacher")  # what it was, to build it again
    assert all(k.startswith("model.") for k in ckpt["state_dict"])
    resumed = cli_main([*args, "--trainer.max_steps", "3", "--ckpt_path", "last"])
    assert resumed.model._teacher is not None and resumed.trainer.global_step == 3
    student = vitkit.create_model(checkpoint=tmp_path / "checkpoints/last.ckpt")  # the student alone
    assert student.cfg.depth == 1 and student.load_report.ok


def test_a_student_whose_teacher_is_gone_loads_for_use_and_resuming_names_the_teacher(tmp_path, caplog):
    """Only training needs the teacher: with its file gone, the student's checkpoint still loads (to evaluate,
    predict, export) with a warning, while a resumed run ends in the missing file's line."""
    args = ["fit", "-c", "vit_tiny_digits", *_cpu(tmp_path), "--trainer.limit_val_batches", "1",
            "--model.model_overrides", str(TINY).replace("'", '"'), "--model.teacher.name",
            str(_teacher_file(tmp_path))]
    trained = cli_main([*args, "--trainer.max_steps", "2"]).model.eval()
    shutil.rmtree(tmp_path / "teacher")
    loaded = ImageClassifier.load_from_checkpoint(tmp_path / "checkpoints/last.ckpt").eval()
    assert loaded._teacher is None and f"the teacher '{tmp_path / 'teacher'}' cannot be built" in caplog.text
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert_close(loaded(x), trained(x))
    line = error_line_of(["train", *args, "--trainer.max_steps", "3", "--ckpt_path", "last"])
    assert "does not exist" in line and str(tmp_path / "teacher") in line, line
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                        default_root_dir=tmp_path / "again")
    with pytest.raises(ValueError, match="was not there when this checkpoint was loaded"):
        trainer.fit(loaded, DigitsDataModule(img_size=32))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lightning checkpoint", "timm cnn file"])
def test_a_checkpoint_and_a_timm_cnn_teach_a_student(kind, tmp_path, digits_run):
    """The demo's Lightning checkpoint, and a timm CNN by name with its weights as a file."""
    if kind == "lightning checkpoint":
        args = ["--model.teacher.name", str(Path(digits_run.trainer.checkpoint_callback.dirpath) / "last.ckpt")]
    else:
        torch.save(timm.create_model("resnet10t", num_classes=10).state_dict(), tmp_path / "resnet.pth")
        args = ["--model.teacher.name", "resnet10t", "--model.teacher.checkpoint", str(tmp_path / "resnet.pth")]
    cli = cli_main(["fit", "-c", "vit_tiny_digits", *_cpu(tmp_path / "run"), "--trainer.max_steps", "2",
                    "--trainer.limit_val_batches", "1", "--model.model_overrides", str(TINY).replace("'", '"'), *args])
    assert cli.trainer.global_step == 2 and cli.model._teacher is not None
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss_step"])


@pytest.mark.parametrize("tag, size", [("vit_tiny_patch16_224.augreg_in21k_ft_in1k", 224),
                                       ("resnet10t.c3_in1k", 176)])
def test_a_tag_teacher_comes_from_the_hub_cache_with_its_preprocessing(tag, size, tmp_path, monkeypatch):
    """A vitkit tag and a timm CNN's tag, from an offline hub cache: their weights, and the mean, std and input
    size of their pretrained configs."""
    from timm.models import get_pretrained_cfg

    from vitkit.tasks.classification.distill import build_teacher

    use_offline_cache(monkeypatch, tmp_path / "hf")
    arch = tag.split(".")[0]
    torch.manual_seed(2)
    cached = timm.create_model(arch, num_classes=1000)
    cache_weights(tmp_path / "hf", tag, cached, tmp_path)
    teacher, prep = build_teacher(tag)
    cfg = get_pretrained_cfg(tag).to_dict()
    assert prep.size == (size, size) == tuple(cfg["input_size"][1:])
    assert (prep.mean, prep.std) == (tuple(cfg["mean"]), tuple(cfg["std"]))
    x = torch.randn(1, 3, size, size)
    with torch.no_grad():
        assert_close(teacher(x), cached.eval()(x), atol=1e-4, rtol=1e-4)


def test_the_teacher_sees_the_students_mixed_batch_in_its_own_preprocessing(tmp_path):
    """A teacher with CLIP's mean and std at 48 px: it receives the student's (mixed) images, converted on the
    device from the student's normalisation to its own and resized."""
    teacher = _teacher_file(tmp_path, img_size=48, mean=(0.48145466, 0.4578275, 0.40821073),
                            std=(0.26862954, 0.26130258, 0.27577711))
    module = ImageClassifier("vit_tiny_patch16_224", model_overrides=TINY, num_classes=10, img_size=32,
                             teacher=Teacher(str(teacher), distillation="soft"), labels=SingleLabel(mixup=0.8))
    seen = []
    module._teacher.register_forward_pre_hook(lambda m, args: seen.append(args[0].clone()))
    mixed = []
    module.model.register_forward_pre_hook(lambda m, args: mixed.append(args[0].clone()))
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    module._loss(x, y)
    raw = mixed[0] * torch.tensor(module._student_prep.std).view(1, 3, 1, 1) + \
        torch.tensor(module._student_prep.mean).view(1, 3, 1, 1)
    expected = (raw - torch.tensor((0.48145466, 0.4578275, 0.40821073)).view(1, 3, 1, 1)) / \
        torch.tensor((0.26862954, 0.26130258, 0.27577711)).view(1, 3, 1, 1)
    expected = F.interpolate(expected, size=(48, 48), mode="bicubic", align_corners=False, antialias=True)
    assert seen[0].shape == (4, 3, 48, 48)
    assert_close(seen[0], expected, atol=1e-5, rtol=1e-5)


def test_the_losses_are_deits_hard_and_hintons_soft():
    torch.manual_seed(0)
    student, teacher = torch.randn(6, 10), torch.randn(6, 10)
    assert_close(distillation_loss("hard", student, teacher, 1.0), F.cross_entropy(student, teacher.argmax(-1)))
    tau = 3.0
    p_t = (teacher / tau).softmax(-1)
    kl = (p_t * (p_t.log() - (student / tau).log_softmax(-1))).sum(-1).mean() * tau**2
    assert_close(distillation_loss("soft", student, teacher, tau), kl)
    prep = Preprocessing((0.5,) * 3, (0.5,) * 3, (32, 32))
    x = torch.randn(2, 3, 32, 32)
    assert to_teacher(x, prep, prep) is x  # the same preprocessing: the batch as it is


def test_a_deit_student_learns_from_the_teacher_through_its_second_head(tmp_path):
    """DeiT's hard distillation: the class head's gradient comes from the labels alone, the distillation head's
    from the teacher's argmax alone; at evaluation the two heads are averaged."""
    module = ImageClassifier("deit_tiny_distilled_patch16_224", model_overrides=TINY, num_classes=10, img_size=32,
                             teacher=Teacher(str(_teacher_file(tmp_path)), distillation="hard"),
                             labels=SingleLabel(label_smoothing=0.0))
    module.train()
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    with torch.no_grad():
        cls, dist = module.model(x)
        target = module._teacher(x).argmax(-1)
    loss = module._loss(x, y)
    assert_close(loss, 0.5 * F.cross_entropy(cls, y) + 0.5 * F.cross_entropy(dist, target))
    module.model.eval()
    with torch.no_grad():
        assert_close(module.model(x), (cls + dist) / 2)


@pytest.mark.slow
def test_a_distilled_student_predicts_exports_and_evaluates_with_its_heads_averaged(tmp_path):
    """Trained with a teacher through the command, the DeiT student's checkpoint loads without the teacher, gives
    the average of its two heads, and exports to ONNX with the same logits."""
    pytest.importorskip("onnxruntime")
    from vitkit.deploy.export import OnnxModel, export_onnx

    cli_main(["fit", "-c", "vit_tiny_digits", *_cpu(tmp_path), "--trainer.max_steps", "2",
              "--trainer.limit_val_batches", "1", "--model.model_name", "deit_tiny_distilled_patch16_224",
              "--model.model_overrides", str(TINY).replace("'", '"'), "--model.teacher.name",
              str(_teacher_file(tmp_path)),
              "--model.teacher.distillation", "hard"])
    student = vitkit.create_model(checkpoint=tmp_path / "checkpoints/last.ckpt").eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        feats = student.forward_features(x)
        cls, dist = student.head(feats[:, 0]), student.head_dist(feats[:, 1])
        assert_close(student(x), (cls + dist) / 2)
        export_onnx(student, tmp_path / "student.onnx", dynamic_size=False)  # the heads are what is checked
        assert_close(torch.from_numpy(OnnxModel(tmp_path / "student.onnx")(x)), student(x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("teacher, says", [
    ("three_classes", "the teacher '{teacher}' predicts 3 classes, the data has 10"),
    ("missing.pth", "checkpoint 'missing.pth' does not exist"),
    ("not_a_model_anywhere", "--model.teacher.name 'not_a_model_anywhere' cannot be built"),
])
def test_a_teacher_that_does_not_fit_is_refused_in_one_line(teacher, says, tmp_path, capfd):
    from tests.commands import one_error_line, run_cli

    if teacher == "three_classes":
        net = vitkit.create_model("vit_tiny_patch16_224", num_classes=3, img_size=32, **TINY)
        teacher = str(vitkit.save_pretrained(net, tmp_path / "three"))
    argv = ["train", "fit", "-c", "vit_tiny_digits", *_cpu(tmp_path / "run"), "--model.teacher.name", teacher]
    line = one_error_line(*run_cli(argv, capfd))
    assert says.format(teacher=teacher) in line, line
    assert not (tmp_path / "run").exists()


def _student(root: Path, seed: int, teacher: Path | None) -> float:
    """A one-block student on 30 labelled digits per class, 40 epochs, with or without the teacher (soft, alpha
    0.9, tau 4)."""
    extra = ["--model.teacher.name", str(teacher), "--model.teacher.distillation", "soft", "--model.teacher.tau", "4.0",
             "--model.teacher.alpha", "0.9"] if teacher else []
    cli = cli_main(["fit", "-c", "vit_tiny_digits", *_cpu(root), "--trainer.max_epochs", "40",
                    "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]",
                    "--trainer.check_val_every_n_epoch", "40", "--seed_everything", str(seed),
                    "--model.model_overrides.depth=1", "--data.train_per_class", "30", "--data.batch_size", "32",
                    "--model.recipe.warmup_epochs", "1", "--model.recipe.lr", "1e-3", *extra])
    return float(cli.trainer.callback_metrics["val/top1"])


@pytest.mark.slow
def test_a_student_with_the_teacher_beats_the_same_student_without_it(digits_run, tmp_path):
    """Over seeds 0-4 (teacher: a 20-epoch demo run, val 0.969), val top-1 without the teacher 0.450 / 0.517 / 0.528
    / 0.608 / 0.528, with it (soft) 0.558 / 0.756 / 0.586 / 0.764 / 0.742: gaps +0.06 to +0.24. The bound sits
    under the smallest gap. The hard loss is not held to a gain here: on training digits the teacher's argmax is
    almost always the label, so it adds little (gaps -0.07 to +0.08 over the same seeds, from another 20-epoch
    teacher, val 0.956)."""
    teacher = Path(digits_run.trainer.checkpoint_callback.dirpath) / "last.ckpt"
    taught = _student(tmp_path / "taught", 0, teacher)
    alone = _student(tmp_path / "alone", 0, None)
    print(f"with the teacher {taught:.3f}, without {alone:.3f}")
    assert taught >= alone + 0.04, (taught, alone)


@pytest.mark.slow
def test_the_digits_recipe_distils_the_demo_model(digits_run, tmp_path):
    cli = cli_main(["fit", "-c", "vit_tiny_digits_distilled", *_cpu(tmp_path), "--trainer.max_steps", "2",
                    "--trainer.limit_val_batches", "1", "--model.teacher.name",
                    str(Path(digits_run.trainer.checkpoint_callback.dirpath) / "last.ckpt")])
    assert cli.model.distill.distillation == "soft" and cli.model.model.cfg.depth == 1
