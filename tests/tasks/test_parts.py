"""The classifier's typed parts: every shipped recipe of ImageClassifier builds the parts it names; the flat
arguments of before the parts upgrade to the parts they describe (every classifier checkpoint written then, through
``vitkit convert``), and given today (a flag, a config) end in one line naming the parts' flags; the recipe builds
the optimizer and its scheduler together; a part that cannot run is refused when it is made."""

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from vitkit.errors import UsageError
from vitkit.lit import Frozen, Full, ImageClassifier, LoRA, MultiLabel, SingleLabel, Teacher
from vitkit.tasks.classification.adaptation import Adaptation
from vitkit.tasks.classification.classifier import RECIPE
from vitkit.tasks.classification.labels import Labels
from vitkit.training.parts import part_from
from vitkit.training.recipe import Recipe, WarmupSchedule

ROOT = Path(__file__).resolve().parents[2]
FLAT = ImageClassifier.FLAT
DEFAULTS = {  # the flat arguments and defaults of ImageClassifier before its parts
    "multi_label": False, "multi_label_loss": "bce", "pos_weight": False, "thresholds": "per_class", "lr": 5e-4,
    "weight_decay": 0.05, "betas": (0.9, 0.999), "min_lr": 1e-5, "warmup_epochs": 5.0, "layer_decay": None,
    "label_smoothing": 0.1, "mixup": 0.0, "cutmix": 0.0, "mixup_prob": 1.0, "mixup_switch_prob": 0.5,
    "ema_decay": None, "ema_is_model": False, "freeze_backbone": False, "nonfinite_loss": "stop", "compile": False,
    "teacher": None, "teacher_checkpoint": None, "distillation": None, "distill_alpha": 0.5, "distill_tau": 1.0,
    "optimizer": "adamw", "momentum": 0.9, "head_norm": False, "head_init": "random", "lora_rank": 0,
    "lora_alpha": None, "lora_dropout": 0.0, "lora_targets": None, "lora_parts": "qkv", "lora_lr_scale": 10.0}
RECIPES = sorted(p for p in (ROOT / "configs").glob("*.yaml")
                 if str((yaml.safe_load(p.read_text()).get("model") or {}).get("class_path", "")).endswith(
                     ".ImageClassifier"))
OLD = sorted((ROOT / "tests/fixtures/before_tasks").glob("*.ckpt"))


def _expected_kind(hp: dict) -> tuple[type, type, bool]:
    adaptation = LoRA if hp["lora_rank"] else Frozen if hp["freeze_backbone"] else Full
    return adaptation, MultiLabel if hp["multi_label"] else SingleLabel, bool(hp["teacher"])


def _parts(init: dict) -> tuple:
    """The parts that init arguments of the parts' form give."""
    teacher = init.get("teacher")
    return (Recipe(**{**dataclasses.asdict(RECIPE), **(init.get("recipe") or {})}),
            part_from(init.get("labels"), Labels, SingleLabel()), part_from(init.get("adaptation"), Adaptation, Full()),
            None if teacher is None else Teacher(**teacher))


