"""The loader benchmark: a tiny run times every loader and decoder, and both decoders give the same pixels."""

import csv
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("dataloader_bench", ROOT / "benchmarks" / "dataloader.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_smoke_run_writes_every_loader_and_decoder(tmp_path):
    out = tmp_path / "dl.csv"
    rows = bench.main(["--images", "24", "--workers", "0", "--rounds", "1", "--batch-size", "4", "--img-size", "32",
                       "--out", str(out)])
    assert {(r["loader"], r["decoder"]) for r in rows} == {(a, b) for a in ("imagefolder", "streaming")
                                                           for b in ("pil", "torchvision")}
    assert all(r["img_per_s"] > 0 and r["images"] == 24 - 4 for r in rows)  # every image after the first batch
    assert list(next(csv.DictReader(out.open()))) == bench.COLUMNS
    apart = re.search(r"at most (\d+) levels apart", out.with_suffix(".md").read_text())
    assert apart and int(apart.group(1)) <= 2  # libjpeg-turbo in both (0 on this project's machines)


def test_photos_look_like_imagenet_files(tmp_path):
    bench.write_photos(tmp_path, 6, classes=3)
    files = sorted((tmp_path / "train").rglob("*.jpg"))
    assert len(files) == 6 and len(list((tmp_path / "val").rglob("*.jpg"))) == 3
    from PIL import Image

    assert all(sorted(Image.open(f).size) == [375, 500] for f in files)
