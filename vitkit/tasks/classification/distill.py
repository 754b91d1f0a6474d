"""Knowledge distillation for ``ImageClassifier``: a frozen teacher and the losses that learn from it.

The teacher is any model vitkit or timm builds: a vitkit preset or timm tag (pretrained from the hub cache,
offline-first), any weights file or folder vitkit reads (a vitkit or Lightning checkpoint included), or any timm
model by name, CNNs too (DeiT's ``regnety_160.deit_in1k``), with ``teacher_checkpoint`` for the weights of a named
architecture. It is frozen, in eval mode, never in the optimizer, the state dict or the checkpoint (which records
what the teacher was, so a resumed run builds it again), and it is replicated on every rank, never sharded. It sees
the student's batch, the same mixed images, re-normalised to its own mean and std and resized to its own input size
on the device (a CLIP teacher, a 384 px teacher).

Losses (``distillation``), as DeiT (Touvron et al., 2021) and Hinton et al. (2015):
    hard  the class head learns from the labels, the distillation head (DeiT's second token; the one head of a
          student without it) from the teacher's argmax: (1 - alpha) x label loss + alpha x CE(teacher argmax)
    soft  (1 - alpha) x label loss + alpha x tau^2 x KL(teacher / tau || student / tau), batch mean
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import vitkit
from vitkit.checkpoints import CheckpointError, hub
from vitkit.checkpoints.files import WEIGHT_SUFFIXES, read_file
from vitkit.checkpoints.hub import MissingWeightsError
from vitkit.checkpoints.names import capabilities
from vitkit.errors import UsageError
from vitkit.training.base import loading_checkpoint

log = logging.getLogger(__name__)
Distillation = Literal["hard", "soft", "none"]


@dataclass
class Preprocessing:
    """How the teacher wants its input: its mean, std and (H, W)."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    size: tuple[int, int]
    interpolation: str = "bicubic"


def check_distillation(kind: str | None, teacher: str | None, alpha: float, tau: float) -> Distillation:
    """The distillation that runs: ``kind``, or ``hard`` (DeiT's) with a teacher and ``none`` without."""
    kind = kind or ("hard" if teacher else "none")
    if kind not in ("hard", "soft", "none"):
        raise UsageError(f"distillation must be 'hard', 'soft' or 'none', got {kind!r}")
    if kind != "none" and not teacher:
        raise UsageError(f"distillation={kind!r} learns from a teacher: give --model.teacher.name (a vitkit preset "
                         "or timm tag, a timm model name, or a checkpoint file)")
    if not 0 <= alpha <= 1 or tau <= 0:
        raise UsageError(f"distill_alpha must be in [0, 1] and distill_tau > 0, got {alpha} and {tau}")
    return kind


def build_teacher(teacher: str, checkpoint: str | None = None) -> tuple[nn.Module, Preprocessing]:
    """The frozen teacher and its preprocessing; one readable error for a teacher that cannot be built."""
    try:
        model, prep = _build(teacher, checkpoint)
    except (MissingWeightsError, CheckpointError):
        raise
    except (RuntimeError, ValueError, TypeError, KeyError, OSError) as e:
        raise UsageError(f"--model.teacher.name {teacher!r}"
                         + (f" with --model.teacher.checkpoint {checkpoint!r}" if checkpoint else "")
                         + f" cannot be built: {_gist(e)}") from None
    model.eval().requires_grad_(False)
    return model, prep


