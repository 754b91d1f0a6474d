"""Loading any supported checkpoint into a vitkit model with a report, and exporting one timm can read."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vitkit.errors import UsageError

from ..models.config import CROP_MODES
from ..models.registry import preset_config
from .adapt import adapt, classifier_names, head_keys, headless
from .files import CheckpointError, is_sharded, read_file, resolve, write_json, write_safetensors
from .formats import split_pretraining_heads, timm_layout, to_vitkit, unwrap
from .hf_config import mim_config, preset_for
from .sharded import read_sharded

log = logging.getLogger(__name__)


class CheckpointMismatchError(CheckpointError):
    """Under ``strict=True``, the checkpoint's keys or shapes do not fit the model (the message lists all; ``report``
    is the :class:`LoadReport`)."""

    def __init__(self, message: str, report: LoadReport | None = None) -> None:
        super().__init__(message)
        self.report = report


@dataclass
class Checkpoint:
    """A state dict in vitkit's names, and what the file says about the model that wrote it."""

    path: Path
    format: str  # vitkit, lightning, timm, torchvision-vit, transformers-swin, official-swin, ...
    state_dict: dict[str, Tensor]
    model_name: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)  # config fields the file records
    class_names: list[str] | None = None
    # a masked-image-modeling file's pre-training heads, in vitkit's names (MaskedAutoencoder / SimMIM), apart
    # from the encoder's state dict; the objective ("mae", "simmim") and the heads' settings the file records
    heads: dict[str, Tensor] = field(default_factory=dict)
    objective: str | None = None
    head_config: dict[str, Any] = field(default_factory=dict)
    # a LoRA run's hyper-parameters: the state dict holds its adapters and head, which ``create_model`` merges into
    # the backbone they name (vitkit/checkpoints/adapters.py)
    lora: dict[str, Any] | None = None
    # a multi-label classifier's per-class decision thresholds (its outputs are sigmoids), as the file records them
    thresholds: list[float] | None = None
    # the class path of the Lightning module that wrote the file (``vitkit.lit.Detector``), where it records one
    module: str | None = None

    @property
    def num_classes(self) -> int | None:
        """The classifier's class count; 0 for a backbone saved without one (no ``head.*`` key)."""
        for k in ("head.weight", "head.fc.weight"):
            if k in self.state_dict:
                return self.state_dict[k].shape[0]
        return 0 if headless(self.state_dict) else None


@dataclass
class LoadReport:
    """What a load did: the format read, the adaptations made, and every key that did not fit."""

    path: Path
    format: str
    model: str
    adapted: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple, tuple]] = field(default_factory=list)
    new_head: list[str] = field(default_factory=list)  # classifier tensors left at the model's initialisation

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def first_difference(self) -> str:
        """The first thing that does not fit, in one phrase: a shape, then a tensor the model lacks, then one the
        checkpoint lacks ('' when everything fits)."""
        if self.mismatched:  # the patch embedding's first: its width and patch size decide the rest
            k, c, m = min(self.mismatched, key=lambda t: (not t[0].startswith("patch_embed."), "weight" not in t[0]))
            return f"{k}: checkpoint {c} vs model {m}"
        if self.unexpected:
            return f"{self.unexpected[0]} is in the checkpoint, not in the model"
        return f"{self.missing[0]} is in the model, not in the checkpoint" if self.missing else ""

    def __str__(self) -> str:
        def listing(title: str, items: list[str]) -> list[str]:
            more = [f"    ... and {len(items) - 20} more"] if len(items) > 20 else []
            return [f"  {title} ({len(items)}):"] + [f"    {i}" for i in items[:20]] + more if items else []

        lines = [f"checkpoint {self.path} (format: {self.format}) -> {self.model}"]
        lines += listing("adapted", self.adapted)
        lines += listing("missing from the checkpoint", self.missing)
        lines += listing("unexpected in the checkpoint", self.unexpected)
        lines += listing("shape mismatches", [f"{k}: checkpoint {tuple(c)} vs model {tuple(m)}"
                                              for k, c, m in self.mismatched])
        if self.ok and self.new_head:
            lines.append("  every other model tensor was loaded; the classifier "
                         f"({', '.join(self.new_head)}) keeps the model's initialisation")
        elif self.ok:
            lines.append("  every model tensor was loaded" + (" (some adapted)" if self.adapted else ""))
        return "\n".join(lines)


