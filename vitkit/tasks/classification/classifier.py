"""Image classification with Lightning: the DeiT/Swin recipe around any vitkit preset."""

from __future__ import annotations

import logging
from typing import Any

from jsonargparse import lazy_instance
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

import vitkit
from vitkit.checkpoints.names import capabilities
from vitkit.errors import UsageError
from vitkit.training.base import EMA, TrainingModule
from vitkit.training.hparams import record_config
from vitkit.training.parts import config_of, part_from
from vitkit.training.recipe import Recipe

from .adaptation import Adaptation, Full, warn_whole_model_augmentation
from .distill import Teacher
from .flat import ClassifierFlat
from .labels import Labels, SingleLabel
from .probe import HeadNorm, fold_into_checkpoint, unfold_from_checkpoint
from .report import collect, write_test_report
from .small_data import fit_head, suggest_small_data_recipe

__all__ = ["EMA", "ImageClassifier"]
log = logging.getLogger(__name__)


def _build_model(name: str, pretrained: bool, checkpoint: str | None, num_classes: int | None,
                 img_size: int | tuple[int, int] | None, overrides: dict[str, Any] | None) -> nn.Module:
    if not capabilities(name).images:
        raise UsageError(f"{name!r} is an encoder-decoder preset; train it with "
                         "--model vitkit.lit.Seq2SeqModule (class_path: vitkit.lit.Seq2SeqModule in a config)")
    overrides = dict(overrides or {})
    if num_classes is not None:
        overrides["num_classes"] = num_classes
    if img_size is not None:
        overrides["img_size"] = img_size
    model = vitkit.create_model(name, pretrained=pretrained, checkpoint=checkpoint, **overrides)
    if getattr(model, "load_report", None) is not None:
        rank_zero_info(str(model.load_report))
    return model


RECIPE = Recipe(lr=5e-4, weight_decay=0.05, warmup_epochs=5.0, min_lr=1e-5)  # DeiT's (Touvron et al., 2021), batch 512
ONE_LABEL, WHOLE_MODEL = lazy_instance(SingleLabel), lazy_instance(Full)  # defaults LightningCLI shows by class path


