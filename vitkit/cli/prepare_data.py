"""``vitkit prepare-data``: ImageNet-layout folders, manifests or Hugging Face datasets -> litdata shards,
resumable."""

from __future__ import annotations

from pathlib import Path

from vitkit.errors import UsageError

from .common import command_parser


def parser():
    p = command_parser("prepare-data")
    p.add_argument("root", help="a folder with train/<class>/<images>, val/<class>/<images> and optionally test/; "
                   "or with train.csv and val.csv manifests (or .jsonl; optionally test), one label or several per "
                   "image; or a Hugging Face dataset: a folder written by save_to_disk, or hf:NAME (in the datasets "
                   "cache); or images with masks: images/<split>/ beside masks/<split>/, or --layout")
    p.add_argument("out", help="the output folder; run again on it to resume an interrupted conversion")
    p.add_argument("--workers", type=int, default=None, help="parallel workers (default: every CPU)")
    p.add_argument("--chunk-bytes", default="64MB", help="size of a shard file (default: 64MB)")
    p.add_argument("--overwrite", action="store_true", help="delete OUT and convert from the start")
    p.add_argument("--image-column", default=None, help="a Hugging Face dataset's image column (default: its one "
                   "Image column)")
    p.add_argument("--label-column", default=None, help="a Hugging Face dataset's label column (default: its one "
                   "ClassLabel, or list of ClassLabels, column)")
    p.add_argument("--layout", default=None, choices=("folder", "ade20k", "voc", "cityscapes"),
                   help="images with masks in this layout (vitkit/data/segmentation.py; default: folder where ROOT "
                   "holds images/ and masks/), for StreamingSegmentationDataModule")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random order each split is written in (default: 0)")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    import logging

    from vitkit.data.shards import MARKER, prepare_data

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        summary = prepare_data(args.root, args.out, workers=args.workers, chunk_bytes=args.chunk_bytes,
                               overwrite=args.overwrite, seed=args.seed, image_column=args.image_column,
                               label_column=args.label_column, layout=args.layout)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        raise UsageError(f"{e}") from None
    for split, n in summary["splits"].items():
        print(f"{split}: {n['samples']} samples, {n['skipped']} unreadable file(s) left out")
    what = f"images with masks ({summary['layout']})" if summary.get("masks") else f"{len(summary['classes'])} classes"
    print(f"{what}; {Path(args.out) / MARKER} written: the dataset is complete")
    return 0
