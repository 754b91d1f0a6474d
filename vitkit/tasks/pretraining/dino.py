"""DINO pre-training with Lightning (DINOv2's recipe: DINO, iBOT, KoLeo), through the same command as every recipe
(``vitkit train fit -c dinov2_continue --data.root DIR --model.checkpoint FILE``). The data's labels, where it has
any, are ignored; any image data module serves, its batches cut into DINO's global and local crops on the device
(:mod:`vitkit.data.multicrop`).

The checkpoint is a backbone: its ``model.teacher.*`` weights are the ViT of ``model_name`` with the preset's names,
so ``vitkit.create_model(checkpoint="last.ckpt")`` reads the teacher, ``vitkit train fit -c vit_base_finetune
--model.checkpoint last.ckpt`` fine-tunes it, and ``vitkit convert`` writes it for timm.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.utils.data import DataLoader

import vitkit
from vitkit.checkpoints.names import capabilities
from vitkit.data.multicrop import MultiCrop
from vitkit.errors import MissingFileError, UsageError
from vitkit.models.dino import DINO, DINOConfig
from vitkit.models.packing import PackedBatch, pack
from vitkit.tasks.pretraining.dino_parts import CROPS, DINO_FLAT, HEADS, LOSSES, Crops, Heads, Losses, part_of
from vitkit.training.base import TrainingModule
from vitkit.training.hparams import record_config
from vitkit.training.recipe import Recipe

log = logging.getLogger(__name__)

LOSS_FIELDS = ("student_temp", "center_momentum", "centering", "dino_weight", "ibot_weight", "koleo_weight",
               "mask_ratio", "mask_probability")  # what DINOConfig takes of the losses
CROP_FIELDS = ("global_crops", "local_crops", "global_scale", "local_scale", "jitter", "grey", "blur", "solarize")
RECIPE = DINO_FLAT.recipe  # DINO's (Caron et al., 2021)


class DINOPretraining(TrainingModule):
    """DINO self-distillation of a vitkit ViT preset.

    Caron et al., 2021; Oquab et al., 2024. From random weights
    or continued from a backbone, with the training machinery of every vitkit module (warmup + cosine, skipped
    non-finite steps, exact resume). Logs ``train/loss_*``, ``train/dino``, ``train/ibot``, ``train/koleo``,
    ``val/loss`` and, with ``knn_root``, ``val/knn_top1``.

    Its arguments:

        model_name: the ViT preset; pretrained, checkpoint: start the student and the teacher from those weights
            (a timm tag, any file vitkit reads); the heads are new.
        img_size: the data's resolution (linked from the data module): the global crops' size unless
            ``crops.global_size`` is given; model_overrides: the ViT's config fields.
        head: the projection heads (:class:`~vitkit.tasks.pretraining.dino_parts.Heads`: ``out_dim``,
            ``hidden_dim``, ``bottleneck_dim``, ``layers``, ``norm_last_layer``, ``ibot_out_dim``).
        loss: the temperatures, centering, loss weights and iBOT's masking
            (:class:`~vitkit.tasks.pretraining.dino_parts.Losses`).
        crops: the multi-crop (:class:`~vitkit.tasks.pretraining.dino_parts.Crops`: counts, sizes, scales, colour).
        momentum_teacher: the teacher's EMA momentum at the first step, rising to 1 on a cosine to the last.
        freeze_last_layer_epochs: the prototypes take no update for this many epochs (DINO's 1).
        head_warmup_epochs: the backbone takes no update for this many epochs while the new heads find their
            footing (for a pretrained backbone: its features are not pulled towards random prototypes).
        knn_root: an ImageNet-style folder (``train/``, ``val/``) scored by the teacher's weighted k-NN at each
            validation (``val/knn_top1``); knn_k: its neighbours.
        recipe: the optimizer, schedule and steps (``vitkit.training.recipe.Recipe``, as for ``ImageClassifier``).
            Default DINO's: AdamW at 5e-4, weight decay 0.04, 10 epochs of warmup, then cosine decay to 1e-6.
    """

    FLAT = DINO_FLAT  # the flat arguments of before the parts, and what each became

    def __init__(
        self,
        model_name: str = "vit_small_patch16_224",
        pretrained: bool = False,
        checkpoint: str | None = None,
        img_size: int | None = None,
        model_overrides: dict[str, Any] | None = None,
        head: Heads = HEADS,
        loss: Losses = LOSSES,
        crops: Crops = CROPS,
        momentum_teacher: float = 0.996,
        freeze_last_layer_epochs: float = 1.0,
        head_warmup_epochs: float = 0.0,
        knn_root: str | None = None,
        knn_k: int = 20,
        recipe: Recipe = RECIPE,
    ) -> None:
        super().__init__()
        self.keep_arguments()
        self.use_recipe(recipe)
        self.heads, self.losses, self.crop_settings = (part_of(v, cls) for v, cls in
                                                       ((head, Heads), (loss, Losses), (crops, Crops)))
        self.hparams.update(head=dataclasses.asdict(self.heads), loss=dataclasses.asdict(self.losses),
                            crops=dataclasses.asdict(self.crop_settings))
        teacher = "the teacher is DINO's average of the student (momentum_teacher)"
        self.recipe.refuse("DINO", ema_decay=teacher, ema_is_model=teacher,
                           layer_decay="every layer of the student learns at one rate")
        self.model = self._build()
        self.global_size, self.local_size = self._crop_sizes(self.crop_settings.global_size,
                                                             self.crop_settings.local_size)
        self.multicrop = MultiCrop(global_size=self.global_size, local_size=self.local_size,
                                   **{k: getattr(self.crop_settings, k) for k in CROP_FIELDS})
        self._total_steps = 1
        self._knn: tuple | None = None

    def _crop_sizes(self, global_size: int | None, local_size: int | None) -> tuple[int, int]:
        """The crops' sizes: the images' and 3/7 of it (rounded to the patch size) unless given; neither larger
        than the images, the local not larger than the global."""
        p, size = self.model.student.patch_size, self.model.student.cfg.img_size
        size = size if isinstance(size, int) else size[0]
        global_size = global_size or size
        local_size = local_size or max(p, round(global_size * 3 / 7 / p) * p)  # 96 px at 224
        for name, crop in (("global_size", global_size), ("local_size", local_size)):
            if crop > size:
                raise UsageError(f"{name}={crop} is larger than the images ({size} px, img_size): DINO's crops are "
                                 f"cut from them, at most {size} px")
        if local_size > global_size:
            raise UsageError(f"local_size={local_size} is larger than global_size={global_size}: the local crops "
                             "are the small views")
        return global_size, local_size

    def _build(self) -> DINO:
        hp = self.hparams
        if not capabilities(hp.model_name).dino:
            raise UsageError(f"DINO trains a ViT preset (its class and patch tokens), got {hp.model_name!r}")
        if not 0 <= hp.momentum_teacher <= 1:
            raise UsageError(f"momentum_teacher must be in [0, 1], got {hp.momentum_teacher}")
        if hp.knn_root is not None:  # refused now, not at the first validation
            root = Path(os.path.expanduser(hp.knn_root))
            missing = [s for s in ("train", "val") if not (root / s).is_dir()]
            if missing:
                raise MissingFileError(f"knn_root {root} has no {' or '.join(s + '/' for s in missing)} folder: the "
                                       "k-NN monitor reads root/train/<class>/* and root/val/<class>/*")
        overrides = dict(hp.model_overrides or {})
        if hp.img_size is not None:
            overrides["img_size"] = hp.img_size
        encoder = vitkit.create_model(hp.model_name, pretrained=hp.pretrained, checkpoint=hp.checkpoint,
                                      num_classes=0, **overrides)
        if getattr(encoder, "load_report", None) is not None:
            rank_zero_info(str(encoder.load_report))
        h, loss = self.heads, self.losses
        cfg = DINOConfig(encoder=hp.model_name, encoder_overrides=overrides, out_dim=h.out_dim,
                         hidden_dim=h.hidden_dim, bottleneck_dim=h.bottleneck_dim, head_layers=h.layers,
                         norm_last_layer=h.norm_last_layer, ibot_out_dim=h.ibot_out_dim,
                         **{k: getattr(loss, k) for k in LOSS_FIELDS})
        return DINO(cfg, encoder)

    # -- schedules ---------------------------------------------------------------------------------------------

    def on_train_start(self) -> None:
        super().on_train_start()
        self._total_steps = max(1, int(self.trainer.estimated_stepping_batches))

    def epochs_done(self) -> float:
        """Training progress in epochs, fractional (what the temperature warm-up and the freezes count in)."""
        epochs = self.trainer.max_epochs if self.trainer.max_epochs and self.trainer.max_epochs > 0 else 1
        return self.global_step * epochs / self._total_steps

    def teacher_temp(self) -> float:
        hp = self.losses
        if hp.warmup_teacher_temp_epochs <= 0:
            return hp.teacher_temp
        t = min(1.0, self.epochs_done() / hp.warmup_teacher_temp_epochs)
        return hp.warmup_teacher_temp + t * (hp.teacher_temp - hp.warmup_teacher_temp)

    def teacher_momentum(self) -> float:
        """DINO's: from ``momentum_teacher`` at the first step to 1 at the last, on a cosine."""
        m0 = self.hparams.momentum_teacher
        return 1 - (1 - m0) * (math.cos(math.pi * min(1.0, self.global_step / self._total_steps)) + 1) / 2

    # -- steps -------------------------------------------------------------------------------------------------

    def _crops(self, images: Tensor | PackedBatch, generator: torch.Generator | None = None):
        cfg = self.preprocessing()
        if isinstance(images, PackedBatch):
            return self._packed_crops(images, cfg, generator)
        mean, std = (torch.tensor(v, device=images.device) for v in (cfg.mean, cfg.std))
        glob, local = self.multicrop(images, mean, std, generator)
        p = self.model.student.patch_size
        grid = (self.global_size // p, self.global_size // p)
        mask = self.model.random_masks(glob.shape[0], glob.shape[1], grid, images.device, generator)
        return glob, local, mask

    def _packed_crops(self, images: PackedBatch, cfg, generator: torch.Generator | None):
        """Images of their own sizes -> their global and local crops, each at its own aspect ratio within the
        patch budget of a square crop, packed into sequences as long as the batch's, and the hidden patches."""
        mean, std = (torch.tensor(v, device=images.patches.device) for v in (cfg.mean, cfg.std))
        p, prefix, slots = self.model.patch_size, self.model.num_prefix_tokens, images.patches.shape[1]
        glob, local = self.multicrop.native(images.images(), mean, std, p, generator)
        glob = pack(glob, p, slots, prefix)
        local = pack(local, p, slots, prefix) if local else None
        return glob, local, self.model.packed_masks(glob, generator)

    def preprocessing(self):
        """How the images were normalised: the data module's, or (outside a trainer) the preset's."""
        from vitkit.data.transforms import data_config

        return self.data_cfg() or data_config(self.hparams.model_name, self.global_size)

    def forward(self, images: Tensor | PackedBatch, generator: torch.Generator | None = None):
        glob, local, mask = self._crops(images, generator)
        if isinstance(glob, PackedBatch):
            return self.model.forward_packed(glob, self.multicrop.global_crops, local, mask,
                                             teacher_temp=self.teacher_temp())
        return self.model(glob, local, mask, teacher_temp=self.teacher_temp())

    def step_loss(self, batch) -> Tensor:
        out = self(batch[0])
        if self.global_step % max(1, self.trainer.log_every_n_steps) == 0:
            self.log_dict({"train/dino": out.dino, "train/ibot": out.ibot, "train/koleo": out.koleo,
                           "train/teacher_temp": self.teacher_temp(), "train/teacher_momentum":
                           self.teacher_momentum()}, on_step=True, on_epoch=False, batch_size=len(batch[0]))
        return out.loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        super().on_before_optimizer_step(optimizer)
        done = self.epochs_done()
        frozen = []
        if done < self.hparams.freeze_last_layer_epochs:  # DINO: the prototypes wait while the rest settles
            frozen += [m.last_layer for m in (self.model.student_head, self.model.student_ibot_head) if m is not None]
        if done < self.hparams.head_warmup_epochs:  # the backbone waits while the new heads warm up
            frozen.append(self.model.student)
        for m in frozen:
            for p in m.parameters():
                p.grad = None  # AdamW leaves a parameter without a gradient as it is, weight decay included
        if done < self.hparams.head_warmup_epochs:
            self.model.mask_token.grad = None

    def after_optimizer_step(self) -> None:
        super().after_optimizer_step()
        self.model.update_teacher(self.teacher_momentum())  # the teacher follows every step the student takes

    def validation_step(self, batch, batch_idx: int) -> None:
        images = batch[0]
        if len(images) == 0:
            return
        g = torch.Generator().manual_seed(10_007 * batch_idx + 1)  # the same crops every epoch: losses compare
        self.log("val/loss", self(images, g).loss, prog_bar=True, sync_dist=True, batch_size=len(images))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        hp = checkpoint.get("hyper_parameters")
        if hp is not None:  # the preset a tag named, with every field the weights gave it: rebuilt without them
            record_config(self.model.student, hp)
            hp["model_name"] = self.model.student.name

    # -- the k-NN monitor --------------------------------------------------------------------------------------

    def on_validation_epoch_end(self) -> None:
        if self.hparams.knn_root is None or self.trainer.sanity_checking:
            return
        self.log("val/knn_top1", self.knn_score(), prog_bar=True, rank_zero_only=True)

    def knn_score(self, net: torch.nn.Module | None = None) -> float:
        """The weighted k-NN top-1 of ``net``'s features (the teacher's by default) on ``knn_root``: its train/
        images vote for the classes of its val/ ones, both read as the model's validation reads its images."""
        from vitkit.evaluation.metrics import knn_top1

        train, val = self._knn_sets()
        net = self.model.backbone() if net is None else net
        feats = [self._features(net, ds) for ds in (train, val)]
        return knn_top1(feats[0][0], feats[0][1], feats[1][0], feats[1][1], k=self.hparams.knn_k)

    def _knn_sets(self):
        if self.hparams.knn_root is None:
            raise UsageError("knn_score needs knn_root, a folder with train/<class>/* and val/<class>/*")
        if self._knn is None:
            from vitkit.data.folder import SkippingImageFolder
            from vitkit.data.transforms import eval_transform

            root = Path(os.path.expanduser(self.hparams.knn_root))
            tf = eval_transform(self.preprocessing())
            self._knn = tuple(SkippingImageFolder(str(root / s), tf) for s in ("train", "val"))
        return self._knn

    def _features(self, net: torch.nn.Module, ds) -> tuple[Tensor, Tensor]:
        from vitkit.data.folder import collate_skipping
        from vitkit.evaluation.predict import pooled_features

        batches = ((x, y) for x, y, _ in DataLoader(ds, batch_size=64, collate_fn=collate_skipping))
        return pooled_features(net, batches, self.device)
