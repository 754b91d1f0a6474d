"""What the subcommands share: the one-line parser, ``--overrides``, loading a classifier, reading an image."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from vitkit.errors import UsageError

if TYPE_CHECKING:
    import torch

TOKEN_MERGING = ("ToMe: merge R token pairs in every block (ViT/DeiT; Bolya et al., 2023), faster at some cost in "
                 "accuracy; 0: off")
OVERRIDES = "config fields as JSON, for files that do not record them, e.g. '{\"depth\": 6, \"img_size\": 384}'"


def usage_error(prog: str, message: str) -> str:
    """The message a parser's error becomes, the same for every subcommand."""
    return f"{message} (`{prog} --help` lists the options)"


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser, whose errors are a :class:`~vitkit.errors.UsageError` of one line, as the other errors of
    vitkit."""

    def error(self, message: str):
        raise UsageError(usage_error(self.prog, message))


def command_parser(name: str, **kwargs) -> OneLineParser:
    """The parser of subcommand ``name``, described by its line in :data:`vitkit.cli.COMMANDS`."""
    from . import COMMANDS

    return OneLineParser(prog=f"vitkit {name}", description=COMMANDS[name], **kwargs)


def add_model_source(p: argparse.ArgumentParser, checkpoint_help: str, model_help: str | None = None) -> None:
    """``--checkpoint``, ``--model`` and ``--overrides``: where a command's model comes from."""
    p.add_argument("--checkpoint", help=checkpoint_help)
    p.add_argument("--model", help=model_help)
    p.add_argument("--overrides", default="{}", help=OVERRIDES)


def image_paths(paths: list[str]) -> list[str]:
    """The image files named, each folder among them replaced by its image files (at every depth, sorted)."""
    from pathlib import Path

    from vitkit.image_files import IMAGE_SUFFIXES, image_files

    out = []
    for path in paths:
        if not Path(path).is_dir():
            out.append(path)
            continue
        found = [str(f) for f in image_files(Path(path))]
        if not found:
            raise UsageError(f"{path} is a folder without images ({', '.join(IMAGE_SUFFIXES)}, at any depth)")
        out += found
    return out


def parse_overrides(text: str) -> dict:
    """``--overrides``: a JSON object of config fields (their types are checked when the model is built)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise UsageError(f"--overrides expects a JSON object such as '{{\"depth\": 6}}', got {text!r} "
                         f"({e})") from None
    if not isinstance(value, dict):
        raise UsageError(f"--overrides expects a JSON object such as '{{\"depth\": 6}}', got a JSON "
                         f"{type(value).__name__}: {text!r}")
    return value


def load_classifier(args: argparse.Namespace) -> torch.nn.Module:
    """The classifier ``--checkpoint`` / ``--model`` / ``--overrides`` (and ``--token-merging``) name, in eval mode."""
    import vitkit
    from vitkit.checkpoints.names import capabilities

    if args.checkpoint is None and args.model is None:
        raise UsageError("give --checkpoint FILE, or --model NAME for pretrained weights by name "
                         "(a timm tag such as vit_base_patch16_224.augreg2_in21k_ft_in1k, or torchvision weights)")
    overrides = parse_overrides(args.overrides)
    if getattr(args, "token_merging", None):
        overrides["token_merging"] = args.token_merging
    try:
        net = vitkit.create_model(args.model, checkpoint=args.checkpoint, pretrained=args.checkpoint is None,
                                  **overrides).eval()
    except ValueError as e:
        if "token_merging" not in overrides:
            raise
        raise UsageError(f"--token-merging {args.token_merging}: {e}") from None
    if not capabilities(net.name).images:
        raise UsageError(f"{args.checkpoint} holds an encoder-decoder ({net.name}); this command takes "
                         "classifiers")
    from vitkit.tasks.classification.inference import require_classifier

    require_classifier(net, args.checkpoint or args.model)
    return net


def read_image(path: str, cfg, transform=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(model input (1, C, H, W) after the model's eval transform (or ``transform``), the same crop unnormalised in
    [0, 1])."""
    import torch
    from PIL import Image, UnidentifiedImageError

    from vitkit.data.transforms import eval_transform
    from vitkit.image_files import eight_bit

    try:
        img = eight_bit(Image.open(path)).convert("L" if cfg.in_chans == 1 else "RGB")
    except (OSError, UnidentifiedImageError) as e:
        raise UsageError(f"cannot read image {path!r}: {e}") from None
    x = (eval_transform(cfg) if transform is None else transform)(img)[None]
    mean = torch.tensor(cfg.mean[: cfg.in_chans]).view(-1, 1, 1)
    std = torch.tensor(cfg.std[: cfg.in_chans]).view(-1, 1, 1)
    return x, (x[0] * std + mean).clamp(0, 1)
