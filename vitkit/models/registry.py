"""Model families and their presets: ``create_model(name, **overrides)`` and ``list_models()``."""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from typing import Any

from torch import nn

from .config import pair
from .seq2seq import SEQ2SEQ_PRESETS, Seq2SeqConfig, Seq2SeqTransformer
from .swin import SWIN_PRESETS, SwinConfig, SwinTransformer
from .vit import VIT_PRESETS, VisionTransformer, ViTConfig

# family -> (config class, model class, presets keyed by timm's names)
FAMILIES: dict[str, tuple[type, type[nn.Module], dict[str, dict]]] = {
    "vit": (ViTConfig, VisionTransformer, VIT_PRESETS),
    "swin": (SwinConfig, SwinTransformer, SWIN_PRESETS),
    "seq2seq": (Seq2SeqConfig, Seq2SeqTransformer, SEQ2SEQ_PRESETS),
}


def family(name: str) -> str:
    """'vit', 'swin' or 'seq2seq' for a preset name (or pretrained name: a timm tag, torchvision weights)."""
    cfg_cls = _find(name)[0]  # raises the readable unknown-model error
    return next(fam for fam, (c, _, _) in FAMILIES.items() if c is cfg_cls)


def _preset(name: str) -> str:
    """The preset behind a pretrained name: 'vit_small_patch16_224.augreg_in1k' -> 'vit_small_patch16_224'."""
    from ..checkpoints import hub  # checkpoints imports models

    if name.startswith("hf-hub:") or hub.TV_WEIGHTS.match(name):
        return _hub(name).preset or _hub_architecture(name)
    return hub.split_tag(name)[0]


def _hub_architecture(name: str) -> str:
    from ..checkpoints import read_checkpoint

    ck = read_checkpoint(_hub(name).fetch())
    if ck.model_name is None:
        raise ValueError(f"{name}: the repo's config.json names no architecture")
    return ck.model_name


def _hub(name: str):
    from ..checkpoints import hub

    return hub.resolve(name)


def _find(name: str) -> tuple[type, type[nn.Module], dict]:
    preset = _preset(name) if "." in name or ":" in name else name
    for cfg_cls, model_cls, presets in FAMILIES.values():
        if preset in presets:
            return cfg_cls, model_cls, presets[preset]
    close = fnmatch.filter(list_models(), f"*{preset.split('_')[0]}*")[:8]
    raise ValueError(f"unknown model {preset!r}; vitkit.list_models() lists all {len(list_models())}"
                     + (f" (similar: {', '.join(close)})" if close else ""))


