"""Self-distillation with no labels on an unmodified ViT: DINO (Caron et al., 2021) with DINOv2's additions
(Oquab et al., 2024): iBOT's masked-patch loss (Zhou et al., 2022), the KoLeo regulariser (Sablayrolles et al.,
2019) and Sinkhorn-Knopp centering (SwAV, Caron et al., 2020).

A student and a teacher share the architecture; the teacher is the student's exponential moving average and is
never trained by gradients. Both see the global crops; the student also sees the local crops, and (iBOT) a share of
its global crops with patches replaced by a learned mask token. Each token the losses read goes through a
:class:`DINOHead` (an MLP, then weight-normalised prototypes): the student's softmax over the prototypes is trained
towards the teacher's, centered and sharpened. The backbone that comes out is the teacher's ViT, with the preset's
parameter names, loaded by ``vitkit.create_model`` or timm as any backbone is.

Shape legend: B images; V views of each (global crops G, then local crops); N patches; C width; K prototypes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.parametrizations import weight_norm

from vitkit.errors import UsageError

from .encoders import vision_encoder
from .packing import PackedBatch, class_tokens
from .vit import VisionTransformer


def _all_reduce(x: Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> Tensor:
    """Summed (or reduced by ``op``) over the processes of a distributed run, in place; as it is in one process."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(x, op=op)
    return x


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class DINOHead(nn.Module):
    """DINO's projection head: an MLP (GELU, ``layers`` linears, the last to ``bottleneck_dim``), an L2
    normalisation, and ``out_dim`` weight-normalised prototypes. With ``norm_last_layer`` the prototypes' norms
    stay 1 (DINO's default, steadier), otherwise they are learned."""

    def __init__(self, in_dim: int, out_dim: int = 65536, hidden_dim: int = 2048, bottleneck_dim: int = 256,
                 layers: int = 3, norm_last_layer: bool = True) -> None:
        super().__init__()
        if layers < 1:
            raise UsageError(f"a DINO head has at least one layer, got layers={layers}")
        dims = [in_dim] + [hidden_dim] * (layers - 1) + [bottleneck_dim]
        mlp: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            mlp += [nn.Linear(a, b)] + ([nn.GELU()] if i < layers - 1 else [])
        self.mlp = nn.Sequential(*mlp)
        for m in self.mlp:
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
        self.last_layer = weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        with torch.no_grad():
            self.last_layer.parametrizations.weight.original0.fill_(1)  # each prototype's norm
        self.last_layer.parametrizations.weight.original0.requires_grad = not norm_last_layer

    def forward(self, x: Tensor) -> Tensor:
        """(..., in_dim) -> (..., out_dim) logits: the prototypes' dot products with the normalised bottleneck."""
        return self.last_layer(F.normalize(self.mlp(x), dim=-1))


class Center(nn.Module):
    """A running mean of the teacher's logits (over batch, views and processes), subtracted before its softmax:
    DINO's centering, which keeps one prototype from taking every image."""

    def __init__(self, dim: int, momentum: float = 0.9) -> None:
        super().__init__()
        self.momentum = momentum
        self.register_buffer("center", torch.zeros(1, dim))

    @torch.no_grad()
    def update(self, logits: Tensor) -> None:
        """Move the center towards the mean of ``logits`` (..., K) over every process."""
        mean = _all_reduce(logits.detach().float().reshape(-1, logits.shape[-1]).mean(0, keepdim=True)) / _world()
        self.center.mul_(self.momentum).add_(mean, alpha=1 - self.momentum)


@torch.no_grad()
def sinkhorn_knopp(logits: Tensor, temp: float, iterations: int = 3) -> Tensor:
    """Teacher probabilities (M, K) whose prototypes are used equally over the batch of every process: the
    softmax's ``exp(logits / temp)``, scaled alternately so that each prototype's column sums to M/K and each row
    to 1 (SwAV's and DINOv2's centering). M counts the rows of every process."""
    logits = logits.float()
    top = _all_reduce(logits.max() if logits.numel() else logits.new_tensor(-torch.inf), dist.ReduceOp.MAX)
    q = torch.exp((logits - top) / temp).t()  # (K, M); one shift for every process cancels below
    K, M = q.shape[0], q.shape[1] * _world()
    q /= _all_reduce(q.sum())
    for _ in range(iterations):
        q /= _all_reduce(q.sum(dim=1, keepdim=True)) * K  # every prototype: 1/K of the mass
        q /= q.sum(dim=0, keepdim=True) * M  # every row: 1/M
    return (q * M).t()


