"""The training modules beside the classifier from its parts: the segmenter takes a ``recipe`` and an
``adaptation``, MAE / SimMIM and DINO a ``recipe``. Every shipped recipe of theirs builds the parts it names, and its
flat form of before upgrades to them (``vitkit convert``'s translation); checkpoints written before the parts
(``tests/fixtures/before_parts``, ``before_tasks``), once upgraded, load with the outputs and scores they had and the
recipes they ran; flat flags on the command line are refused naming the parts' flags; a segmenter's LoRA checkpoint
keeps what trained and loads back to the same masks."""

import dataclasses
import inspect
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

import vitkit
from tests.commands import run_cli
from vitkit.cli.train import cli_main
from vitkit.lit import DINOPretraining, Frozen, Full, LoRA, MaskedImageModeling, Segmenter, Seq2SeqModule
from vitkit.tasks.segmentation.segmenter import RECIPE
from vitkit.training.adaptation import Adaptation
from vitkit.training.parts import part_from
from vitkit.training.recipe import Recipe

from .segmentation_digits import write_digit_masks

ROOT = Path(__file__).resolve().parents[2]
OLD = ROOT / "tests/fixtures/before_parts"
RECIPES = sorted(p for p in (ROOT / "configs").glob("*.yaml")
                 if str((yaml.safe_load(p.read_text()).get("model") or {}).get("class_path", "")).endswith(
                     ".Segmenter"))
TINY = '{"depth": 1, "embed_dim": 32, "num_heads": 2, "patch_size": 8}'  # the fixtures' backbone
FLAGS = ["--model.model_name", "vit_tiny_patch16_224", "--model.model_overrides", TINY, "--data.num_classes", "4",
         "--data.img_size", "32", "--data.batch_size", "8", "--data.num_workers", "0", "--trainer.accelerator", "cpu",
         "--trainer.devices", "1", "--trainer.precision", "32-true", "--trainer.enable_progress_bar", "false"]


def _parts(init: dict) -> tuple[Recipe, Adaptation]:
    return (Recipe(**{**dataclasses.asdict(RECIPE), **(init.get("recipe") or {})}),
            part_from(init.get("adaptation"), Adaptation, Full()))


def _flat(init: dict) -> dict:
    """A recipe's init arguments in the flat form the segmenter took before its parts."""
    flat = {k: v for k, v in init.items() if k not in ("recipe", "adaptation")}
    flat.update(init.get("recipe") or {})
    adaptation = init.get("adaptation") or {}
    kind = adaptation if isinstance(adaptation, str) else str(adaptation.get("class_path", ""))
    given = {} if isinstance(adaptation, str) else dict(adaptation.get("init_args") or {})
    flat.update({k: given.pop(k) for k in ("head_init",) if k in given})
    flat["freeze_backbone"] = kind.endswith("Frozen")
    flat.update({f"lora_{k}": v for k, v in given.items()})
    return flat


MODULES = {"MaskedImageModeling": MaskedImageModeling, "DINOPretraining": DINOPretraining, "Segmenter": Segmenter,
           "Seq2SeqModule": Seq2SeqModule}
OTHERS = sorted(p for p in (ROOT / "configs").glob("*.yaml")
                if str((yaml.safe_load(p.read_text()).get("model") or {}).get("class_path", "")).rpartition(".")[2]
                in MODULES)


@pytest.mark.parametrize("path", OTHERS, ids=lambda p: p.stem)
def test_every_recipe_of_the_other_modules_gives_its_recipe_from_its_flat_form_too(path):
    model = yaml.safe_load(path.read_text())["model"]
    cls = MODULES[model["class_path"].rpartition(".")[2]]
    init = model["init_args"]
    flat = {k: v for k, v in init.items() if k != "recipe"}
    flat.update(init["recipe"])
    translated = cls.FLAT.to_parts(flat)
    default = inspect.signature(cls.__init__).parameters["recipe"].default
    expected = Recipe(**{**dataclasses.asdict(default), **init["recipe"]})
    assert Recipe(**translated["recipe"]) == expected and "lr" not in translated


@pytest.mark.parametrize("task, cls", [("mae", MaskedImageModeling), ("dino", DINOPretraining),
                                        ("seq2seq", Seq2SeqModule)])