def _describe(config: dict | None, ckpt: dict) -> tuple[str | None, dict, list[str] | None]:
    """(preset name, config overrides, class names) recorded beside or inside the weights, if any."""
    if "pytorch-lightning_version" in ckpt and "hyper_parameters" in ckpt:
        hp = ckpt["hyper_parameters"]
        overrides = dict(hp.get("model_overrides") or {})
        overrides.update({k: hp[k] for k in ("num_classes", "img_size") if hp.get(k) is not None})
        return hp.get("model_name"), overrides, hp.get("class_names")
    if not config:
        return None, {}, None
    if "vitkit" in config:
        return config["architecture"], dict(config["vitkit"]["config"]), config.get("label_names")
    if "architecture" in config:  # timm's save_for_hf / push_to_hub
        overrides = dict(config.get("model_args") or {})  # timm's kwargs; create_model keeps the config fields
        pcfg = config.get("pretrained_cfg", {})
        overrides.update({k: pcfg[k] for k in ("mean", "std", "crop_pct", "interpolation") if k in pcfg})
        if pcfg.get("crop_mode") in CROP_MODES:  # timm's field; its "border" vitkit does not take
            overrides["crop_mode"] = pcfg["crop_mode"]
        overrides["num_classes"] = config.get("num_classes", pcfg.get("num_classes", 1000))
        return config["architecture"], overrides, config.get("label_names")
    if "model_type" in config:  # transformers' save_pretrained
        name, overrides = preset_for(config)
        labels = config.get("id2label")
        names = [labels[str(i)] if str(i) in labels else labels[i] for i in range(len(labels))] if labels else None
        return name, overrides, names
    return None, {}, None


def read_checkpoint(path: str | os.PathLike, use_ema: bool = False) -> Checkpoint:
    """Read a file or folder of any supported format into vitkit's names (nothing is loaded into a model).

    ``use_ema`` takes the EMA weights of a training checkpoint (timm's ``state_dict_ema``, vitkit's EMA)."""
    weights, config = resolve(path)
    raw = read_sharded(weights) if is_sharded(weights) else read_file(weights)
    try:
        return _interpret(path, weights, config, raw, use_ema)
    except CheckpointError:
        raise
    except Exception as e:  # a readable pickle of an unexpected shape (a dict of odd keys, a non-dict state_dict)
        raise CheckpointError(f"{weights} has no checkpoint layout vitkit knows "
                              f"({type(e).__name__}: {str(e)[:200]})") from None


def _interpret(path: str | os.PathLike, weights: Path, config: dict | None, raw: dict, use_ema: bool) -> Checkpoint:
    name, overrides, class_names = _describe(config, raw)
    if "pytorch-lightning_version" in raw:
        prefix = "ema.module." if use_ema else "model."
        sd = {k[len(prefix):]: v for k, v in raw.get("state_dict", {}).items() if k.startswith(prefix)}
        if not sd:
            raise CheckpointError(f"{weights}: a Lightning checkpoint without {prefix}* weights"
                                  + (" (was it trained with ema_decay?)" if use_ema else ""))
        sd, heads, objective = split_pretraining_heads(sd)
        fmt = "lightning"
    else:
        sd = unwrap(raw, use_ema)
        sd = {k: v for k, v in sd.items() if isinstance(v, Tensor)}
        if not sd:
            raise CheckpointError(f"{weights} holds no tensors; its top-level keys are {sorted(map(str, raw))[:12]}")
        sd, heads, objective = split_pretraining_heads(sd)
        sd, fmt = to_vitkit(sd)
        if config and "vitkit" in config:
            fmt = "vitkit"
    head_config = mim_config(config, raw) if objective else {}
    hp = raw.get("hyper_parameters") if fmt == "lightning" else None
    lora = hp if isinstance(hp, dict) and lora_arguments(hp) is not None else None
    module = hp.get("_class_path") if isinstance(hp, dict) else None
    return Checkpoint(Path(path), fmt, sd, name, overrides, class_names, heads, objective, head_config, lora,
                      _thresholds(config, raw, weights), module if isinstance(module, str) else None)


def lora_arguments(hp: dict) -> dict[str, Any] | None:
    """A LoRA run's adapter arguments as ``lora_*`` keys (``vitkit.models.lora.settings_of`` reads them): a classifier's
    ``adaptation`` part of kind LoRA, or the flat ``lora_*`` arguments of a segmenter or of a classifier before its
    parts; None for a run without adapters."""
    part = hp.get("adaptation")
    if isinstance(part, dict):
        kind_is_lora = str(part.get("class_path", "")).endswith(".LoRA")
        return {f"lora_{k}": v for k, v in (part.get("init_args") or {}).items()} if kind_is_lora else None
    return hp if hp.get("lora_rank") else None