def _check(hp: dict, parts: tuple) -> None:
    """``parts`` are what the flat arguments ``hp`` said."""
    recipe, labels, adaptation, teacher = parts
    kind, label_kind, taught = _expected_kind(hp)
    assert type(adaptation) is kind and type(labels) is label_kind and (teacher is not None) == taught
    for field in ("lr", "weight_decay", "optimizer", "layer_decay", "warmup_epochs", "min_lr", "ema_decay",
                  "ema_is_model", "nonfinite_loss", "compile"):
        assert getattr(recipe, field) == hp[field], field
    assert tuple(recipe.betas) == tuple(hp["betas"])
    assert (labels.label_smoothing, labels.mixup, labels.cutmix) == (hp["label_smoothing"], hp["mixup"], hp["cutmix"])
    assert (adaptation.head_init, adaptation.head_norm) == (hp["head_init"], hp["head_norm"])
    if isinstance(adaptation, LoRA):
        assert (adaptation.rank, adaptation.lr_scale) == (hp["lora_rank"], hp["lora_lr_scale"])
    if isinstance(labels, MultiLabel):
        assert (labels.loss, labels.pos_weight, labels.thresholds) == (hp["multi_label_loss"], hp["pos_weight"],
                                                                       hp["thresholds"])
    if teacher is not None:
        assert (teacher.name, teacher.alpha, teacher.tau) == (hp["teacher"], hp["distill_alpha"], hp["distill_tau"])


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_classifier_recipe_builds_its_parts_and_its_flat_form_translates_to_them(path):
    """Each shipped recipe as written (the parts' form), and the same recipe in the flat form of before, give the
    same parts; the flat form read from a config file by the command line too."""
    init = yaml.safe_load(path.read_text())["model"].get("init_args") or {}
    parts = _parts(init)
    flat = {k: v for k, v in init.items() if k not in ("recipe", "labels", "adaptation", "teacher")}
    flat.update(init.get("recipe") or {})
    flat.update(dict((init.get("labels") or {}).get("init_args") or {}))
    flat["multi_label"] = str((init.get("labels") or {}).get("class_path", "")).endswith("MultiLabel")
    if flat["multi_label"]:
        flat["multi_label_loss"] = flat.pop("loss", "bce")
    adaptation = init.get("adaptation") or {}
    given = dict(adaptation.get("init_args") or {})
    flat.update({k: given.pop(k) for k in ("head_init", "head_norm") if k in given})
    flat["freeze_backbone"] = str(adaptation.get("class_path", "")).endswith("Frozen")
    flat.update({f"lora_{k}": v for k, v in given.items()})
    if init.get("teacher"):
        t = init["teacher"]
        flat.update(teacher=t["name"], teacher_checkpoint=t.get("checkpoint"), distillation=t.get("distillation"),
                    distill_alpha=t.get("alpha", 0.5), distill_tau=t.get("tau", 1.0))
    _check({**DEFAULTS, **flat}, parts)
    assert _parts(FLAT.to_parts(flat)) == parts


@pytest.mark.parametrize("path", [p for p in OLD if p.stem in ("classifier", "multilabel", "lora", "distilled",
                                                                  "small_data", "probe")], ids=lambda p: p.stem)
def test_every_classifier_checkpoint_of_before_translates_into_its_parts(path):
    hp = torch.load(path, map_location="cpu", weights_only=True)["hyper_parameters"]
    flat = {**DEFAULTS, **{k: v for k, v in hp.items() if k in DEFAULTS}}
    _check(flat, _parts(FLAT.to_parts(hp)))


@pytest.mark.parametrize("flags, says", [
    (["--model.init_args.lr=1e-3"], "--model.lr 1e-3: the module takes its settings as parts now; give "
                                    "--model.recipe.lr 1e-3"),
    (["--model.lora_rank", "8"], "give --model.adaptation LoRA --model.adaptation.rank 8"),
    (["--model.multi_label", "true"], "give --model.labels MultiLabel"),
    (["--model.teacher", "t.ckpt"], "give --model.teacher.name t.ckpt"),
    (["--model.freeze_backbone", "true"], "give --model.adaptation Frozen"),
    (["--model.distillation", "none"], "give --model.teacher null"),
    (["--model.lr", "--model.freeze_backbone", "true"],
     "--model.lr VALUE, --model.freeze_backbone true: the module takes its settings as parts now; give "
     "--model.recipe.lr VALUE --model.adaptation Frozen"),
    (["--model.recipe.lrr", "1e-3"],
     "--model.recipe.lrr: Recipe has no field 'lrr' (did you mean lr?); it has lr, weight_decay, betas, eps, "
     "optimizer, momentum, layer_decay, warmup_epochs, warmup_steps, min_lr, schedule, ema_decay, ema_is_model, "
     "nonfinite_loss, compile, lr_batch, lr_scaling, head_epochs"),
])
def test_a_flat_flag_ends_in_one_line_naming_the_parts_flags(flags, says, tmp_path):
    from tests.commands import error_line_of

    line = error_line_of(["train", "fit", "-c", "vit_tiny_digits", "--trainer.default_root_dir", str(tmp_path), *flags])
    assert line.startswith("error: --model.") and line.endswith(says), line
    assert not (tmp_path / "checkpoints").exists()