def test_a_checkpoint_of_before_the_recipe_part_runs_its_recipe(task, cls, upgraded):
    path = ROOT / "tests/fixtures/before_tasks" / f"{task}.ckpt"
    hp = torch.load(path, map_location="cpu", weights_only=True)["hyper_parameters"]
    module = cls.load_from_checkpoint(upgraded(path), map_location="cpu")
    fields = ("lr", "weight_decay", "eps", "warmup_steps") if task == "seq2seq" else ("lr", "weight_decay", "min_lr",
                                                                                       "warmup_epochs")
    for field in fields:
        assert getattr(module.recipe, field) == hp[field], field
    assert tuple(module.recipe.betas) == tuple(hp["betas"])
    assert module.hparams.recipe == dataclasses.asdict(module.recipe) and "lr" not in module.hparams
    if task == "seq2seq":  # the Transformer's schedule, as its module ran it before
        assert module.recipe.schedule == "rsqrt" and not module.lr_multiplier().needs_length


def test_a_recipe_given_in_part_takes_the_rest_from_its_own_modules_recipe(tmp_path):
    """What a config or the flags leave out of a recipe is the module's own default, never the classifier's (the
    parser's first class) carried over to the class a config names."""
    run = cli_main(["-c", "seq2seq_reverse", "--model.recipe.lr", "1e-3", "--trainer.accelerator", "cpu"], run=False)
    recipe = run.model.recipe
    assert (recipe.schedule, recipe.warmup_steps, recipe.lr, recipe.eps, tuple(recipe.betas), recipe.weight_decay) \
        == ("rsqrt", 200, 1e-3, 1e-9, (0.9, 0.98), 0.0)
    data = write_digit_masks(tmp_path / "data", train=4, val=2, size=32, glyph_size=16)
    (tmp_path / "seg.yaml").write_text(yaml.safe_dump({"model": {"class_path": "vitkit.lit.Segmenter", "init_args": {
        "recipe": {"lr": 0.01}}}, "data": {"class_path": "vitkit.lit.SegmentationDataModule"}}))
    segmenter = cli_main(["-c", str(tmp_path / "seg.yaml"), *FLAGS, "--data.root", str(data)], run=False).model
    assert segmenter.recipe == dataclasses.replace(RECIPE, lr=0.01)


def test_a_recipe_field_a_module_cannot_run_is_refused():
    with pytest.raises(ValueError, match=r"DINO takes no recipe.ema_decay \(the teacher is DINO's average"):
        DINOPretraining(model_name="vit_tiny_patch16_224", recipe=dataclasses.replace(DINOPretraining.FLAT.recipe,
                        ema_decay=0.9), img_size=32, model_overrides=json.loads(TINY))
    with pytest.raises(ValueError, match="masked image modeling takes no recipe.ema_is_model"):
        MaskedImageModeling(model_name="vit_tiny_patch16_224", img_size=32, model_overrides=json.loads(TINY),
                            recipe=dataclasses.replace(MaskedImageModeling.FLAT.recipe, ema_decay=0.9,
                                                       ema_is_model=True))


