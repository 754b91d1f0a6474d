"""The probe-first head for small segmentation sets (``head_init="probe"``, the ``seg_finetune_small_data`` recipe):
before the first step, the linear head is fitted on the frozen backbone's patch features of every training image
(evaluation transform, computed once), a multinomial logistic regression per patch whose target is the share of
each class among the patch's labelled pixels. The features are standardised, and the standardisation becomes the
head's BatchNorm statistics, so the fitted head is the module's own linear head. Its validation mIoU (the model's
full path: head, upsampling, argmax per pixel) is the baseline the run logs (``val/probe_baseline``) and must beat;
the model with that head is saved as ``probe.ckpt``."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

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


def fit_soft_logistic(x: Tensor, target: Tensor, max_iter: int = 200) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A multinomial logistic regression on standardised ``x`` against soft targets (rows summing to 1), L2 as
    scikit-learn's at C=1 (the penalty over the sample count), by L-BFGS in float64: (weight (K, C), bias (K,), mean
    (C,), std (C,)) with logits ``((x - mean) / std) @ weight.T + bias``."""
    x, target = x.double(), target.double()
    mean, std = x.mean(0), x.std(0, correction=0).clamp_min(1e-6)  # scikit-learn's StandardScaler
    z = (x - mean) / std
    weight = torch.zeros(target.shape[1], x.shape[1], dtype=torch.float64, requires_grad=True)
    bias = torch.log(target.mean(0).clamp_min(1e-6)).requires_grad_(True)  # the class frequencies at the start
    opt = torch.optim.LBFGS([weight, bias], max_iter=max_iter, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-9, tolerance_change=1e-12, history_size=20)
    penalty = 0.5 / len(x)

    def closure() -> Tensor:
        opt.zero_grad()
        loss = -(target * F.log_softmax(z @ weight.T + bias, dim=1)).sum(1).mean() + penalty * weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return weight.detach(), bias.detach(), mean, std


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
        raise ValueError(f"head_init 'probe' fits a linear head on frozen patch features; the model's head is "
                         f"{type(model.decode_head).__name__} (give --model.head linear)")
    was_training = model.training
    model.eval()
    x, target = patch_features(model, batches, num_classes, ignore_index, device)
    model.train(was_training)
    if not len(x):
        raise ValueError("head_init 'probe': the training masks hold no labelled pixel (every one is ignore_index)")
    if len(x) > MAX_PATCHES:
        keep = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))[:MAX_PATCHES]
        x, target = x[keep], target[keep]
    set_linear_head(model.decode_head, *fit_soft_logistic(x, target))
    return len(x)
