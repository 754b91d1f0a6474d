"""Self-supervised pre-training with Lightning: MAE for ViT, SimMIM for Swin and ViT, through the same command as
every recipe (``vitkit train fit -c mae_vit_base_in1k --data.root DIR``). The data's labels, where it has any,
are ignored.

The checkpoint is a backbone: its ``model.encoder.*`` weights are the ViT / Swin of ``model_name`` with the
preset's names, so ``vitkit train fit -c vit_base_finetune --model.checkpoint last.ckpt`` fine-tunes it (the
headless path), as ``vitkit.create_model(checkpoint=...)`` reads it, and ``vitkit convert`` writes the encoder.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

import vitkit
from vitkit.checkpoints.names import capabilities
from vitkit.errors import UsageError
from vitkit.evaluation.plots import draw_reconstructions
from vitkit.models.packing import PackedBatch
from vitkit.training.base import TrainingModule
from vitkit.training.flat import Flat
from vitkit.training.recipe import Recipe

log = logging.getLogger(__name__)

# the module's arguments that are fields of MAEConfig / SimMIMConfig; None: the checkpoint's, else the paper's
MIM_FIELDS = ("mask_ratio", "norm_pix_loss", "decoder_embed_dim", "decoder_depth", "decoder_num_heads",
              "decoder_mlp_ratio", "mask_patch_size")


RECIPE = Recipe(lr=1.5e-4, weight_decay=0.05, betas=(0.9, 0.95), warmup_epochs=40.0)  # MAE's (He et al., 2022)


class MaskedImageModeling(TrainingModule):
    """Masked image modeling (MAE or SimMIM) of a vitkit ViT or Swin preset.

    MAE: He et al., 2022; SimMIM: Xie et al., 2022. With the training machinery of every vitkit module (warmup + cosine,
    EMA, skipped non-finite steps, exact resume, FSDP2). Logs ``train/loss_*`` and ``val/loss``; each validation epoch
    draws original / masked / reconstruction of a few fixed validation images into ``<root>/reconstructions/`` (not
    of packed batches: with ``--data.packing``, MAE trains on images of their own sizes, none drawn).

    Args:
        model_name: the encoder preset (``vit_base_patch16_224``, ``swin_base_patch4_window7_224``, ...).
        objective: ``mae`` (ViT) or ``simmim`` (Swin or ViT); None: MAE for ViT, SimMIM for Swin.
        pretrained: start from the preset's pretrained weights, as for ``ImageClassifier``.
        checkpoint: start from a file; one with pre-training heads (a run of this module, Meta's
            ``mae_visualize_*``, transformers' ViTMAEForPreTraining) brings those too, so pre-training continues
            where it stopped.
        img_size: input resolution (linked from the data module).
        model_overrides: the encoder's config fields.
        mask_ratio: MAE's share of masked patches (None: the checkpoint's, else the paper's 0.75).
        norm_pix_loss: MAE's loss on per-patch normalised pixels (None: the checkpoint's, else on).
        decoder_embed_dim: MAE's decoder width (None: the checkpoint's, else 512).
        decoder_depth: MAE's decoder blocks (None: the checkpoint's, else 8).
        decoder_num_heads: MAE's decoder heads (None: the checkpoint's, else 16).
        decoder_mlp_ratio: MAE's decoder MLP ratio (None: the checkpoint's, else 4).
        mask_patch_size: SimMIM's mask block in pixels (None: the checkpoint's, else 32).
        recipe: the optimizer, schedule, EMA and steps (``vitkit.training.recipe.Recipe``, as for
            ``ImageClassifier``; the recipes scale ``lr`` as base lr x batch / 256). Default MAE's: AdamW at 1.5e-4,
            betas (0.9, 0.95), weight decay 0.05, 40 epochs of warmup, then cosine decay.
        num_pictures: validation images drawn each epoch (0: none).
    """

    FLAT = Flat(RECIPE)  # the flat lr, weight_decay, ... of before the recipe part

    def __init__(
        self,
        model_name: str = "vit_base_patch16_224",
        objective: Literal["mae", "simmim"] | None = None,
        pretrained: bool = False,
        checkpoint: str | None = None,
        img_size: int | tuple[int, int] | None = None,
        model_overrides: dict[str, Any] | None = None,
        mask_ratio: float | None = None,
        norm_pix_loss: bool | None = None,
        decoder_embed_dim: int | None = None,
        decoder_depth: int | None = None,
        decoder_num_heads: int | None = None,
        decoder_mlp_ratio: float | None = None,
        mask_patch_size: int | None = None,
        recipe: Recipe = RECIPE,
        num_pictures: int = 8,
    ) -> None:
        super().__init__()
        self.keep_arguments()
        self.use_recipe(recipe)
        self.recipe.refuse("masked image modeling", ema_is_model="it validates and saves the weights being trained; "
                           "an EMA beside them is ema_decay")
        if not capabilities(model_name).mim:
            raise UsageError(f"masked image modeling pre-trains a ViT or a Swin preset, got {model_name!r}")
        overrides = dict(model_overrides or {})
        if img_size is not None:
            overrides["img_size"] = img_size
        given = {k: getattr(self.hparams, k) for k in MIM_FIELDS if getattr(self.hparams, k) is not None}
        objective = objective or capabilities(model_name).mim[0]
        self.model = vitkit.create_mim(model_name, objective=objective, pretrained=pretrained,
                                       checkpoint=checkpoint, mim=given, **overrides)
        self.hparams.objective = objective  # what ran, for the checkpoint (and its readers)
        for k in MIM_FIELDS:  # the settings that ran, recorded (the checkpoint's or the paper's where not given)
            if hasattr(self.model.cfg, k):
                self.hparams[k] = getattr(self.model.cfg, k)
        for report in (self.model.load_report, getattr(self.model, "heads_report", None)):
            if report is not None:
                rank_zero_info(str(report))
        self.make_ema(self.recipe.ema_decay)
        self._pictures: Tensor | None = None

    def forward(self, images: Tensor | PackedBatch, *args: Any):
        return self.model(images, *args)

    def step_loss(self, batch) -> Tensor:
        return self.model(batch[0]).loss

    def _fixed_masking(self, images: Tensor, batch_idx: int):
        """The same mask for the same validation batch every epoch, so that the losses compare."""
        g = torch.Generator(device="cpu").manual_seed(10_007 * batch_idx + 1)
        if isinstance(images, PackedBatch):  # MAE draws each image's visible patches with it
            return g
        B, _, H, W = images.shape
        if self.hparams.objective == "mae":
            p = self.model.patch_size
            return torch.rand(B, (H // p) * (W // p), generator=g).to(images.device)
        return self.model.random_mask(B, (H, W), images.device, generator=g)

    def validation_step(self, batch, batch_idx: int) -> None:
        images = batch[0]
        if len(images) == 0:
            return
        masking = self._fixed_masking(images, batch_idx)
        self.log("val/loss", self.model(images, masking).loss, prog_bar=True, sync_dist=True,
                 batch_size=len(images))
        if self.ema is not None:
            again = self._fixed_masking(images, batch_idx)  # the same masks (a packed batch: a generator used up)
            self.log("val/loss_ema", self.ema(images, again).loss, sync_dist=True, batch_size=len(images))
        if batch_idx == 0 and self.hparams.num_pictures and not isinstance(images, PackedBatch):
            self._pictures = (images[: self.hparams.num_pictures].detach(), masking[: self.hparams.num_pictures])

    def on_validation_epoch_end(self) -> None:
        if self._pictures is None or self.trainer.sanity_checking or not self.trainer.is_global_zero:
            return
        images, masking = self._pictures
        self._pictures = None
        path = Path(self.trainer.default_root_dir) / "reconstructions" / f"epoch_{self.current_epoch:03d}.png"
        cfg = self.data_cfg()
        draw_reconstructions(self.model, images, masking, getattr(cfg, "mean", None), getattr(cfg, "std", None), path,
                             f"{self.hparams.objective}, epoch {self.current_epoch}")
        for logger in self.loggers:
            if hasattr(logger, "log_image"):  # wandb, neptune, ...
                logger.log_image(key="val/reconstructions", images=[str(path)], step=self.global_step)