def _gist(e: Exception) -> str:
    """The first line of an error, and the one after it where the first only announces a list (torch's
    "Error(s) in loading state_dict for X:")."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()] or [repr(e)]
    gist = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
    return gist if len(gist) <= 300 else gist[:297] + "..."


def _build(teacher: str, checkpoint: str | None) -> tuple[nn.Module, Preprocessing]:
    path_like = os.path.exists(teacher) or os.sep in teacher or teacher.endswith(WEIGHT_SUFFIXES)
    if path_like and checkpoint is None:  # a file or folder of any format vitkit reads
        return _vitkit(vitkit.create_model(checkpoint=teacher))
    if _vitkit_knows(teacher):
        net = vitkit.create_model(teacher, pretrained=checkpoint is None, checkpoint=checkpoint)
        return _vitkit(net)
    import timm
    from timm.data import resolve_data_config

    if checkpoint is not None:
        net = _timm_from_file(teacher, Path(checkpoint))
    else:  # offline-first, as for vitkit's own tags: the hub cache, else a download, else the command that fetches
        weights = hub.resolve(teacher, any_architecture=True).fetch()
        net = timm.create_model(teacher, pretrained=True, pretrained_cfg_overlay={"file": str(weights)})
    cfg = resolve_data_config(model=net)
    return net, Preprocessing(tuple(cfg["mean"]), tuple(cfg["std"]), tuple(cfg["input_size"][1:]),
                              cfg.get("interpolation", "bicubic"))


def _timm_from_file(name: str, path: Path) -> nn.Module:
    """A timm model by name with the weights of a file vitkit reads (safely, as any checkpoint), its classifier as
    wide as the file's: a CNN fine-tuned on the user's classes teaches those classes."""
    import timm

    sd = read_file(path)
    for key in ("state_dict", "model", "module"):  # a training script's wrapper around the weights
        if isinstance(sd.get(key), dict):
            sd = sd[key]
    sd = {k.removeprefix("module."): v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    net = timm.create_model(name, pretrained=False)
    head = net.get_classifier()
    head_key = next((k for k, m in net.named_modules() if m is head), None) if isinstance(head, nn.Module) else None
    width = sd.get(f"{head_key}.weight") if head_key else None
    if width is not None and width.shape[0] != net.num_classes:
        net.reset_classifier(width.shape[0])
    net.load_state_dict(sd)
    return net


def _vitkit_knows(name: str) -> bool:
    try:
        return capabilities(name).images
    except (ValueError, KeyError):
        return False


def _vitkit(net: nn.Module) -> tuple[nn.Module, Preprocessing]:
    cfg = net.cfg
    size = cfg.img_size if isinstance(cfg.img_size, (tuple, list)) else (cfg.img_size, cfg.img_size)
    return net, Preprocessing(tuple(cfg.mean), tuple(cfg.std), tuple(size), cfg.interpolation)


def classes_of(teacher: nn.Module) -> int:
    return int(getattr(teacher, "num_classes", 0) or getattr(getattr(teacher, "cfg", None), "num_classes", 0))


def to_teacher(x: Tensor, student: Preprocessing, teacher: Preprocessing) -> Tensor:
    """The student's normalised batch as the teacher's input: its mean and std, its size."""
    c = x.shape[1]
    if (student.mean, student.std) != (teacher.mean, teacher.std):
        ms, ss = (torch.tensor(v[:c], device=x.device, dtype=x.dtype).view(1, -1, 1, 1) for v in (student.mean,
                                                                                                student.std))
        mt, st = (torch.tensor(v[:c], device=x.device, dtype=x.dtype).view(1, -1, 1, 1) for v in (teacher.mean,
                                                                                                teacher.std))
        x = (x * ss + ms - mt) / st
    if tuple(x.shape[-2:]) != tuple(teacher.size):
        mode = "bicubic" if teacher.interpolation == "bicubic" else "bilinear"
        x = F.interpolate(x, size=teacher.size, mode=mode, align_corners=False, antialias=True)
    return x


def distillation_loss(kind: Distillation, student: Tensor, teacher: Tensor, tau: float) -> Tensor:
    """The distillation term: CE with the teacher's argmax (hard), or tau² · KL at temperature tau (soft)."""
    if kind == "hard":
        return F.cross_entropy(student.float(), teacher.argmax(dim=-1))
    return F.kl_div(F.log_softmax(student.float() / tau, dim=-1), F.log_softmax(teacher.float() / tau, dim=-1),
                    reduction="batchmean", log_target=True) * tau**2


