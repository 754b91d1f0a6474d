"""Small labelled sets (about 10 to 500 images per class) on a pretrained backbone.

Fine-tuning from a random head distorts the pretrained features before the head has learned anything (LP-FT,
Kumar et al., 2022). So ``head_init="probe"`` fits the head first, on the frozen backbone's pooled features of the
training images (eval transform, computed once): the logistic regression of ``vitkit evaluate --linear-probe``
(standardised features, L-BFGS, L2 at C=1), whose standardisation folds into the linear head. Its top-1 on the
validation split is the baseline the run must beat (``val/probe_baseline``); the model with that head is saved as
``probe.ckpt``, a classifier checkpoint like any other, and the run's best checkpoint is never worse than it.

``vitkit.training.steps.StepsPerEpoch`` keeps an epoch from being two optimizer steps on such a set.
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torch.nn import functional as F

from vitkit.data.transforms import eval_transform
from vitkit.errors import UsageError
from vitkit.evaluation.predict import pooled_features as backbone_features
from vitkit.evaluation.probe import fit_linear_probe, fit_multilabel_probe


def eval_views(dm: L.LightningDataModule):
    """The training and validation splits of ``dm``, both in the eval transform (the images as they are)."""
    if not hasattr(dm, "train_set"):
        dm.setup("fit")
    train = getattr(dm, "train_set", None)
    if train is None or not hasattr(train, "__len__") or not hasattr(dm, "data_cfg"):
        raise UsageError(f"head_init 'probe' fits the head on the features of every training image, which needs an "
                         f"image data module with a map-style training split; {type(dm).__name__} has none")
    if not hasattr(train, "with_transform"):
        raise UsageError(f"head_init 'probe': the training split of {type(dm).__name__} cannot be read in the eval "
                         "transform; give an ImageFolderDataModule or an HFDataModule")
    view = dm.eval_transform() if hasattr(dm, "eval_transform") else eval_transform(dm.data_cfg)  # packed or not
    return train.with_transform(view), dm.val_set


@torch.no_grad()
def pooled_features(model: nn.Module, dm: L.LightningDataModule, ds, device: torch.device) -> tuple[Tensor, Tensor]:
    """The model's pooled features (before the head) and the labels of every readable image of ``ds``."""
    batches = (dm.on_after_batch_transfer(batch, 0)[:2] for batch in dm.loader(ds, False))
    return backbone_features(model, batches, device)


def fit_head(model: nn.Module, dm: L.LightningDataModule, device: torch.device, multi_label: bool = False) -> float:
    """Fit ``model``'s linear head on the frozen features of ``dm``'s training images; returns its validation top-1,
    or with ``multi_label`` its mAP (one regression per class; class indices become one-hot rows), the measure the
    run validates by."""
    head = model.get_classifier()
    if not isinstance(head, nn.Linear) or getattr(model, "head_dist", None) is not None:
        raise UsageError("head_init 'probe' takes a model with one linear head")
    train_view, val = eval_views(dm)
    train, train_y = pooled_features(model, dm, train_view, device)
    val_x, val_y = pooled_features(model, dm, val, device)
    if multi_label or train_y.ndim == 2:  # one regression per class, scored by mAP
        n = head.out_features
        train_y, val_y = (y if y.ndim == 2 else F.one_hot(y, n).float() for y in (train_y, val_y))
        weight, bias, top1 = fit_multilabel_probe(train, train_y, val_x, val_y)
    else:
        weight, bias, top1 = fit_linear_probe(train, train_y, val_x, val_y, head.out_features)
    with torch.no_grad():
        head.weight.copy_(weight.to(head.weight))
        head.bias.copy_(bias.to(head.bias))
    return top1


def suggest_small_data_recipe(module: L.LightningModule, dm: L.LightningDataModule | None) -> None:
    """One line, where pretrained weights meet a small labelled set, naming the recipe made for it."""
    hp = module.hparams
    train, classes = getattr(dm, "train_set", None), getattr(dm, "num_classes", None)
    if not (hp.get("pretrained") or hp.get("checkpoint")) or not classes or not hasattr(train, "__len__"):
        return
    per_class = len(train) / classes
    if per_class < SMALL_PER_CLASS:
        flags = ""  # what the recipe (a folder of one label per image) needs to read this run's data as it is
        if type(dm).__name__ != "ImageFolderDataModule":
            cls = type(dm)  # vitkit's data modules by the name recipes give them (vitkit.lit.X)
            path = f"vitkit.lit.{cls.__name__}" if cls.__module__.startswith("vitkit.data.modules") else \
                f"{cls.__module__}.{cls.__name__}"
            flags += f" --data {path} (and its --data.*)"
        if getattr(module, "multi_label", False):
            flags += " --model.labels MultiLabel"
        rank_zero_info(f"note: {len(train)} training images, about {per_class:.0f} per class: on a set this small, "
                       f"`vitkit train fit -c finetune_small_data{flags}` fits the head on the frozen features first "
                       "and ends no lower than that probe")


SMALL_PER_CLASS = 500  # the upper end of what finetune_small_data is made for