class TeacherTargets(nn.Module):
    """What the student is trained towards: the teacher's logits centered (``"mean"``: minus a running mean,
    updated after each loss) or balanced by Sinkhorn-Knopp (``"sinkhorn"``), then sharpened by the teacher's
    temperature; and the student's temperature."""

    def __init__(self, out_dim: int, student_temp: float = 0.1, center_momentum: float = 0.9,
                 centering: Literal["mean", "sinkhorn"] = "mean") -> None:
        super().__init__()
        if centering not in ("mean", "sinkhorn"):
            raise UsageError(f"centering must be 'mean' or 'sinkhorn', got {centering!r}")
        self.student_temp, self.centering = student_temp, centering
        self.center = Center(out_dim, center_momentum)

    def teacher_probs(self, teacher: Tensor, teacher_temp: float) -> Tensor:
        """(..., K) teacher logits -> probabilities."""
        if self.centering == "sinkhorn":
            return sinkhorn_knopp(teacher.reshape(-1, teacher.shape[-1]), teacher_temp).view(teacher.shape)
        return F.softmax((teacher.float() - self.center.center) / teacher_temp, dim=-1)

    def student_log_probs(self, student: Tensor) -> Tensor:
        return F.log_softmax(student.float() / self.student_temp, dim=-1)

    def update(self, teacher: Tensor) -> None:
        """Move the running center (in training mode only: a validation loss leaves it as it is)."""
        if self.centering == "mean" and self.training:
            self.center.update(teacher)


class DINOLoss(TeacherTargets):
    """DINO's cross-entropy between the teacher's softmax on each global view and the student's on every other
    view of the same image, averaged over the pairs and the batch."""

    def forward(self, teacher: list[Tensor], student: list[Tensor], teacher_temp: float) -> Tensor:
        """``teacher``: G tensors (B, K), one per global view; ``student``: V >= G tensors (B, K), the same global
        views first, then the local ones. A view is never compared with itself."""
        if len(student) < len(teacher) or len(student) < 2:
            raise UsageError(f"DINOLoss needs the teacher's global views among the student's and two views at "
                             f"least, got {len(teacher)} teacher and {len(student)} student views")
        t = self.teacher_probs(torch.stack(teacher), teacher_temp)  # (G, B, K)
        s = self.student_log_probs(torch.stack(student))  # (V, B, K)
        G, V, B = t.shape[0], s.shape[0], t.shape[1]
        cross = -torch.einsum("gbk,vbk->gv", t, s)  # summed over the batch
        cross = cross.masked_fill(torch.eye(G, V, dtype=torch.bool, device=cross.device), 0)  # not with itself
        loss = cross.sum() / ((G * V - G) * B)
        self.update(torch.stack(teacher))
        return loss


class IBOTPatchLoss(TeacherTargets):
    """iBOT's masked-patch loss: at each patch hidden from the student, the cross-entropy between the teacher's
    softmax (which saw the patch) and the student's; each image's masked patches weigh 1 together, averaged over
    the images. Its center is its own."""

    def forward(self, teacher: Tensor, student: Tensor, mask: Tensor, teacher_temp: float) -> Tensor:
        """``teacher``, ``student``: (M, K) logits at the masked patches, in the order of ``mask.nonzero()``;
        ``mask``: (B, N) (or (B, h, w)) bool, True where the student saw the mask token."""
        mask = mask.flatten(1)
        if teacher.shape != student.shape:
            raise UsageError(f"iBOT takes teacher and student logits at the same masked patches, got "
                             f"{tuple(teacher.shape)} and {tuple(student.shape)}")
        ce = -(self.teacher_probs(teacher, teacher_temp) * self.student_log_probs(student)).sum(-1)  # (M,)
        weight = (1 / mask.sum(1, keepdim=True).clamp(min=1)).expand_as(mask)[mask]
        loss = (ce * weight).sum() / mask.shape[0]
        self.update(teacher)
        return loss


def koleo_loss(x: Tensor, eps: float = 1e-8) -> Tensor:
    """KoLeo: minus the mean log distance from each L2-normalised row of ``x`` (B, C) to its nearest other row,
    which spreads a batch's features over the sphere (DINOv2 applies it to the student's class tokens)."""
    x = F.normalize(x.float(), dim=-1, eps=eps)
    sim = x @ x.t()
    sim.fill_diagonal_(-2)  # below any cosine: never one's own neighbour
    nearest = x[sim.argmax(dim=1)]
    return -torch.log(F.pairwise_distance(x, nearest, eps=eps) + eps).mean()


