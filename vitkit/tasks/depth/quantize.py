"""A depth model's int8 gate (the task protocol's ``int8_gate``): ``vitkit export --int8 --calibrate DIR`` of a depth
model calibrates on, and scores fp32 against int8 by AbsRel on, the images of a depth folder (its ``val`` split
where it has one, else ``train``), resized and normalised as the export's metadata says; the file is written when
int8's AbsRel is at most ``--max-drop`` percent worse than fp32's (5 by default)."""

from __future__ import annotations

import os

import numpy as np
import torch

from vitkit.deploy.quantize import Held, QuantizationRefused, enough_images, in_batches
from vitkit.errors import MissingFileError


class AbsRel:
    """Eigen's AbsRel of the held-out images at their own sizes, a relative model's output aligned first (as
    ``vitkit evaluate`` scores a depth model); lower is better, and the drop is in percent of fp32's."""

    metric, key, max_drop, lower_better = "AbsRel", "AbsRel", 5.0, True
    # int8 too: the DPT head's convolutions, at up to the image's size, and the attention's products over many tokens
    layers = ("linear", "convolution", "attention")

    def __init__(self, base) -> None:
        self.base = base
        depth = base.meta.get("depth") or {}
        self.kind, self.max_depth = depth.get("kind", "relative"), depth.get("max_depth")
        self.size = int(base.meta["input_size"][1])

    def inputs(self, calibrate: str | os.PathLike, calibration: int, seed: int) -> tuple[np.ndarray, Held]:
        """The calibration inputs and the held-out images with their depth maps."""
        from vitkit.data.modules.depth import DepthDataModule
        from vitkit.data.transforms import device_batch

        try:
            dm = DepthDataModule(str(calibrate), img_size=self.size, mean=tuple(self.base.meta["mean"]),
                                 std=tuple(self.base.meta["std"]), max_depth=self.max_depth, num_workers=0)
            split = dm.hparams.val if dm.has(dm.hparams.val) else dm.hparams.train
            ds = dm.split(split)
        except MissingFileError as e:
            raise QuantizationRefused(f"--calibrate {calibrate}: a depth model calibrates on a folder of images/ "
                                      f"beside depth/ with a val or a train split ({e})") from None
        enough_images(calibrate, len(ds), calibration, "AbsRel gate", f" in its {split} split")
        order = np.random.default_rng(seed).permutation(len(ds)).tolist()
        images, maps = zip(*(ds[k] for k in order), strict=True)
        x = device_batch(torch.stack(images), dm.data_cfg).numpy()
        return x[:calibration], Held(x[calibration:], list(maps[calibration:]), len(maps) - calibration)

    def score(self, model, held: Held) -> float:
        """AbsRel of ``model`` (an ``OnnxModel`` of the depth model) on the held-out images."""
        from vitkit.evaluation.depth import DepthMetrics, scored

        metric, start = DepthMetrics(), 0
        for x in in_batches(held.x, 16):
            for pred, depth in zip(np.asarray(model(x)), held.truth[start:start + len(x)], strict=True):
                p, valid = scored(torch.from_numpy(pred).float(), depth.float(), self.kind, self.max_depth)
                metric.update(p[None], depth[None].float(), valid[None])
            start += len(x)
        return float(metric.compute()["AbsRel"])
