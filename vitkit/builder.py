"""``create_model``: a preset, a pretrained name or a weights file -> a model with its weights loaded.

The builder sits above the preset table (``vitkit.models.registry``, names only) and the weights code
(``vitkit.checkpoints``), as timm's ``_builder`` sits above its ``_registry``; neither of those imports it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from torch import nn

from vitkit.errors import UsageError, UsageTypeError

from .checkpoints import hub
from .checkpoints.adapt import classifier_names
from .checkpoints.adapters import merge_checkpoint
from .checkpoints.files import WEIGHT_SUFFIXES, CheckpointError
from .checkpoints.load import Checkpoint, CheckpointMismatchError, load_checkpoint, load_heads, read_checkpoint
from .checkpoints.match import fitting_presets
from .checkpoints.names import _weights_config, capabilities, family, get_config, preset_of  # noqa: F401
from .models.config import pair
from .models.detection import YOLOS
from .models.features import FeatureNet, default_out_indices
from .models.mim import MAEConfig, MaskedAutoencoder, SimMIM, SimMIMConfig
from .models.registry import check_fields, find
from .models.segmentation import SegmentationModel, build_segmenter

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Plan:
    """What ``create_model`` builds: the preset, its overrides, the weights to load and where they came from."""

    name: str | None
    overrides: dict[str, Any]
    checkpoint: str | os.PathLike | None = None
    source: hub.Pretrained | None = None
    label_names: list[str] | None = None


def _plan(name: str | None, pretrained: bool | str, checkpoint, overrides: dict[str, Any]) -> _Plan:
    """Resolve a hub repo, a local folder, a file given as ``pretrained`` or a pretrained name."""
    plan = _Plan(name, dict(overrides), checkpoint)
    if name is not None and name.startswith("hf-hub:"):  # a hub repo with timm's config.json: a cached folder
        plan.source = hub.resolve(name)
        name = f"local-dir:{plan.source.fetch()}"
    if name is not None and (name.startswith("local-dir:") or _is_path(name)):
        folder, plan.name = name.removeprefix("local-dir:"), None
        if pretrained:
            plan.checkpoint = folder
        else:  # the folder's config, random weights (timm's semantics)
            ck = read_checkpoint(folder)
            if ck.model_name is None:
                raise UsageError(f"{folder} does not record which model it holds ({ck.format} format)")
            plan.name, plan.overrides = ck.model_name, {**_recorded(ck, ck.model_name), **plan.overrides}
    elif isinstance(pretrained, (str, os.PathLike)):
        plan.checkpoint = pretrained
    elif name is not None and (pretrained or "." in name):
        plan.source = hub.resolve(name)
        plan.name = plan.source.preset
        plan.overrides = {**_weights_config(plan.source.config, find(plan.name)[3]), **plan.overrides}
        plan.label_names = plan.source.label_names
        if pretrained and checkpoint is None:  # an explicit checkpoint replaces the tag's weights
            plan.checkpoint = plan.source.fetch()
    return plan


def _build(plan: _Plan, ck: Checkpoint | None, given: bool) -> nn.Module:
    """The model of the plan. What only a file recorded and vitkit cannot build (a value its field refuses, or a
    combination the model refuses: heads that do not divide the width) is the file's error."""
    try:
        return find(plan.name)[2](get_config(plan.name, **plan.overrides))
    except (ValueError, TypeError) as e:
        if ck is None or given:  # the caller's values take part: theirs to change
            raise
        raise CheckpointError(f"{ck.path} records a config vitkit cannot build: {e}") from None