@dataclass
class DINOConfig:
    """A DINO: the ViT preset it trains, its heads, the losses' temperatures and weights, and iBOT's masking.
    The defaults are DINOv2's (65,536 prototypes, a 3-layer head of width 2,048 to a 256-wide bottleneck, iBOT on
    half the global crops with 10 to 50 % of their patches hidden, KoLeo at 0.1)."""

    encoder: str = "vit_small_patch16_224"
    encoder_overrides: dict[str, Any] = field(default_factory=dict)
    out_dim: int = 65536
    hidden_dim: int = 2048
    bottleneck_dim: int = 256
    head_layers: int = 3
    norm_last_layer: bool = True
    ibot_out_dim: int | None = None  # None: iBOT reads the DINO head (DINOv2's default); else a head of its own
    student_temp: float = 0.1
    center_momentum: float = 0.9
    centering: Literal["mean", "sinkhorn"] = "mean"
    dino_weight: float = 1.0
    ibot_weight: float = 1.0  # 0: no masked-patch loss
    koleo_weight: float = 0.1  # 0: no KoLeo
    mask_ratio: tuple[float, float] = (0.1, 0.5)  # of a masked crop's patches, drawn uniformly per image
    mask_probability: float = 0.5  # the share of global crops that are masked

    def __post_init__(self) -> None:
        for name in ("out_dim", "hidden_dim", "bottleneck_dim", "head_layers"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.student_temp <= 0:
            raise UsageError(f"student_temp must be > 0, got {self.student_temp}")
        lo, hi = self.mask_ratio
        if not 0 <= lo <= hi < 1:
            raise UsageError(f"mask_ratio must be (low, high) with 0 <= low <= high < 1, got {self.mask_ratio}")
        if not 0 <= self.mask_probability <= 1:
            raise UsageError(f"mask_probability must be in [0, 1], got {self.mask_probability}")
        if self.centering not in ("mean", "sinkhorn"):
            raise UsageError(f"centering must be 'mean' or 'sinkhorn', got {self.centering!r}")


@dataclass
class DINOOutput:
    """The weighted total and each loss (detached parts for logging; 0 where a loss is off)."""

    loss: Tensor
    dino: Tensor
    ibot: Tensor
    koleo: Tensor


class DINO(nn.Module):
    """A student ViT with its heads, trained by gradients, and its teacher (the same, as a moving average:
    :meth:`update_teacher`), which sees no gradient and stays in eval mode (no drop path)."""

    def __init__(self, cfg: DINOConfig, encoder: nn.Module | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        if encoder is None:
            encoder = vision_encoder(cfg.encoder, **{"dynamic_img_size": True, **cfg.encoder_overrides})
        if not isinstance(encoder, VisionTransformer) or not encoder.cfg.class_token:
            raise UsageError(f"DINO trains a ViT with a class token, got {type(encoder).__name__}"
                             + (" without one" if isinstance(encoder, VisionTransformer) else ""))
        if encoder.merging:
            raise UsageError("DINO reads every patch token (iBOT): turn token merging off (token_merging=0)")
        encoder.set_dynamic_img_size(True)  # global and local crops differ in size: positions follow each input
        C = encoder.num_features
        head = dict(hidden_dim=cfg.hidden_dim, bottleneck_dim=cfg.bottleneck_dim, layers=cfg.head_layers,
                    norm_last_layer=cfg.norm_last_layer)
        self.student, self.student_head = encoder, DINOHead(C, cfg.out_dim, **head)
        self.student_ibot_head = DINOHead(C, cfg.ibot_out_dim, **head) if cfg.ibot_out_dim else None
        self.mask_token = nn.Parameter(torch.zeros(1, 1, C))
        self.teacher = copy.deepcopy(self.student)
        self.teacher_head = copy.deepcopy(self.student_head)
        self.teacher_ibot_head = copy.deepcopy(self.student_ibot_head)
        for p in self.teacher_parameters():
            p.requires_grad = False
        losses = dict(student_temp=cfg.student_temp, center_momentum=cfg.center_momentum, centering=cfg.centering)
        self.dino_loss = DINOLoss(cfg.out_dim, **losses)
        self.ibot_loss = IBOTPatchLoss(cfg.ibot_out_dim or cfg.out_dim, **losses)
        self.train()

    def train(self, mode: bool = True) -> DINO:
        super().train(mode)
        for m in (self.teacher, self.teacher_head, self.teacher_ibot_head):
            if m is not None:
                m.eval()
        return self

    def student_modules(self) -> list[nn.Module]:
        return [m for m in (self.student, self.student_head, self.student_ibot_head) if m is not None]

    def teacher_parameters(self) -> list[nn.Parameter]:
        return [p for m in (self.teacher, self.teacher_head, self.teacher_ibot_head) if m is not None
                for p in m.parameters()]

    @torch.no_grad()
    def update_teacher(self, momentum: float) -> None:
        """teacher = momentum * teacher + (1 - momentum) * student, parameter by parameter."""
        student = [p for m in self.student_modules() for p in m.parameters()]
        for t, s in zip(self.teacher_parameters(), student, strict=True):
            t.lerp_(s.detach().to(t.dtype), 1 - momentum)

    def random_masks(self, views: int, batch: int, grid: tuple[int, int], device: torch.device | None = None,
                     generator: torch.Generator | None = None) -> Tensor:
        """(views, batch, N) bool, True: hidden from the student. ``mask_probability`` of the crops are masked,
        each with a ratio drawn uniformly in ``mask_ratio``; the others are not."""
        n = grid[0] * grid[1]
        lo, hi = self.cfg.mask_ratio
        masked = torch.rand(views, batch, 1, generator=generator) < self.cfg.mask_probability
        ratio = lo + (hi - lo) * torch.rand(views, batch, 1, generator=generator)
        rank = torch.rand(views, batch, n, generator=generator).argsort(-1).argsort(-1)  # a random order per crop
        return (masked & (rank < (ratio * n).round())).to(device)

    def packed_masks(self, crops: PackedBatch, generator: torch.Generator | None = None) -> Tensor:
        """:meth:`random_masks` for packed crops of their own sizes: (S, L) bool over ``crops``' slots, True where
        a patch is hidden from the student; each crop masked as :meth:`random_masks` masks one of its grid."""
        hidden = torch.zeros(crops.image.shape, dtype=torch.bool)
        image, index = crops.image.cpu(), crops.index.cpu()
        for i, (rows, cols) in enumerate(crops.grids):
            drawn = self.random_masks(1, 1, (rows, cols), None, generator)[0, 0]  # (rows·cols,)
            slots = (image == i) & (index >= crops.prefix)
            hidden[slots] = drawn[index[slots] - crops.prefix]
        return hidden.to(crops.image.device)

    @property
    def patch_size(self) -> int:
        return self.student.patch_size

    @property
    def num_prefix_tokens(self) -> int:
        return self.student.num_prefix_tokens

    def token_drop_refusal(self, drop: float) -> str:
        """Why packed batches for DINO take every patch (the data module's ``--data.token_drop`` says so)."""
        return (f"--data.packing with DINO: --data.token_drop {drop:g} would blank patches of the images DINO crops "
                "its views from (iBOT hides its own); leave it at 0")

    def _tokens(self, net: VisionTransformer, images: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Images (M, c, H, W), with the patches of ``mask`` (M, N) replaced by the mask token -> the class tokens
        (M, C) and the patch tokens (M, N, C), normed."""
        patches, grid = net.embed_patches(images)
        if mask is not None:
            patches = torch.where(mask[..., None], self.mask_token.to(patches.dtype), patches)
        tokens, rope = net.embed_tokens(patches, grid)
        x = net.forward_blocks(tokens, rope)
        return x[:, 0], x[:, net.num_prefix_tokens:]

    def forward(self, global_crops: Tensor, local_crops: Tensor | None = None, mask: Tensor | None = None,
                teacher_temp: float = 0.07) -> DINOOutput:
        """``global_crops`` (G, B, c, H, W); ``local_crops`` (L, B, c, h, w) or None; ``mask`` (G, B, N) bool or
        None (iBOT off). The teacher sees the global crops whole, the student every crop and the masked ones
        masked."""
        G, B = global_crops.shape[:2]
        cfg = self.cfg
        with torch.no_grad():
            t_cls, t_patch = self._tokens(self.teacher, global_crops.flatten(0, 1))
            t_logits = self.teacher_head(t_cls).view(G, B, -1)
        flat_mask = None if mask is None or cfg.ibot_weight == 0 else mask.flatten(0, 1)
        s_cls, s_patch = self._tokens(self.student, global_crops.flatten(0, 1), flat_mask)
        s_logits = [self.student_head(s_cls).view(G, B, -1)]
        if local_crops is not None and local_crops.shape[0]:
            l_cls, _ = self._tokens(self.student, local_crops.flatten(0, 1))
            s_logits.append(self.student_head(l_cls).view(local_crops.shape[0], B, -1))
        t_masked = s_masked = None
        if flat_mask is not None:
            t_masked, s_masked = t_patch[flat_mask], s_patch[flat_mask]
        return self._losses(t_logits, torch.cat(s_logits), s_cls.view(G, B, -1), t_masked, s_masked, flat_mask,
                            teacher_temp)

    def _losses(self, t_logits: Tensor, s_logits: Tensor, s_cls: Tensor, t_masked: Tensor | None,
                s_masked: Tensor | None, mask: Tensor | None, teacher_temp: float) -> DINOOutput:
        """The losses from the teacher's logits (G, B, K), the student's (V, B, K), its global class tokens
        (G, B, C), and both models' patch tokens at the masked patches (in the order of ``mask.nonzero()``,
        ``mask`` (G·B, N); None: iBOT off)."""
        cfg = self.cfg
        dino = self.dino_loss(list(t_logits), list(s_logits), teacher_temp)
        zero = dino.new_zeros(())
        ibot = zero
        if mask is not None:
            s_head, t_head = (self.student_ibot_head, self.teacher_ibot_head) if self.student_ibot_head is not None \
                else (self.student_head, self.teacher_head)
            with torch.no_grad():
                t_logits_masked = t_head(t_masked)
            ibot = self.ibot_loss(t_logits_masked, s_head(s_masked), mask, teacher_temp)
        koleo = sum(koleo_loss(c) for c in s_cls) if cfg.koleo_weight else zero
        loss = cfg.dino_weight * dino + cfg.ibot_weight * ibot + cfg.koleo_weight * koleo
        return DINOOutput(loss, dino.detach(), ibot.detach(), koleo.detach())

    def _packed_tokens(self, net: VisionTransformer, batch: PackedBatch,
                       mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Packed crops, the patches of ``mask`` ((S, L) bool) replaced by the mask token -> the class tokens
        (crops, C), in the order packed, and every slot's normed token (S, L, C)."""
        x = net.packed_tokens(batch, mask, self.mask_token)
        return class_tokens(x, batch), x

    def forward_packed(self, global_crops: PackedBatch, views: int, local_crops: PackedBatch | None = None,
                       mask: Tensor | None = None, teacher_temp: float = 0.07) -> DINOOutput:
        """:meth:`forward` of crops of their own sizes, packed: ``global_crops`` holds ``views`` crops of each of B
        images (view by view: crop ``v·B + b``), ``local_crops`` its local views alike; ``mask`` ((S, L) bool over
        the global crops' slots) the patches hidden from the student. Crop by crop, the losses of :meth:`forward`
        on the same crops."""
        G, B = views, len(global_crops) // views
        with torch.no_grad():
            t_cls, t_patch = self._packed_tokens(self.teacher, global_crops)
            t_logits = self.teacher_head(t_cls).view(G, B, -1)
        mask = None if mask is None or self.cfg.ibot_weight == 0 else mask & (global_crops.index >= global_crops.prefix)
        s_cls, s_patch = self._packed_tokens(self.student, global_crops, mask)
        s_logits = [self.student_head(s_cls).view(G, B, -1)]
        if local_crops is not None:
            l_cls, _ = self._packed_tokens(self.student, local_crops)
            s_logits.append(self.student_head(l_cls).view(len(local_crops) // B, B, -1))
        t_masked = s_masked = per_crop = None
        if mask is not None:  # the masked slots crop by crop, each crop's in its own order (as mask.nonzero())
            table = global_crops.slot_table()  # (crops, tokens): each token's slot
            per_crop = torch.zeros_like(table, dtype=torch.bool)
            per_crop[table >= 0] = mask.flatten()[table[table >= 0]]
            slot = table[per_crop]
            t_masked, s_masked = t_patch.flatten(0, 1)[slot], s_patch.flatten(0, 1)[slot]
        return self._losses(t_logits, torch.cat(s_logits), s_cls.view(G, B, -1), t_masked, s_masked, per_crop,
                            teacher_temp)

    def backbone(self) -> VisionTransformer:
        """The teacher's ViT: the features DINO hands back (the preset's names, no classifier)."""
        return self.teacher