def test_every_segmentation_recipe_is_found():
    assert {p.stem for p in RECIPES} == {"seg_linear_probe", "seg_finetune_small_data", "upernet_swin"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_segmentation_recipe_builds_its_parts_and_its_flat_form_translates_to_them(path):
    init = yaml.safe_load(path.read_text())["model"]["init_args"]
    if isinstance(init.get("adaptation"), str):  # `adaptation: Frozen`, as LightningCLI reads a kind's short name
        init = {**init, "adaptation": {"class_path": f"vitkit.lit.{init['adaptation']}"}}
    recipe, adaptation = _parts(init)
    flat = _flat(init)
    for field in ("lr", "weight_decay", "warmup_epochs", "min_lr", "schedule", "ema_decay", "ema_is_model",
                  "layer_decay"):
        assert getattr(recipe, field) == flat.get(field, getattr(RECIPE, field)), field
    assert isinstance(adaptation, Frozen) == flat["freeze_backbone"]
    assert _parts(Segmenter.FLAT.to_parts(flat)) == (recipe, adaptation)


@pytest.mark.parametrize("name, kind, lr", [("segmenter", Full, 1e-3), ("segmenter_frozen", Frozen, 1e-3),
                                            ("segmenter_lora", LoRA, None)])
def test_a_segmenter_checkpoint_of_before_the_parts_loads_with_its_outputs_and_parts(name, kind, lr, upgraded):
    module = Segmenter.load_from_checkpoint(upgraded(OLD / f"{name}.ckpt"), map_location="cpu").eval()
    assert type(module.adaptation) is kind and (lr is None or module.recipe.lr == lr)
    if kind is LoRA:  # the flags it was written with
        assert (module.adaptation.rank, module.adaptation.alpha, module.adaptation.head_init) == (2, 4, "probe")
        assert module.recipe.ema_is_model and module.recipe.layer_decay == 0.75
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = module(x)
    torch.testing.assert_close(got, torch.load(OLD / "outputs.pt", weights_only=True)[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["segmenter", "segmenter_lora"])
def test_evaluate_scores_a_segmenter_checkpoint_of_before_the_parts_as_it_did(name, tmp_path, capsys, upgraded):
    data = write_digit_masks(tmp_path / "data", train=16, val=8, size=32, glyph_size=16)
    status, err = run_cli(["evaluate", "--checkpoint", str(upgraded(OLD / f"{name}.ckpt")), "--data.root", str(data),
                           "-o",
                           str(tmp_path / "eval")], capsys)
    assert status == 0, err
    got = json.loads((tmp_path / "eval" / "metrics.json").read_text())["mIoU"]
    assert got == pytest.approx(json.loads((OLD / "evaluate.json").read_text())[name]["mIoU"], abs=1e-6)


def test_flat_segmentation_flags_are_refused_naming_the_parts_flags(tmp_path):
    from tests.commands import error_line_of

    data = write_digit_masks(tmp_path / "data", train=8, val=4, size=32, glyph_size=16)
    common = ["train", "fit", "-c", "seg_finetune_small_data", *FLAGS, "--data.root", str(data)]
    assert error_line_of([*common, "--model.lora_rank", "2"]).endswith(
        "give --model.adaptation LoRA --model.adaptation.rank 2")
    assert error_line_of([*common, "--model.schedule", "poly"]).endswith("give --model.recipe.schedule poly")
    new = cli_main([*common[2:], "--model.adaptation", "LoRA", "--model.adaptation.rank", "2", "--model.recipe.lr",
                    "3e-4", "--model.adaptation.head_init", "random", "--model.recipe.schedule", "poly",
                    "--model.recipe.layer_decay", "null"], run=False).model
    assert new.adaptation == LoRA(rank=2)
    assert new.recipe.lr == 3e-4 and new.recipe.schedule == "poly" and new.recipe.layer_decay is None
    frozen = cli_main(["-c", "seg_linear_probe", *FLAGS, "--data.root", str(data)], run=False).model
    assert isinstance(frozen.adaptation, Frozen) and not any(
        p.requires_grad for p in frozen.model.backbone.parameters())
    assert all(p.requires_grad for p in frozen.model.decode_head.parameters())


def test_a_segmenters_lora_checkpoint_keeps_what_trained_and_loads_back(tmp_path):
    data = write_digit_masks(tmp_path / "data", train=16, val=8, size=32, glyph_size=16)
    backbone = tmp_path / "backbone.safetensors"
    save_file(vitkit.create_model("vit_tiny_patch16_224", num_classes=0, img_size=32,
                                  **json.loads(TINY)).state_dict(), backbone)
    run = cli_main(["fit", "-c", "seg_linear_probe", *FLAGS, "--data.root", str(data), "--model.adaptation", "LoRA",
                    "--model.adaptation.rank", "2", "--model.checkpoint", str(backbone), "--trainer.max_steps", "2",
                    "--trainer.default_root_dir", str(tmp_path / "run")])
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    state = torch.load(last, map_location="cpu", weights_only=True)["state_dict"]
    assert any(".lora_A." in k for k in state) and any(k.startswith("model.decode_head.") for k in state)
    assert not any(k.startswith("model.backbone.") and ".lora_" not in k for k in state), sorted(state)
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = run.model.eval()(x)
        loaded = Segmenter.load_from_checkpoint(last, map_location="cpu").eval()(x)
    torch.testing.assert_close(loaded, trained)
    backbone.rename(tmp_path / "moved.safetensors")
    with pytest.raises(FileNotFoundError, match=f"holds LoRA adapters for the backbone {backbone}, which is not there"):
        Segmenter.load_from_checkpoint(last, map_location="cpu")


def test_a_probe_for_a_head_it_cannot_fit_is_refused_before_the_backbone_is_built(monkeypatch):
    """The probe fits the linear head; with DPT or UperNet the line names the setting that trains them instead, and
    comes before any backbone is built (or its weights read)."""
    monkeypatch.setattr(vitkit, "create_model", lambda *a, **k: pytest.fail("the backbone was built"))
    from vitkit.tasks.segmentation.parts import DPT, UperNet

    for head in (DPT(), UperNet()):
        with pytest.raises(ValueError, match=rf"the head is {type(head).__name__}: give --model.adaptation.head_init"):
            Segmenter(model_name="vit_small_patch14_dinov2", head=head, num_classes=3,
                      adaptation=Full(head_init="probe"))