def _thresholds(config: dict | None, raw: dict, weights: Path) -> list[float] | None:
    """A multi-label classifier's thresholds: a Lightning checkpoint's ``multi_label`` entry, or the ``thresholds``
    of a folder's config.json (``save_pretrained``)."""
    entry = raw.get("multi_label") if "pytorch-lightning_version" in raw else (config or {}).get("multi_label")
    if entry is None:
        return None
    values = entry.get("thresholds") if isinstance(entry, dict) else None
    if not isinstance(values, list) or not all(isinstance(v, (int, float)) and 0 <= v <= 1 for v in values):
        raise CheckpointError(f"{weights}: its multi_label thresholds should be a list of numbers in [0, 1], got "
                              f"{str(values)[:60]}")
    return [float(v) for v in values]


def load_checkpoint(model: nn.Module, checkpoint: str | os.PathLike | Checkpoint, strict: bool = True,
                    use_ema: bool = False) -> LoadReport:
    """Load weights of any supported format into ``model`` and return what happened.

    Position embeddings, relative-position tables, the first conv and the classifier are adapted when
    the model's resolution, window, input channels or class count differ (the report lists each). Any
    other difference raises :class:`CheckpointMismatchError` under ``strict`` (its first line names the first
    difference); otherwise what fits is loaded and the rest is reported."""
    ck = checkpoint if isinstance(checkpoint, Checkpoint) else read_checkpoint(checkpoint, use_ema)
    sd, report = fit(model, ck)
    if strict and not report.ok:
        written = f"; {ck.path.name} was written by {ck.module}" if ck.module else ""
        raise CheckpointMismatchError(f"the checkpoint does not fit {report.model} ({report.first_difference()}; "
                                      f"strict=True{written}):\n{report}", report)
    target = model.state_dict()
    bad = {k for k, _, _ in report.mismatched}
    model.load_state_dict({k: v for k, v in sd.items() if k in target and k not in bad}, strict=False)
    log.info("%s", report)
    return report


def fit(model: nn.Module, ck: Checkpoint) -> tuple[dict[str, Tensor], LoadReport]:
    """How ``ck`` fits ``model`` (which may live on the meta device): its state dict adapted to the model, and the
    report of what would load; nothing is loaded."""
    sd, adapted = adapt(ck.state_dict, model)
    target = model.state_dict()
    fresh = {k for k in ck.state_dict if k in target and k not in sd}  # classifier re-initialised by adapt
    if headless(ck.state_dict) or fresh:  # a backbone, or a new classifier: a head the file lacks is new too
        fresh |= head_keys(model) - sd.keys()  # (DeiT's second head, from a file with one)
    if any(n.startswith("norm: dropped, and fc_norm new") for n in adapted):
        fresh |= {k for k in target if k.startswith("fc_norm.")}
    report = LoadReport(ck.path, ck.format, getattr(model, "name", type(model).__name__), adapted,
                        missing=[k for k in target if k not in sd and k not in fresh],
                        unexpected=[k for k in sd if k not in target],
                        mismatched=[(k, tuple(v.shape), tuple(target[k].shape)) for k, v in sd.items()
                                    if k in target and v.shape != target[k].shape],
                        new_head=sorted(fresh))
    return sd, report


def load_heads(model: nn.Module, ck: Checkpoint) -> LoadReport:
    """Load a file's masked-image-modeling heads (``ck.heads``) into a MaskedAutoencoder / SimMIM whose encoder is
    loaded already; every head tensor must fit, except the decoder's fixed sin-cos positions, which are the
    model's own for another grid."""
    target = {k: v for k, v in model.state_dict().items() if not k.startswith("encoder.")}
    heads = dict(ck.heads)
    adapted = []
    pos = heads.get("decoder_pos_embed")
    if pos is not None and "decoder_pos_embed" in target and pos.shape != target["decoder_pos_embed"].shape:
        del heads["decoder_pos_embed"]
        adapted.append(f"decoder_pos_embed: the model's own sin-cos for its grid (the file's is {tuple(pos.shape)})")
    report = LoadReport(ck.path, ck.format, f"{getattr(model, 'name', type(model).__name__)} heads", adapted,
                        missing=[k for k in target if k not in heads and not k.startswith("decoder_pos_embed")],
                        unexpected=[k for k in heads if k not in target],
                        mismatched=[(k, tuple(v.shape), tuple(target[k].shape)) for k, v in heads.items()
                                    if k in target and v.shape != target[k].shape])
    if not report.ok:
        raise CheckpointMismatchError(f"the checkpoint's pre-training heads do not fit the model:\n{report}")
    model.load_state_dict({k: v for k, v in heads.items() if k in target}, strict=False)
    log.info("%s", report)
    return report