def _checked_record(ck: Checkpoint, name: str, given: dict[str, Any]) -> dict[str, Any]:
    """:func:`_recorded`, with what the file records refused as the file's fault: a model vitkit does not know,
    or a value its field does not take (those the caller overrides are not looked at)."""
    try:
        _, cfg_cls, _, _ = find(name if isinstance(name, str) else repr(name))
    except ValueError as e:
        if name != ck.model_name:  # the caller's name: their mistake, not the file's
            raise
        raise CheckpointError(f"{ck.path} records a model vitkit cannot build: {e}") from None
    try:
        recorded = _recorded(ck, name)
        check_fields(name, cfg_cls, {k: v for k, v in recorded.items() if k not in given})
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{ck.path} records a config vitkit cannot build: {e}") from None
    return recorded


def _recorded(ck: Checkpoint, name: str) -> dict[str, Any]:
    """The config fields a checkpoint records that apply to preset ``name``, and its class count (0 for a
    backbone saved without a head: timm's ``num_classes=0``)."""
    # settings recorded for another preset do not apply, except a transformers config: it describes the whole
    # architecture, so it fits any preset of its family
    applies = ck.model_name in (None, name) or ck.format.startswith("transformers")
    fields = {f.name for f in dataclasses.fields(find(name)[1])}
    recorded = {k: v for k, v in ck.overrides.items() if k in fields} if applies else {}
    if "num_classes" not in recorded and ck.num_classes is not None and "num_classes" in fields:
        recorded["num_classes"] = ck.num_classes
    return recorded


