"""The probe-first head for small segmentation sets (``head_init="probe"``, the ``seg_finetune_small_data`` recipe):
before the first step, the linear head is fitted on the frozen backbone's patch features of every training image
(evaluation transform, computed once), a multinomial logistic regression per patch whose target is the share of each
class among the patch's labelled pixels (``vitkit.evaluation.probe``, the solver every probe uses). The features are
standardised, and the standardisation becomes the head's BatchNorm statistics, so the fitted head is the module's own
linear head. Its validation mIoU (the model's full path: head, upsampling, argmax per pixel) is the baseline the run
logs (``val/probe_baseline``) and must beat; the model with that head is saved as ``probe.ckpt``."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from vitkit.errors import UsageError
from vitkit.evaluation.probe import fit_logistic
from vitkit.models.segmentation import LinearHead, SegmentationModel, resize

MAX_PATCHES = 200_000  # a random subset above this: the regression's cost, not its quality, grows past it


@torch.no_grad()
def patch_features(model: SegmentationModel, batches, num_classes: int, ignore_index: int,
                   device: torch.device) -> tuple[Tensor, Tensor]:
    """Every labelled patch's features (P, C) as the linear head sees them, and its class shares (P, K): the
    one-hot mask, ignored pixels out, averaged over the patch's pixels and normalised."""
    feats, shares = [], []
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        maps = model.features(x)
        f = torch.cat([resize(m, maps[0].shape[-2:]) for m in maps], dim=1).float()  # as LinearHead concatenates
        valid = (y != ignore_index).unsqueeze(1)
        onehot = F.one_hot(torch.where(valid[:, 0], y, 0), num_classes).permute(0, 3, 1, 2) * valid
        share = F.adaptive_avg_pool2d(onehot.float(), f.shape[-2:])
        labelled = share.sum(1) > 0
        feats.append(f.permute(0, 2, 3, 1)[labelled].cpu())
        shares.append((share.permute(0, 2, 3, 1)[labelled] / share.sum(1)[labelled].unsqueeze(-1)).cpu())
    return torch.cat(feats), torch.cat(shares)


@torch.no_grad()
def set_linear_head(head: LinearHead, weight: Tensor, bias: Tensor, mean: Tensor, std: Tensor) -> None:
    """The fitted regression as ``head``: the standardisation in its BatchNorm (running statistics, no affine
    change), the weights in its 1x1 conv."""
    bn = head.bn
    bn.running_mean.copy_(mean.to(bn.running_mean))
    bn.running_var.copy_((std.pow(2) - bn.eps).clamp_min(0).to(bn.running_var))
    if bn.affine:
        bn.weight.fill_(1.0)
        bn.bias.zero_()
    head.conv_seg.weight.copy_(weight[:, :, None, None].to(head.conv_seg.weight))
    head.conv_seg.bias.copy_(bias.to(head.conv_seg.bias))


def fit_probe_head(model: SegmentationModel, batches, num_classes: int, ignore_index: int,
                   device: torch.device, seed: int = 0) -> int:
    """Fit ``model``'s linear head on the frozen features of ``batches`` (image, mask); returns the patches used."""
    if not isinstance(model.decode_head, LinearHead):
        raise UsageError(f"head_init 'probe' fits a linear head on frozen patch features; the model's head is "
                         f"{type(model.decode_head).__name__} (give --model.head linear)")
    was_training = model.training
    model.eval()
    x, target = patch_features(model, batches, num_classes, ignore_index, device)
    model.train(was_training)
    if not len(x):
        raise UsageError("head_init 'probe': the training masks hold no labelled pixel (every one is ignore_index)")
    if len(x) > MAX_PATCHES:
        keep = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))[:MAX_PATCHES]
        x, target = x[keep], target[keep]
    probe = fit_logistic(x, target)
    set_linear_head(model.decode_head, probe.weight, probe.bias, probe.mean, probe.std)
    return len(x)