# config fields timm's ViT, Eva and Swin classes take under the same names and meanings: what timm's
# create_model needs, beside the preset's name, to rebuild a model of another size from config.json alone
TIMM_ARGS = ("img_size", "patch_size", "in_chans", "embed_dim", "depth", "depths", "num_heads", "mlp_ratio",
             "window_size", "global_pool")


def timm_args(model: nn.Module) -> tuple[str, dict]:
    """(preset name, the arguments timm's ``create_model`` takes to build the same architecture)."""
    name = getattr(model, "name", None)
    if name is None:
        raise UsageError("save_pretrained needs a model made by vitkit.create_model (it records the preset name)")
    cfg, preset = dataclasses.asdict(model.cfg), dataclasses.asdict(preset_config(name))
    changed = {k: cfg[k] for k in TIMM_ARGS if k in cfg and cfg[k] != preset[k]}
    return name, {"num_classes": cfg["num_classes"], **changed}


def timm_shapes(name: str, model_args: dict) -> dict[str, torch.Size] | None:
    """The state dict's names and shapes of timm's model ``name`` built with ``model_args`` (on the meta device:
    nothing is allocated), or None where timm has no such model or does not take these arguments."""
    import timm

    if not timm.is_model(name):
        return None
    try:
        with torch.device("meta"):
            theirs = timm.create_model(name, pretrained=False, **model_args)
    except (TypeError, ValueError, AssertionError) as e:
        log.debug("timm does not build %s with %s (%s): the folder keeps vitkit's names", name, model_args, e)
        return None
    return {k: v.shape for k, v in theirs.state_dict().items()}


def save_pretrained(model: nn.Module, directory: str | os.PathLike, class_names: list[str] | None = None) -> Path:
    """Write ``model.safetensors`` + ``config.json`` to a folder that vitkit and timm both load (a multi-label
    classifier's ``model.thresholds`` go into config.json's ``multi_label``).

    config.json has timm's layout (architecture, num_classes, pretrained_cfg) plus a ``vitkit`` section
    with the full config, so ``vitkit.create_model(checkpoint=DIR)`` rebuilds the exact model. The weights carry
    the names of timm's model of the same preset (for timm's Eva class, EVA-02 and DINOv3, not vitkit's own)."""
    if getattr(model, "task", None) is not None or not hasattr(model, "num_features"):
        raise UsageError(f"save_pretrained writes a classifier or a backbone (timm's folder); "
                         f"{type(model).__name__} is a {getattr(model, 'task', 'other')} model: a run's checkpoint "
                         "keeps it, `vitkit export` writes its ONNX file, and its backbone saves alone "
                         "(save_pretrained(model.backbone, ...))")
    name, model_args = timm_args(model)
    directory = Path(directory)
    cfg = dataclasses.asdict(model.cfg)
    in_size = cfg["img_size"] if isinstance(cfg["img_size"], (list, tuple)) else [cfg["img_size"]] * 2
    config = {
        "architecture": name,
        "num_classes": cfg["num_classes"],
        "num_features": model.num_features,
        "model_args": model_args,
        "pretrained_cfg": {
            "input_size": [cfg["in_chans"], *in_size], "mean": cfg["mean"], "std": cfg["std"],
            "crop_pct": cfg["crop_pct"], "crop_mode": cfg.get("crop_mode", "center"),
            "interpolation": cfg["interpolation"], "num_classes": cfg["num_classes"],
            "first_conv": "patch_embed.proj", "classifier": classifier_names(model),
            "custom_load": False,
        },
        "vitkit": {"config": cfg},
    }
    if class_names:
        config["label_names"] = list(class_names)
    if getattr(model, "thresholds", None) is not None:
        config["multi_label"] = {"thresholds": [float(t) for t in model.thresholds]}
    state = model.state_dict()
    theirs = timm_shapes(name, model_args)
    if theirs is not None:  # timm's names where its class names a tensor otherwise (its Eva class)
        state = timm_layout(state, theirs)
    write_safetensors(state, directory / "model.safetensors", metadata={"format": "pt"})
    write_json(config, directory / "config.json")
    return directory