def get_config(name: str, **overrides: Any):
    """The config of preset ``name`` with any of its fields overridden by keyword. A pretrained name
    (``vit_small_patch16_224.augreg_in1k``, ``ViT_B_16_Weights.IMAGENET1K_V1``) gives the config its
    weights were trained with: their image size, classes, mean, std, crop_pct and interpolation."""
    cfg_cls, _, preset = _find(name)
    fields = {f.name for f in dataclasses.fields(cfg_cls)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(f"{name}: unknown config field(s) {unknown}; {cfg_cls.__name__} has {sorted(fields)}")
    weights = _weights_config(_hub(name).config, preset) if "." in name and not name.startswith("hf-hub:") else {}
    return cfg_cls(**{**preset, **weights, **overrides})


def _weights_config(config: dict, preset: dict) -> dict:
    """Config fields of a timm tag or torchvision weights, as overrides of the preset (no download)."""
    config = dict(config)
    if pair(config["img_size"]) == pair(preset.get("img_size", 224)):
        del config["img_size"]  # the preset's own, as it wrote it
    return config


def create_model(name: str | None = None, *, pretrained: bool | str = False,
                 checkpoint: str | os.PathLike | None = None, strict: bool = True, use_ema: bool = False,
                 features_only: bool = False, out_indices: int | tuple[int, ...] | None = None,
                 output_fmt: str | None = None, **overrides: Any) -> nn.Module:
    """Build preset ``name`` (timm's naming), e.g. ``create_model("vit_small_patch16_224", num_classes=10)``.

    Pretrained weights, as in timm:

    - ``create_model("vit_base_patch16_224.augreg2_in21k_ft_in1k", pretrained=True)``: a timm tag (a bare
      preset takes timm's default tag), from the Hugging Face cache, downloaded only when missing;
    - ``create_model("ViT_B_16_Weights.IMAGENET1K_V1", pretrained=True)``: torchvision's, from torch hub's cache;
    - ``create_model("hf-hub:timm/<repo>", pretrained=True)`` or ``"local-dir:/path/to/folder"``: a folder with
      timm's config.json (a plain path works too);
    - ``create_model("vit_small_patch16_224", pretrained="/path/to/weights.safetensors")``.

    The weights' image size, classes, mean, std, crop_pct and interpolation become the config (a tag without
    ``pretrained`` still takes them) and their label names ``model.class_names``. With ``checkpoint`` (a file
    or folder of any format in :mod:`vitkit.checkpoints`) the weights are loaded too; settings the file
    records are applied first, then ``overrides``, and ``name`` may be omitted. Without an explicit
    ``num_classes`` the weights' classifier size is kept (``num_classes=0`` for a backbone saved without a
    head); with another one a new head is made, and a checkpoint without a head leaves the new head at its
    initialisation while every other tensor must still fit (``model.load_report`` says "head: new").

    ``features_only=True`` returns a :class:`~vitkit.models.features.FeatureNet` of the stages (Swin) or
    blocks (ViT) in ``out_indices``, as timm does: NHWC maps for Swin by default, NCHW for ViT."""
    source, label_names = None, None
    if name is not None and name.startswith("hf-hub:"):  # a hub repo with timm's config.json: a cached folder
        from ..checkpoints import hub

        source = hub.resolve(name)
        name = f"local-dir:{source.fetch()}"
    if name is not None and (name.startswith("local-dir:") or _is_path(name)):
        folder, name = name.removeprefix("local-dir:"), None
        checkpoint = folder if pretrained else checkpoint
        if not pretrained:  # the folder's config, random weights (timm's semantics)
            from ..checkpoints import read_checkpoint

            ck = read_checkpoint(folder)
            if ck.model_name is None:
                raise ValueError(f"{folder} does not record which model it holds ({ck.format} format)")
            fields = {f.name for f in dataclasses.fields(_find(ck.model_name)[0])}
            recorded = {k: v for k, v in ck.overrides.items() if k in fields}
            if ck.num_classes is not None and "num_classes" in fields:
                recorded["num_classes"] = ck.num_classes
            name, overrides = ck.model_name, {**recorded, **overrides}
    elif isinstance(pretrained, (str, os.PathLike)):
        checkpoint = pretrained
    elif name is not None and (pretrained or "." in name):
        from ..checkpoints import hub

        source = hub.resolve(name)
        name = source.preset
        preset = _find(name)[2]
        overrides = {**_weights_config(source.config, preset), **overrides}
        label_names = source.label_names
        if pretrained and checkpoint is None:  # an explicit checkpoint replaces the tag's weights
            checkpoint = source.fetch()
    ck = None
    if checkpoint is not None:
        from ..checkpoints import load_checkpoint, read_checkpoint  # checkpoints imports models

        ck = read_checkpoint(checkpoint, use_ema)
        name = name or ck.model_name
        if name is None:
            raise ValueError(f"{checkpoint} does not record which model it holds ({ck.format} format); "
                             "pass the preset name, e.g. create_model('vit_base_patch16_224', checkpoint=...)")
        # settings recorded for another preset do not apply, except a transformers config: it describes
        # the whole architecture, so it fits any preset of its family
        applies = ck.model_name in (None, name) or ck.format.startswith("transformers")
        fields = {f.name for f in dataclasses.fields(_find(name)[0])}
        recorded = {k: v for k, v in ck.overrides.items() if k in fields} if applies else {}
        if "num_classes" not in recorded and ck.num_classes is not None and "num_classes" in fields:
            recorded["num_classes"] = ck.num_classes  # 0 for a backbone saved without a head: timm's num_classes=0
        overrides = {**recorded, **overrides}
    if name is None:
        raise TypeError("create_model needs a preset name (or a checkpoint that records one)")
    _, model_cls, _ = _find(name)
    model = model_cls(get_config(name, **overrides))
    model.name = name
    model.class_names = label_names
    if ck is not None:
        model.load_report = load_checkpoint(model, ck, strict=strict)
        model.class_names = ck.class_names or label_names
    if model.class_names is not None and len(model.class_names) != getattr(model.cfg, "num_classes", None):
        model.class_names = None  # a new head: the weights' labels no longer apply
    if hasattr(model, "feature_info"):
        model.pretrained_cfg = _pretrained_cfg(model, source)
    if features_only:
        from .features import FeatureNet

        return FeatureNet(model, out_indices, output_fmt)
    return model


def _is_path(name: str) -> bool:
    """A name that is a file or folder on disk (a path, or a file name with a weights suffix), not a preset."""
    from ..checkpoints.files import WEIGHT_SUFFIXES

    return (os.sep in name or name.endswith(WEIGHT_SUFFIXES)) and os.path.exists(name)


def _pretrained_cfg(model: nn.Module, source) -> dict[str, Any]:
    """timm's ``pretrained_cfg`` of a model: where its weights came from and how to prepare its input."""
    cfg = model.cfg
    out = dict(source.pretrained_cfg) if source is not None else {"architecture": model.name}
    out.update(input_size=(cfg.in_chans, *pair(cfg.img_size)), mean=tuple(cfg.mean), std=tuple(cfg.std),
               crop_pct=cfg.crop_pct, interpolation=cfg.interpolation, num_classes=cfg.num_classes,
               first_conv="patch_embed.proj", classifier="head.fc" if hasattr(model.head, "fc") else "head")
    return out


def list_models(pattern: str = "*") -> list[str]:
    """Preset names matching a glob pattern, sorted."""
    names = [n for _, _, presets in FAMILIES.values() for n in presets]
    return sorted(fnmatch.filter(names, pattern))