class ImageClassifier(TrainingModule):
    """A vitkit preset trained as a classifier, built from typed parts.

    The recipe (AdamW, warmup + cosine, EMA), the labels (one per image or several, label smoothing, mixup and
    cutmix), the adaptation of the backbone (all of it, frozen, LoRA adapters) and a teacher to distil from. Each part
    owns its checks, its loss term and its hooks.

    Every argument is serializable (a part as its ``class_path`` and ``init_args``), so
    ``ImageClassifier.load_from_checkpoint(path)`` rebuilds the module with or without the CLI; a checkpoint of the
    flat arguments that came before the parts (``lr``, ``freeze_backbone``, ``lora_rank``, ...) is upgraded once by
    ``vitkit convert OLD.ckpt NEW.ckpt`` (``flat.py`` says what each became).

    Args:
        model_name: a preset from ``vitkit.list_models()``, or a pretrained name: a timm tag
            (``vit_base_patch16_224.augreg2_in21k_ft_in1k``) or torchvision weights
            (``ViT_B_16_Weights.IMAGENET1K_V1``), whose mean, std, crop and interpolation the data follows.
        pretrained: load that name's weights (from the Hugging Face or torch hub cache, downloaded only when
            missing); positions / windows are resampled to ``img_size`` and a new head is made for ``num_classes``.
        checkpoint: pretrained weights to start from (a file or folder of any format vitkit reads, see
            ``vitkit.checkpoints``), adapted as with ``pretrained``. Read when the module is built; resuming
            with ``--ckpt_path`` then replaces them with the run's own. A checkpoint this module writes holds
            every weight, so it records ``pretrained: false`` and no ``checkpoint``: ``load_from_checkpoint``
            reads nothing else.
        num_classes: classes of the data (linked from the data module by the CLI).
        img_size: input resolution, one int or (H, W) (linked from the data module by the CLI); None keeps the
            preset's.
        model_overrides: any other config field of the preset, e.g. ``{"depth": 6, "drop_path_rate": 0.1}``.
        class_names: stored in the checkpoint for prediction (linked from the data module).
        recipe: the optimizer, schedule, EMA and steps (``vitkit.training.recipe.Recipe``; the configs scale ``lr``
            as lr_base x batch / 512).
        labels: ``SingleLabel`` (softmax, top-1 and top-5) or ``MultiLabel`` (a sigmoid per class, mAP and F1 at
            thresholds chosen on the validation predictions; a ``ManifestDataModule`` or ``HFDataModule`` gives
            multi-hot targets), with their label smoothing and mixing (``labels.py``).
        adaptation: ``Full`` (every weight trains), ``Frozen`` (only the head: a linear probe) or ``LoRA`` (adapters
            through peft, and the head); each with ``head_init`` (``probe``: the head fitted on the frozen features
            before the first step) and ``head_norm`` (MAE's probe normalisation) (``adaptation.py``).
        teacher: knowledge distillation from a frozen teacher (``distill.Teacher``: its name or file, ``hard`` or
            ``soft`` distillation, the term's share ``alpha`` and temperature ``tau``); None: none.
    """

    FLAT = ClassifierFlat(RECIPE)

    def __init__(
        self,
        model_name: str = "vit_tiny_patch16_224",
        pretrained: bool = False,
        num_classes: int | None = None,
        img_size: int | tuple[int, int] | None = None,
        model_overrides: dict[str, Any] | None = None,
        class_names: list[str] | None = None,
        checkpoint: str | None = None,
        recipe: Recipe = RECIPE,
        labels: Labels = ONE_LABEL,
        adaptation: Adaptation = WHOLE_MODEL,
        teacher: Teacher | None = None,
    ) -> None:
        super().__init__()
        self.keep_arguments()
        self.use_recipe(recipe)
        self.labels = part_from(labels, Labels, SingleLabel())
        self.adaptation = part_from(adaptation, Adaptation, Full())
        self.distill = teacher if isinstance(teacher, Teacher) or teacher is None else Teacher(**teacher)
        for key, part in (("labels", self.labels), ("adaptation", self.adaptation), ("teacher", self.distill)):
            self.hparams[key] = config_of(part)  # plain values, as the recipe's
        self._check_parts()
        self.model = _build_model(model_name, pretrained, checkpoint, num_classes, img_size, model_overrides)
        self.num_classes = self.model.cfg.num_classes
        self.adaptation.apply(self)
        self.head_norm = HeadNorm(self.model) if self.adaptation.head_norm else None
        self.probe_baseline: float | None = None
        self.probe_file = ""
        self._teacher = None
        if self.distill is not None:
            self.distill.attach(self)
        self.make_ema(self.recipe.ema_decay, self.recipe.ema_is_model)
        self.labels.attach(self)

    def _check_parts(self) -> None:
        """What no part can say alone."""
        if self.labels.multi_label and self.distill is not None:
            raise UsageError("distillation with multi_label is not built: a teacher's softmax over classes is not a "
                             "target for several independent labels; train without a teacher")
        if self.recipe.ema_is_model and self.adaptation.head_norm:
            raise UsageError("ema_is_model and head_norm: the probe's normalisation is folded into the model that "
                             "trains; keep one of them")

    def adapter_lr_scale(self) -> float:
        return self.adaptation.adapter_lr_scale()

    def adapted(self) -> nn.Module:
        """Where LoRA adapters go: the classifier (its head has none of their target layers)."""
        return self.model

    @staticmethod
    def is_head(name: str) -> bool:
        """Whether a name of the model's parameters or children is the head's (``head``, ``head_drop``,
        ``head_dist``): it trains under every adaptation."""
        return name.startswith("head")

    @property
    def multi_label(self) -> bool:
        return self.labels.multi_label

    def forward(self, x: Tensor) -> Tensor:
        return self.evaluated()(x) if self.head_norm is None else self.head_norm(self.model, x)

    def ema_beside(self, split: str) -> bool:
        """Whether ``split`` is also scored on an EMA kept beside the model (``val/top1_ema``)."""
        return split == "val" and self.ema is not None and not self.ema_is_model

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if checkpoint.get("hyper_parameters") is not None:
            record_config(self.model, checkpoint["hyper_parameters"])
        if self.head_norm is not None:  # the file is a plain classifier; the probe as trained rides beside it
            fold_into_checkpoint(self.head_norm, self.model, checkpoint)
        self.adaptation.save(self, checkpoint)
        if self.probe_baseline is not None:
            checkpoint["probe_baseline"], checkpoint["probe_file"] = self.probe_baseline, self.probe_file
        self.labels.save(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        if self.head_norm is not None:
            unfold_from_checkpoint(self.model, checkpoint)
        self.adaptation.load(self, checkpoint)
        self.probe_baseline = checkpoint.get("probe_baseline", self.probe_baseline)
        self.probe_file = checkpoint.get("probe_file", self.probe_file)
        self.labels.load(self, checkpoint)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        dm = getattr(self.trainer, "datamodule", None)
        self.labels.check_data(self, dm)
        self.adaptation.before_fit(self)
        if self.adaptation.head_init == "random":
            suggest_small_data_recipe(self, dm)
        if self.adaptation.frozen:
            warn_whole_model_augmentation(self.labels, dm)
        self._keep_crop_mode(dm)
        self._check_packing(dm)
        if self.distill is not None:
            self.distill.before_fit(self, dm)

    def _check_packing(self, dm) -> None:
        """Refuse what packed batches (``--data.packing``) cannot run: images mixed into one another, a teacher's
        images, MAE's head norm."""
        if getattr(dm, "pack_plan", lambda: None)() is None:
            return
        parts = (("mixup / cutmix (--model.labels.mixup, --model.labels.cutmix: 0)", self.mixup is not None),
                 ("distillation (--model.distill)", self.distill is not None),
                 ("the MAE head norm (--model.adaptation.head_norm false)", self.head_norm is not None))
        off = [name for name, on in parts if on]
        if off:
            raise UsageError(f"--data.packing: packed batches of images of their own sizes cannot run "
                             f"{', '.join(off)}; turn it off")

    def _keep_crop_mode(self, dm) -> None:
        """How the data prepares an image for validation (its crop mode, ``squash``: the whole image; its crop_pct,
        interpolation, mean and std) and with packing its patch budget become the model's, in its config and the
        checkpoint's overrides, so that predict, evaluate and exports prepare images as this run validated them."""
        plan = getattr(dm, "pack_plan", lambda: None)()
        data = getattr(dm, "data_cfg", None)
        kept = {k: getattr(data, k, None) for k in ("crop_mode", "crop_pct", "interpolation", "mean", "std")}
        kept["max_patches"] = None if plan is None else plan.max_patches
        kept = {k: tuple(v) if isinstance(v, list | tuple) else v for k, v in kept.items() if v is not None}
        kept = {k: v for k, v in kept.items()
                if v != (tuple(c) if isinstance(c := getattr(self.model.cfg, k, v), list | tuple) else c)}
        if kept:
            self.model.configure(**kept)
            self.hparams.model_overrides = {**(self.hparams.model_overrides or {}),
                                            **{k: list(v) if isinstance(v, tuple) else v for k, v in kept.items()}}

    def fit_probe_head(self) -> None:
        """``head_init="probe"``: the head fitted on the frozen features, its score logged and its model saved."""
        dm = self.trainer.datamodule
        score = fit_head(self.model, dm, self.device, self.multi_label)
        self.keep_probe(score, self.labels.score, f"{len(dm.train_set)} training images")

    def train(self, mode: bool = True) -> ImageClassifier:
        """``nn.Module.train``, which puts a frozen backbone back in eval mode: the head learns from the features
        the backbone gives at inference, not from features noised by its drop path."""
        super().train(mode)
        if mode:
            self.adaptation.train_mode(self)
        return self

    def on_train_epoch_start(self) -> None:
        self.adaptation.train_mode(self)  # a module's mode set without train() (a callback, a strategy) too

    # -- steps -------------------------------------------------------------------------------------

    def step_loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        return self._loss(*batch)

    def _loss(self, x: Tensor, y: Tensor) -> Tensor:
        loss, distilled = self.labels.train_loss(self, x, y)  # x is mixed in place: the teacher sees it so
        return loss if self.distill is None else self.distill.loss(self, loss, distilled, x)

    def on_train_epoch_end(self) -> None:
        super().on_train_epoch_end()
        self._report_skipped("train")

    def on_validation_epoch_end(self) -> None:
        self._report_skipped("val")
        self.labels.validation_end(self)

    def on_test_epoch_start(self) -> None:
        self._test_predictions = self.labels.empty_predictions(self.num_classes)

    def on_test_epoch_end(self) -> None:
        self._report_skipped("test")
        for name, value in write_test_report(self, self._test_predictions).items():
            self.log(f"test/{name}", value)

    def _report_skipped(self, split: str) -> None:
        dm = getattr(self.trainer, "datamodule", None)
        if hasattr(dm, "report_skipped"):
            self.log(f"{split}/skipped_files", float(dm.report_skipped(split)))

    def _evaluate(self, batch: tuple[Tensor, Tensor], split: str) -> Tensor | None:
        x, y = batch
        if len(y) == 0:  # every file of the batch was unreadable
            return None
        return self.labels.evaluate(self, x, y, split)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        logits = self._evaluate(batch, "test")
        if logits is not None:  # for the report of `vitkit train test` (below)
            collect(self._test_predictions, self.trainer, batch, logits, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self.labels.probabilities(self(x))