def test_the_recipe_builds_the_optimizer_and_its_scheduler_together():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    model.no_weight_decay = lambda: set()
    recipe = Recipe(lr=1e-3, weight_decay=0.05, warmup_epochs=1, min_lr=1e-5)
    opt, sched = recipe.build(model)
    assert isinstance(opt, torch.optim.AdamW) and isinstance(sched.schedule, WarmupSchedule)
    assert sched.schedule.min_lr_ratio == pytest.approx(1e-2) and sched.optimizer is opt
    sgd, _ = Recipe(lr=0.1, weight_decay=0.0, optimizer="sgd", momentum=0.8).build(model)
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.8
    assert recipe.with_lr(5e-4).lr == 5e-4 and recipe.lr == 1e-3  # a new recipe; the old one stays


def test_a_part_that_cannot_run_is_refused_when_made():
    with pytest.raises(ValueError, match="optimizer must be 'adamw' or 'sgd', got 'lamb'"):
        Recipe(lr=1e-3, weight_decay=0.0, optimizer="lamb")
    with pytest.raises(ValueError, match="nonfinite_loss must be 'stop' or 'skip', got 'retry'"):
        Recipe(lr=1e-3, weight_decay=0.0, nonfinite_loss="retry")
    with pytest.raises(ValueError, match="LoRA adapts the backbone with adapters of rank >= 1"):
        LoRA(rank=0)
    with pytest.raises(ValueError, match="head_init must be 'random' or 'probe' .without head_norm or freeze"):
        Frozen(head_init="probe")
    with pytest.raises(ValueError, match="multi_label_loss must be 'bce' or 'asl', got 'focal'"):
        MultiLabel(loss="focal")
    with pytest.raises(ValueError, match=r"distill_alpha must be in \[0, 1\]"):
        Teacher("vit_tiny_patch16_224", alpha=2.0)
    with pytest.raises(ValueError, match="a teacher's distillation must be 'hard' or 'soft', got 'none'"):
        Teacher("vit_tiny_patch16_224", distillation="none")
    with pytest.raises(ValueError, match="lora_rank with freeze_backbone"):
        FLAT.to_parts({"lora_rank": 4, "freeze_backbone": True})
    with pytest.raises(ValueError, match="'vitkit.lit.ImageClassifier' is not a kind of Labels vitkit has"):
        ImageClassifier(labels={"class_path": "vitkit.lit.ImageClassifier", "init_args": {}})
    with pytest.raises(ValueError, match="distillation with multi_label is not built"):
        ImageClassifier(labels=MultiLabel(), teacher=Teacher("vit_tiny_patch16_224"))


def test_a_flat_config_file_ends_in_one_line_naming_the_parts(tmp_path):
    """The demo recipe written in the flat form of before is refused before anything is built, naming how the parts
    take each of its flat settings."""
    from tests.commands import error_line_of

    text = yaml.safe_load((ROOT / "configs/vit_tiny_digits.yaml").read_text())
    init = text["model"]["init_args"]
    flat = {k: v for k, v in init.items() if k not in ("recipe", "labels", "adaptation", "teacher")}
    flat.update(init["recipe"], **init["labels"]["init_args"])
    text["model"]["init_args"] = flat
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(text))
    line = error_line_of(["train", "fit", "-c", str(tmp_path / "old.yaml"), "--trainer.default_root_dir",
                          str(tmp_path / "run")])
    assert line.startswith(f"error: {tmp_path / 'old.yaml'}: model.init_args holds flat arguments"), line
    assert "write them under init_args as the parts take them: recipe: {" in line, line
    assert f"lr: {init['recipe']['lr']}," in line and "labels: {cutmix: 0.0, label_smoothing: 0.1" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags, says", [
    (["--model.multi_label", "maybe"], "error: --model.multi_label expects true or false, got 'maybe'"),
    (["--model.freeze_backbone", "yes please"],
     "error: --model.freeze_backbone expects true or false, got 'yes please'"),
    (["--model.lora_rank", "eight"], "error: --model.lora_rank expects an integer (0: no adapters), got 'eight'"),
    (["--model.adaptation", "Partial"], "error: --model.adaptation: 'Partial' names no class it takes"),
    (["--model.adaptation.rank", "4"], "error: --model.adaptation.rank: Full takes no 'rank' (another kind may: "
                                       "choose it first, --model.adaptation KIND)"),
    (["--model.labels", "MultiLabel", "--model.labels.loss", "focal"],
     "error: --model.labels.loss expects one of 'bce', 'asl', got 'focal'"),
    (["--model.labels", "{\"class_path\": \"os.system\"}"],
     "error: --model.labels: 'os.system' is not a kind of Labels"),
])
def test_a_bad_flat_or_part_flag_ends_in_one_line(flags, says, tmp_path):
    from tests.commands import error_line_of

    line = error_line_of(["train", "fit", "-c", "vit_tiny_digits", "--trainer.default_root_dir", str(tmp_path), *flags])
    assert line.startswith(says), line
    assert not (tmp_path / "checkpoints").exists()


