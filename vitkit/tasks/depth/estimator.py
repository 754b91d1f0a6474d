"""``DepthEstimator``: a depth model on a vitkit ViT trained with the training base's machinery (AdamW, layer decay,
warmup + cosine decay, EMA, skipped non-finite steps, exact resume): DPT's depth head on four layers' maps, the
scale-and-shift-invariant loss with gradient matching for relative depth or the scale-invariant log loss for metric
depth, scored by Eigen's errors on the valid pixels of each map at its own size (``vitkit.evaluation.depth``), a
relative model's output aligned to the truth by least squares first. The backbone trains whole, frozen, or through
LoRA adapters, as the classifier's."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from jsonargparse import lazy_instance
from torch import Tensor, nn

from vitkit.errors import UsageError
from vitkit.evaluation.depth import DepthMetrics, scored, silog_loss, ssi_loss, valid_mask
from vitkit.models.depth import build_depth_model
from vitkit.training.adaptation import Adaptation, AdaptsBackbone, Full, headless_backbone
from vitkit.training.base import TrainingModule
from vitkit.training.parts import config_of, part_from
from vitkit.training.recipe import Recipe

KINDS = ("relative", "metric")
# Depth Anything's fine-tuning: AdamW at 5e-6 for the backbone and 10x for the head in its paper; here one LR with
# layer decay (the head at the full rate), warmup and cosine decay
RECIPE = Recipe(lr=5e-5, weight_decay=0.01, warmup_epochs=1.0, min_lr=1e-7, layer_decay=0.75)
WHOLE_MODEL = lazy_instance(Full)


@dataclasses.dataclass(frozen=True)
class DepthLoss:
    """The depth loss's weights (``vitkit.evaluation.depth``'s losses).

    A relative model's is MiDaS's affine-invariant loss on inverse depth with ``gradient_weight`` x its gradient
    matching at ``scales`` scales; a metric model's the scale-invariant log loss with ``silog_lambda`` (Depth
    Anything's and BTS's 0.5)."""

    gradient_weight: float = 0.5
    scales: int = 4
    silog_lambda: float = 0.5

    def __post_init__(self) -> None:
        if self.gradient_weight < 0 or self.scales < 1 or not 0 <= self.silog_lambda <= 1:
            raise UsageError(f"gradient_weight must be >= 0, scales >= 1 and silog_lambda in [0, 1], got "
                             f"{self.gradient_weight}, {self.scales} and {self.silog_lambda}")


class DepthEstimator(AdaptsBackbone, TrainingModule):
    """DPT's depth head on a vitkit ViT: relative (affine-invariant inverse depth) or metric depth.

    Args:
        model_name: the backbone: a plain ViT preset or a pretrained name (``vit_small_patch14_dinov2.lvd142m``).
        pretrained: load the name's weights (offline-first).
        checkpoint: the backbone's weights from a file (any format vitkit reads).
        img_size: the square input (linked from the data module).
        model_overrides: the backbone's config fields.
        kind: ``relative`` (MiDaS's and Depth Anything's: trained and scored up to a scale and shift of inverse
            depth) or ``metric`` (depth in the data's unit up to ``max_depth``).
        max_depth: a metric model's deepest output (NYU: 10 m, KITTI: 80 m; linked from the data's ``max_depth``
            where it has one), and the range a relative model's aligned output is clipped to.
        head: ``dpt`` (DPT's depth head, Depth Anything's) or ``linear`` (a linear probe of the layers' maps,
            DINOv2's "linear4" depth head without its bins: ``depth_linear_probe``).
        indices: the four layers the head reads (default: evenly spread, ending at the last).
        channels: the fused maps' width (Depth Anything: 64 for ViT-S, 128 for B, 256 for L).
        reassemble: the four reassembled maps' widths (default: 1/8, 1/4, 1/2 and all of the backbone's).
        loss: ``DepthLoss``.
        recipe: the optimizer, schedule, EMA and steps (``vitkit.training.recipe.Recipe``).
        adaptation: ``Full``, ``Frozen`` (the head alone trains) or ``LoRA``.
    """

    def __init__(
        self,
        model_name: str = "vit_small_patch14_dinov2",
        pretrained: bool = False,
        checkpoint: str | None = None,
        img_size: int | None = None,
        model_overrides: dict[str, Any] | None = None,
        kind: str = "relative",
        max_depth: float | None = None,
        head: str = "dpt",
        indices: list[int] | None = None,
        channels: int = 64,
        reassemble: list[int] | None = None,
        loss: DepthLoss = DepthLoss(),  # noqa: B008 - a frozen dataclass: one shared default is safe
        recipe: Recipe = RECIPE,
        adaptation: Adaptation = WHOLE_MODEL,
    ) -> None:
        super().__init__()
        self.keep_arguments()
        self.use_recipe(recipe)
        self.adaptation = part_from(adaptation, Adaptation, Full())
        self.hparams.adaptation = config_of(self.adaptation)
        self.loss = loss if isinstance(loss, DepthLoss) else DepthLoss(**dict(loss or {}))
        self.hparams.loss = dataclasses.asdict(self.loss)
        if kind not in KINDS:
            raise UsageError(f"kind must be relative or metric, got {kind!r}")
        if kind == "metric" and not (max_depth and max_depth > 0):
            raise UsageError("a metric depth model needs max_depth, its deepest output (NYU: 10, KITTI: 80; "
                             "--model.max_depth or the data's --data.max_depth)")
        self.refuse_probe("a depth head")
        backbone = headless_backbone(model_name, pretrained, checkpoint, img_size, model_overrides)
        self.model = build_depth_model(backbone, indices, channels=channels, reassemble=reassemble, kind=kind,
                                       max_depth=max_depth if kind == "metric" else 1.0, head=head)
        self.hparams.indices = list(self.model.indices)
        self.adaptation.apply(self)
        self.metrics = nn.ModuleDict({s: DepthMetrics() for s in ("val", "test")})
        self.make_ema(self.recipe.ema_decay, self.recipe.ema_is_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.evaluated()(x)

    def valid(self, depth: Tensor) -> Tensor:
        """The pixels of ``depth`` with a measurement that counts (at most ``max_depth`` where there is one)."""
        return valid_mask(depth, max_depth=self.hparams.max_depth)

    def step_loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, depth = batch
        pred = self.model(x)
        valid = self.valid(depth)
        if self.hparams.kind == "metric":
            return silog_loss(pred, depth, valid, self.loss.silog_lambda)
        disparity = torch.where(valid, 1 / depth.clamp(min=1e-6), torch.zeros_like(depth))
        return ssi_loss(pred, disparity, valid, self.loss.gradient_weight, self.loss.scales)

    def _evaluate(self, batch: tuple[Tensor, Tensor | list[Tensor]], split: str) -> None:
        x, depths = batch
        for pred, depth in zip(self(x), depths, strict=True):
            p, valid = scored(pred, depth, self.hparams.kind, self.hparams.max_depth)
            self.metrics[split].update(p[None], depth[None].float(), valid[None])

    def validation_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def _log_scores(self, split: str) -> None:
        result = self.metrics[split].compute()  # summed over every rank
        self.metrics[split].reset()
        for name, value in result.items():
            if name != "samples":
                self.log(f"{split}/{name}", value, prog_bar=name in ("AbsRel", "delta1"), sync_dist=False)

    def on_validation_epoch_end(self) -> None:
        self._log_scores("val")

    def on_test_epoch_end(self) -> None:
        self._log_scores("test")

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x)