def create_model(name: str | None = None, *, pretrained: bool | str = False,
                 checkpoint: str | os.PathLike | Checkpoint | None = None, strict: bool = True, use_ema: bool = False,
                 features_only: bool = False, out_indices: int | tuple[int, ...] | None = None,
                 output_fmt: str | None = None, feature_cls: str | None = None,
                 feature_cfg: dict[str, Any] | None = None, **overrides: Any) -> nn.Module:
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
    blocks (ViT) in ``out_indices``, as timm does: NHWC maps for Swin by default, NCHW for ViT. ``feature_cls``
    (or ``feature_cfg={"feature_cls": ...}``, timm's two spellings) picks how they are taken: ``"getter"`` (the
    default: ``forward_intermediates``, as timm's ``FeatureGetterNet``), ``"fx"`` (timm's ``FeatureGraphNet``, a
    torch.fx graph cut at the blocks) or ``"hook"`` (timm's ``FeatureHookNet``, forward hooks on the blocks)."""
    plan = _plan(name, pretrained, checkpoint, overrides)
    ck = None
    if plan.checkpoint is not None:
        ck = _read(plan.checkpoint, use_ema)
        plan.name = plan.name or ck.model_name or matched_preset(ck)
        plan.overrides = {**_checked_record(ck, plan.name, plan.overrides), **plan.overrides}
    if plan.name is None:
        raise UsageTypeError("create_model needs a preset name (or a checkpoint that records one)")
    model = _build(plan, ck, bool(overrides))
    model.name = plan.name
    model.class_names = plan.label_names
    if ck is not None:
        try:
            model.load_report = load_checkpoint(model, ck, strict=strict)
        except CheckpointMismatchError as e:
            if ck.model_name == plan.name:
                raise
            fits = ", ".join(fitting_presets(ck)[:6]) or "none"  # the caller's preset, for a file of another or none
            why = e.report.first_difference()
            raise CheckpointMismatchError(f"{ck.path} does not fit the model {plan.name} ({why}); presets its shapes "
                                          f"fit: {fits}\n{e.report}", e.report) from None
    _label_model(model, ck.class_names if ck is not None else None, plan.label_names,
                 ck.thresholds if ck is not None else None)
    if hasattr(model, "feature_info"):
        model.pretrained_cfg = model.default_cfg = _pretrained_cfg(model, plan.source)  # timm sets both
    if features_only:
        return _features(model, out_indices, output_fmt, feature_cls, dict(feature_cfg or {}))
    if feature_cls is not None or feature_cfg:
        raise UsageTypeError("feature_cls and feature_cfg apply with features_only=True")
    return model


def _label_model(model: nn.Module, names: list[str] | None, tag_names: list[str] | None,
                 thresholds: list[float] | None) -> None:
    """``model.class_names`` (the file's, else the tag's) and a multi-label classifier's ``model.thresholds`` (its
    outputs take a sigmoid each; None for a softmax); neither where a new head no longer has their classes."""
    classes = getattr(model.cfg, "num_classes", None)
    model.class_names = names or tag_names
    if model.class_names is not None and len(model.class_names) != classes:
        model.class_names = None
    model.thresholds = thresholds if thresholds is not None and len(thresholds) == classes else None


FEATURE_CLASSES = ("getter", "fx", "hook")


def _features(model: nn.Module, out_indices: int | tuple[int, ...] | None, output_fmt: str | None,
              feature_cls: str | None, feature_cfg: dict[str, Any]) -> nn.Module:
    """The backbone wrapper timm's ``features_only`` builds (see :func:`create_model`), from the arguments as
    timm takes them, given directly or in ``feature_cfg``."""
    asked = feature_cfg.pop("feature_cls", feature_cls)
    out_indices = feature_cfg.pop("out_indices", out_indices)
    output_fmt = feature_cfg.pop("output_fmt", output_fmt)
    feature_cls = asked or "getter"
    if feature_cls not in FEATURE_CLASSES:
        raise UsageError(f"feature_cls must be one of {FEATURE_CLASSES}, got {feature_cls!r}")
    if feature_cls == "getter":  # asked for by name: NCHW maps, as timm's getter gives (Swin's default: NHWC)
        return FeatureNet(model, out_indices, output_fmt or ("NCHW" if asked else None), **feature_cfg)
    from timm.models import FeatureGraphNet, FeatureHookNet

    taken = tuple(default_out_indices(model, out_indices))
    fmt = output_fmt or ("NHWC" if model.output_fmts[0] == "NHWC" else "NCHW")  # ViT's blocks: token maps
    wrapper = FeatureGraphNet if feature_cls == "fx" else FeatureHookNet
    net = wrapper(model, out_indices=taken, output_fmt=fmt, **feature_cfg)
    net.pretrained_cfg = net.default_cfg = getattr(model, "pretrained_cfg", None)
    return net


def matched_preset(ck: Checkpoint) -> str:
    """The preset a checkpoint that records none fits by its shapes (the first of :func:`fitting_presets`); the
    choice and the others that fit are logged."""
    fits = fitting_presets(ck)
    if not fits:
        raise CheckpointError(f"{ck.path} does not record which model it holds ({ck.format} format) and fits no "
                              "preset's shapes; pass the preset name, e.g. create_model('vit_base_patch16_224', "
                              "checkpoint=...), to see what differs")
    others = f" (also fit: {', '.join(fits[1:6])}; name one to choose it)" if len(fits) > 1 else ""
    log.info("%s records no model: %s, the preset its shapes fit%s", ck.path, fits[0], others)
    return fits[0]


def _read(source: Any, use_ema: bool) -> Checkpoint:
    ck = source if isinstance(source, Checkpoint) else read_checkpoint(source, use_ema)
    if ck.lora is not None:  # a LoRA run's adapters and head: merged into the backbone they name
        merge_checkpoint(ck, create_model)
    return ck


def checkpoint_preset(path: str | os.PathLike) -> tuple[str | None, str]:
    """The preset of a weights file or folder, and how it was found: the one it records ("recorded"), or the one
    its shapes fit ("matched to its shapes", with the others that fit); None where no preset fits."""
    ck = read_checkpoint(path)
    if ck.model_name is not None:
        return ck.model_name, "recorded in the file"
    fits = fitting_presets(ck)
    if not fits:
        return None, "no preset fits its shapes"
    return fits[0], "matched to its shapes" + (f"; also fit: {', '.join(fits[1:6])}" if fits[1:] else "")


def _is_path(name: str) -> bool:
    """A name that is a file or folder on disk (a path, or a file name with a weights suffix), not a preset."""
    return (os.sep in name or name.endswith(WEIGHT_SUFFIXES)) and os.path.exists(name)


def _pretrained_cfg(model: nn.Module, source: hub.Pretrained | None) -> dict[str, Any]:
    """timm's ``pretrained_cfg`` of a model: where its weights came from and how to prepare its input."""
    cfg = model.cfg
    out = dict(source.pretrained_cfg) if source is not None else hub.default_pretrained_cfg(model.name)
    size = pair(cfg.img_size)
    out.update(input_size=(cfg.in_chans, *size), mean=tuple(cfg.mean), std=tuple(cfg.std),
               crop_pct=cfg.crop_pct, interpolation=cfg.interpolation, num_classes=cfg.num_classes,
               first_conv="patch_embed.proj", classifier=classifier_names(model))
    # timm's tools shrink the input of a model without fixed_input_size; these take one size, a ViT with
    # dynamic_img_size any. A preset dynamic by default (DINOv3) keeps timm's own entry (True there).
    dynamic = getattr(cfg, "dynamic_img_size", False)
    if dynamic != find(model.name)[3].get("dynamic_img_size", False) or "fixed_input_size" not in out:
        out["fixed_input_size"] = not dynamic
    if model.output_fmts[0] == "NHWC":  # Swin: the final feature map that the head pools
        reduction = model.feature_info[-1]["reduction"]
        out["pool_size"] = (size[0] // reduction, size[1] // reduction)
    return out


def create_mim(name: str | None = None, *, objective: str | None = None, pretrained: bool | str = False,
               checkpoint: str | os.PathLike | None = None, mim: dict[str, Any] | None = None,
               **overrides: Any) -> nn.Module:
    """A masked-image-modeling model around encoder preset ``name``: a :class:`~vitkit.models.mim.MaskedAutoencoder`
    (``objective="mae"``, ViT) or a :class:`~vitkit.models.mim.SimMIM` (``"simmim"``, Swin or ViT; Swin's default).

    ``checkpoint`` is any file or folder vitkit reads: its encoder is loaded as by :func:`create_model` and, where
    it holds pre-training heads (vitkit's own pre-training checkpoints, Meta's ``mae_visualize_*`` files,
    transformers' ``ViTMAEForPreTraining``, ``ViT/SwinForMaskedImageModeling``), those too, with the settings it
    records; ``mim`` sets the objective's fields (``MAEConfig`` / ``SimMIMConfig``: mask ratio, decoder sizes, ...)
    over them, and ``overrides`` the encoder's."""
    ck = read_checkpoint(checkpoint) if checkpoint is not None else None
    name = name or (ck.model_name if ck is not None else None)
    if name is None:
        raise UsageTypeError("create_mim needs an encoder preset name (or a checkpoint that records one)")
    takes = capabilities(name).mim
    recorded_objective = ck.objective if ck is not None and ck.objective in ("mae", "simmim") else None  # not DINO's
    objective = objective or recorded_objective or (takes[0] if takes else "mae")
    if objective not in ("mae", "simmim"):
        raise UsageError(f"objective must be 'mae' or 'simmim', got {objective!r}")
    if objective == "mae" and takes == ("simmim",):
        raise UsageError(f"MAE drops the hidden patches, which {name}'s windows cannot do (they partition the whole "
                         "grid): pre-train Swin with SimMIM (objective='simmim')")
    if objective not in takes:
        raise UsageError(f"{name} is not pre-trained with {objective.upper()}: its family takes "
                         f"{', '.join(takes) or 'no masked image modeling'}")
    cfg_cls = MAEConfig if objective == "mae" else SimMIMConfig
    fields = {f.name for f in dataclasses.fields(cfg_cls)} - {"encoder", "encoder_overrides"}
    recorded = ck.head_config if ck is not None and ck.objective == objective else {}
    settings = {k: v for k, v in {**recorded, **(mim or {})}.items() if k in fields}
    unknown = sorted(set(mim or {}) - fields)
    if unknown:
        raise UsageTypeError(f"{cfg_cls.__name__} has no field(s) {unknown}; it has {sorted(fields)}")
    encoder = create_model(name, pretrained=pretrained, checkpoint=ck, num_classes=0, **overrides)
    cfg = cfg_cls(encoder=encoder.name, encoder_overrides=dict(overrides), **settings)
    model = (MaskedAutoencoder if objective == "mae" else SimMIM)(cfg, encoder)
    model.name = encoder.name
    model.load_report = getattr(encoder, "load_report", None)
    if ck is not None and ck.heads and recorded_objective is not None:
        if ck.objective != objective:
            raise CheckpointError(f"{ck.path} holds {ck.objective} pre-training heads, not {objective}'s: pass "
                                  f"objective={ck.objective!r}, or a file without heads")
        model.heads_report = load_heads(model, ck)
    return model


def create_segmenter(name: str, *, head: str = "upernet", num_classes: int, pretrained: bool | str = False,
                     checkpoint: str | os.PathLike | None = None, head_checkpoint: str | os.PathLike | None = None,
                     indices: list[int] | None = None, auxiliary: bool | None = None,
                     head_args: dict[str, Any] | None = None, **overrides: Any) -> SegmentationModel:
    """A segmentation model: backbone ``name`` (any preset or pretrained name, as :func:`create_model` takes it,
    ``checkpoint`` its weights file, ``overrides`` its config fields) under ``head`` ("linear", "upernet" or "dpt",
    built with ``head_args``; see ``vitkit.models.segmentation``), ``num_classes`` logits per pixel.

    ``head_checkpoint``: Meta's DINOv2 linear head file (``dinov2_vits14_ade20k_linear_head.pth``); the head then
    reads the layers the file was trained on (the last one, or the last four) with the backbone's final norm, as
    Meta's ``get_intermediate_layers`` gives them."""
    backbone = create_model(name, pretrained=pretrained, checkpoint=checkpoint, num_classes=0, **overrides)
    if head_checkpoint is None:
        return build_segmenter(backbone, head, num_classes, indices, auxiliary=auxiliary, **(head_args or {}))
    from .checkpoints.segmentation import dinov2_linear_head

    sd, layers = dinov2_linear_head(head_checkpoint, backbone.feature_info[-1]["num_chs"])
    n = len(backbone.feature_info)
    model = build_segmenter(backbone, "linear", sd["decode_head.conv_seg.weight"].shape[0], list(range(n - layers, n)))
    model.decode_head.load_state_dict({k.removeprefix("decode_head."): v for k, v in sd.items()})
    return model


def load_segmenter(path: str | os.PathLike, img_size: int | tuple[int, int] | None = None) -> SegmentationModel:
    """A whole segmentation model from another library's files: a folder of transformers'
    ``UperNetForSemanticSegmentation`` (Swin backbone), or an mmsegmentation UperNet-Swin checkpoint (``.pth``),
    every weight loaded strictly. ``img_size``: the input size to build it for (a Swin's windows and masks are
    planned at it; mmsegmentation's ADE20k models run at 512), default the file's pre-training size."""
    from .checkpoints.segmentation import read_segmenter

    found = read_segmenter(path)
    overrides = {**found.overrides, **({"img_size": img_size} if img_size is not None else {})}
    backbone = create_model(found.preset, num_classes=0, **overrides)
    classes = found.state_dict["decode_head.conv_seg.weight"].shape[0]
    model = build_segmenter(backbone, found.head, classes, auxiliary=found.auxiliary, aux_args=found.aux_args,
                            **found.head_args)
    model.load_state_dict(found.state_dict)
    model.class_names = found.class_names
    return model


def load_depth_estimator(path: str | os.PathLike, backbone: str | os.PathLike | nn.Module | None = None,
                         max_depth: float | None = None):
    """A whole depth estimator from another library's files, every weight loaded strictly; ``model(images)`` gives
    depth (B, H, W) at the input's size. ``path``: a folder of transformers' ``DepthAnythingForDepthEstimation``
    (Depth Anything V1 or V2, relative or metric) or ``DPTForDepthEstimation`` (Intel's DPT, Meta's DPT-DINOv2), or a
    DINOv2 depth head file of Meta's (``dinov2_vits14_nyu_dpt_head.pth``, ``..._linear4_head.pth``), whose
    ``backbone`` is its own file (``dinov2_vits14_pretrain.pth`` or any format vitkit reads), a pretrained name
    (``vit_small_patch14_dinov2.lvd142m``) or a built headless vitkit ViT. ``max_depth``: a DINOv2 head's range
    (default 80 for a KITTI file's name, 10 otherwise)."""
    from .checkpoints.depth import head_indices, read_depth_file
    from .models.depth import build_depth_model

    found = read_depth_file(path, max_depth)
    from .checkpoints.files import interpreted

    if found.backbone_file:
        if backbone is None:
            raise UsageError(f"{path} is a DINOv2 depth head alone: give its backbone, "
                             "load_depth_estimator(head, backbone='dinov2_vits14_pretrain.pth')")
        if isinstance(backbone, nn.Module):
            net = backbone
            if hasattr(net, "configure"):  # Meta's DINOv2 resamples its positions without antialiasing
                net.configure(pos_antialias=False)
        elif _is_path(str(backbone)):
            net = create_model(None, checkpoint=backbone, num_classes=0, pos_antialias=False)
        else:
            net = create_model(str(backbone), pretrained=True, num_classes=0, pos_antialias=False)
        settings = dict(found.settings, indices=head_indices(found, len(net.feature_info), net.num_features))
    else:
        if backbone is not None:
            raise UsageError(f"{path} holds its backbone; backbone= is for a DINOv2 depth head file")
        net, settings = None, found.settings

    def build() -> nn.Module:
        made = net if net is not None else create_model(found.preset, num_classes=0, **found.overrides)
        model = build_depth_model(made, **settings)
        own = model.state_dict()
        weights = {**{k: v for k, v in own.items() if k.startswith(found.unused)}, **found.state_dict}
        if found.backbone_file:
            weights.update({k: v for k, v in own.items() if k.startswith("backbone.")})
        model.load_state_dict(weights)
        return model

    return interpreted(path, build)


def load_detector(path: str | os.PathLike) -> nn.Module:
    """A whole detector: a folder of transformers' ``YolosForObjectDetection`` (a
    :class:`~vitkit.models.detection.YOLOS`) or ``RfDetrForObjectDetection`` (a
    :class:`~vitkit.models.rf_detr.RFDETR`), or a ``.pth`` of RF-DETR's own code, every weight loaded strictly, its
    class names kept (``model.class_names``). A ``vitkit.lit.Detector`` run's checkpoint is Lightning's:
    ``vitkit.lit.Detector.load_from_checkpoint(path).eval().evaluated()`` is the model it validated."""
    from .checkpoints.detection import read_detector

    return detector_from(read_detector(path), path)


def detector_from(found, where: str | os.PathLike) -> nn.Module:
    """The detector a :class:`~vitkit.checkpoints.detection.DetectorFile` of ``where`` describes, its weights loaded
    strictly (weights or settings the model refuses are the file's error)."""
    from .checkpoints.files import interpreted
    from .models.rf_detr import RFDETR

    def build() -> nn.Module:
        backbone = create_model(found.preset, num_classes=0, **found.overrides)
        model = (RFDETR if found.kind == "rf_detr" else YOLOS)(backbone, **found.settings)
        own = {k: v for k, v in model.state_dict().items() if found.unused and k.startswith(found.unused)}
        model.load_state_dict({**own, **found.state_dict})
        return model

    model = interpreted(where, build)
    model.class_names = found.class_names
    return model