def test_a_flat_config_file_with_a_bad_switch_ends_in_one_line(tmp_path):
    from tests.commands import error_line_of

    text = yaml.safe_load((ROOT / "configs/vit_tiny_digits.yaml").read_text())
    text["model"]["init_args"]["multi_label"] = "maybe"
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(text))
    line = error_line_of(["train", "fit", "-c", str(tmp_path / "old.yaml"), "--trainer.default_root_dir",
                          str(tmp_path)])
    assert line == "error: --model.multi_label expects true or false, got 'maybe'", line


@given(st.lists(st.tuples(st.sampled_from(sorted(FLAT.names)), st.text(max_size=8)), min_size=1, max_size=6))
@settings(max_examples=200, deadline=None)
def test_any_flat_flags_end_in_a_usage_error(pairs):
    """Whatever values the flat flags carry, the command line is refused with a UsageError (the command's one line);
    it never ends in another exception, and no flat flag goes through."""
    from vitkit.cli.model_args import refuse_flat

    argv = ["fit", *[x for key, value in pairs for x in (f"--model.{key}", value)]]
    with pytest.raises(UsageError):
        refuse_flat(argv)


def test_a_checkpoint_of_before_is_refused_until_convert_upgrades_it(tmp_path, capsys):
    """Every module's checkpoint of the flat arguments: loading it names the command that upgrades it; ``vitkit
    convert OLD NEW`` writes the same weights with the settings as the parts, and that file loads; a checkpoint of
    today is not upgraded again."""
    from vitkit.cli import main
    from vitkit.lit import DINOPretraining, MaskedImageModeling, Segmenter, Seq2SeqModule

    modules = {"classifier": ImageClassifier, "dino": DINOPretraining, "mae": MaskedImageModeling,
               "seq2seq": Seq2SeqModule}
    for path in [*(p for p in OLD if p.stem in modules), ROOT / "tests/fixtures/before_parts/segmenter_lora.ckpt"]:
        cls = modules.get(path.stem, Segmenter)
        with pytest.raises(UsageError, match=f"upgrade it once: vitkit convert {path} UPGRADED.ckpt"):
            cls.load_from_checkpoint(path, map_location="cpu")
        new = tmp_path / f"{path.stem}.ckpt"
        assert main(["convert", str(path), str(new)]) == 0
        old_sd = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
        module = cls.load_from_checkpoint(new, map_location="cpu")
        assert module.recipe.lr == torch.load(path, map_location="cpu", weights_only=True)["hyper_parameters"]["lr"]
        got = torch.load(new, map_location="cpu", weights_only=True)["state_dict"]
        assert got.keys() == old_sd.keys() and all(torch.equal(got[k], old_sd[k]) for k in got)
    assert main(["convert", str(new), str(tmp_path / "again.ckpt")]) == 1
    assert "nothing to upgrade" in capsys.readouterr().err
