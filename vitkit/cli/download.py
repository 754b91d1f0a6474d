"""``vitkit download``: pretrained weights (the Hugging Face cache, or torch hub's) or Hugging Face datasets (the
datasets cache, which training reads offline), fetched by name for offline use."""

from __future__ import annotations

import sys

from .common import command_parser


def parser():
    p = command_parser("download")
    p.add_argument("names", nargs="+", help="timm tags (vit_small_patch16_224.augreg_in21k_ft_in1k, or any timm "
                                            "model's, as a teacher's: regnety_160.deit_in1k), torchvision weights "
                                            "(Swin_T_Weights.IMAGENET1K_V1) or hf-hub:REPO; with --dataset, "
                                            "Hugging Face dataset names")
    p.add_argument("--dataset", action="store_true", help="the names are datasets (beans, timm/mini-imagenet), "
                                                          "fetched into HF_DATASETS_CACHE for --data.name")
    p.add_argument("--config-name", default=None, help="with --dataset: the dataset's configuration")
    p.add_argument("--revision", default=None, help="with --dataset: a branch, tag or commit")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.dataset:
        return _datasets(args)
    from vitkit.checkpoints.hub import MissingWeightsError, resolve

    failed = 0
    for name in args.names:
        try:
            source = resolve(name, any_architecture=True)
            path = source.cached()
            state = "already cached"
            if path is None:
                path, state = source.download(), "downloaded"
        except (MissingWeightsError, ValueError) as e:
            print(f"{name}: error: {e}", file=sys.stderr)
            failed += 1
            continue
        print(f"{source.name}: {state}: {path}")
    return 1 if failed else 0


def _datasets(args) -> int:
    from vitkit.data.hf import cache_dir, download
    from vitkit.errors import one_line

    failed = 0
    for name in args.names:
        try:
            rows = download(name, args.config_name, args.revision)
        except Exception as e:  # noqa: BLE001 - the datasets library's own errors (network, no such dataset)
            print(f"{name}: {one_line(e)}", file=sys.stderr)
            failed += 1
            continue
        print(f"{name}: in {cache_dir()}: " + ", ".join(f"{k} {v} rows" for k, v in rows.items()))
    return 1 if failed else 0
