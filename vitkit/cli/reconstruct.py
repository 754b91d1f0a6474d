"""``vitkit reconstruct``: a masked-image model's original / masked / reconstruction grid for image files."""

from __future__ import annotations

import dataclasses

from .common import OVERRIDES, command_parser, parse_overrides, read_image


def parser():
    p = command_parser("reconstruct")
    p.add_argument("images", nargs="+")
    p.add_argument("--checkpoint", required=True, help="a pre-training run's checkpoint, Meta's mae_visualize_* file "
                                                       "or a transformers ViTMAE / MaskedImageModeling folder")
    p.add_argument("--model", help="the encoder preset, for files that do not record it")
    p.add_argument("--objective", choices=["mae", "simmim"], help="for files that do not record it")
    p.add_argument("--mask-ratio", type=float, help="hide this fraction (default: the checkpoint's)")
    p.add_argument("--overrides", default="{}", help=OVERRIDES)
    p.add_argument("--seed", type=int, default=0, help="seed of the mask")
    p.add_argument("-o", "--output", default="reconstruction.png")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    import torch

    import vitkit
    from vitkit.evaluation.plots import draw_reconstructions

    mim = {"mask_ratio": args.mask_ratio} if args.mask_ratio is not None else {}
    net = vitkit.create_mim(args.model, checkpoint=args.checkpoint, objective=args.objective, mim=mim,
                            **parse_overrides(args.overrides)).eval()
    cfg = net.encoder.cfg
    x = torch.cat([read_image(path, cfg)[0] for path in args.images])
    torch.manual_seed(args.seed)
    print(draw_reconstructions(net, x, None, cfg.mean, cfg.std, args.output,
                               f"{net.cfg.__class__.__name__.removesuffix('Config')}: {described(net.encoder)}"))
    return 0


def described(model) -> str:
    """A model's preset and the sizes it changed (``vit_tiny_patch16_224, patch 4, 32 px``): a preset name alone
    would name the preset's own patch and image size."""
    from vitkit.models.registry import preset_config

    cfg, preset = dataclasses.asdict(model.cfg), dataclasses.asdict(preset_config(model.name))
    shown = {"patch_size": "patch {}", "img_size": "{} px", "embed_dim": "width {}", "depth": "depth {}",
             "depths": "depths {}", "window_size": "window {}"}
    changed = [form.format(cfg[k] if not isinstance(cfg[k], (list, tuple)) or len(set(cfg[k])) > 1 else cfg[k][0])
               for k, form in shown.items() if k in cfg and cfg[k] != preset[k]]
    return ", ".join([model.name, *changed])