@dataclass(frozen=True)
class Teacher:
    """Distillation from a frozen teacher (a typed part of :class:`~vitkit.lit.ImageClassifier`).

    ``name`` (a
    vitkit preset or timm tag, any timm model by name, or a file or folder vitkit reads) and ``checkpoint`` (the
    weights of a named one); ``distillation`` ``hard`` or ``soft``; the term's share ``alpha`` of the loss and the
    soft term's temperature ``tau``. The teacher model itself lives on the module as ``_teacher``, outside its
    submodules: never in the optimizer, the state dict, the checkpoint, DDP or FSDP2 (replicated)."""

    name: str
    checkpoint: str | None = None
    distillation: Distillation = "hard"
    alpha: float = 0.5
    tau: float = 1.0

    def __post_init__(self) -> None:
        if self.distillation not in ("hard", "soft"):
            raise UsageError(f"a teacher's distillation must be 'hard' or 'soft', got {self.distillation!r} (no "
                             "distillation: no teacher)")
        check_distillation(self.distillation, self.name, self.alpha, self.tau)

    def attach(self, module) -> None:
        """The teacher built and checked against the student's classes; DeiT's distillation head turned on. A
        checkpoint loaded for its weights (to evaluate, predict or export the student) loads without a teacher that
        is no longer there, which only training needs."""
        try:
            model, module._teacher_prep = build_teacher(self.name, self.checkpoint)
        except (CheckpointError, MissingWeightsError, ValueError) as e:
            if not loading_checkpoint():
                raise
            log.warning("the teacher %r cannot be built (%s); the student loads without it, which only training "
                        "needs", self.name, e)
            object.__setattr__(module, "_teacher_missing", str(e))
            return
        classes = classes_of(model)
        if classes != module.num_classes:
            raise UsageError(f"the teacher {self.name!r} predicts {classes} classes, the data has {module.num_classes}:"
                             " a teacher must classify the same classes (fine-tune it on the data first)")
        object.__setattr__(module, "_teacher", model)  # not a submodule (see the class docstring)
        cfg = module.model.cfg
        size = cfg.img_size if isinstance(cfg.img_size, (tuple, list)) else (cfg.img_size, cfg.img_size)
        module._student_prep = Preprocessing(tuple(cfg.mean), tuple(cfg.std), tuple(size))
        if getattr(module.model, "head_dist", None) is not None:
            module.model.set_distilled_training(True)  # training returns (class head, distillation head)

    def before_fit(self, module, dm) -> None:
        """The teacher on the student's device (and, for a *-true precision, its dtype); the student's normalisation
        the data module's."""
        if module._teacher is None:
            raise UsageError(f"the teacher {self.name!r} was not there when this checkpoint was loaded "
                             f"({getattr(module, '_teacher_missing', 'not built')}); distillation needs it to train: "
                             "put it back, or name another with --model.teacher.name")
        dtype = next(module.model.parameters()).dtype
        module._teacher.to(device=module.device, dtype=dtype if dtype.is_floating_point else None)
        data_cfg = getattr(dm, "data_cfg", None)
        if data_cfg is not None:  # the batch is normalised as the data module does it
            module._student_prep.mean, module._student_prep.std = tuple(data_cfg.mean), tuple(data_cfg.std)

    def loss(self, module, label_loss: Tensor, student: Tensor, x: Tensor) -> Tensor:
        """``(1 - alpha)`` x the label loss + ``alpha`` x the distillation term on the same (mixed) images."""
        with torch.no_grad():
            teacher = module._teacher(to_teacher(x, module._student_prep, module._teacher_prep))
        return (1 - self.alpha) * label_loss + self.alpha * distillation_loss(self.distillation, student, teacher,
                                                                              self.tau)
