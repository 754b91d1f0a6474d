"""A detector's int8 gate (the task protocol's ``int8_gate``): ``vitkit export --int8 --calibrate DIR`` of a detector
calibrates on, and scores fp32 against int8 by COCO's AP50:95 on, the images of a COCO, YOLO or VOC folder (its
``val`` split where it has one, else ``train``), letterboxed and normalised as the export's metadata says."""

from __future__ import annotations

import os

import numpy as np
import torch

from vitkit.deploy.quantize import Held, QuantizationRefused, enough_images, in_batches
from vitkit.errors import MissingFileError


class MeanAP:
    """COCO's AP50:95 of the held-out images (``vitkit.evaluation.detection``, as ``vitkit evaluate`` scores)."""

    metric, key, max_drop = "AP50:95", "mAP", 1.0

    def __init__(self, base) -> None:
        from .inference import OnnxDetector

        self.base, self.detector = base, OnnxDetector(base)

    def inputs(self, calibrate: str | os.PathLike, calibration: int, seed: int) -> tuple[np.ndarray, Held]:
        """The calibration inputs and the held-out images with their boxes (in their own pixels) and sizes."""
        from vitkit.data.modules.detection import DetectionDataModule
        from vitkit.data.transforms import device_batch
        from vitkit.models.detection import truths

        det = self.detector
        try:
            dm = DetectionDataModule(str(calibrate), img_size=det.size, mean=tuple(self.base.meta["mean"]),
                                     std=tuple(self.base.meta["std"]), num_workers=0)
        except MissingFileError as e:
            raise QuantizationRefused(f"--calibrate {calibrate}: a detector calibrates on a COCO, YOLO or VOC "
                                      f"folder with a val or a train split ({e})") from None
        if dm.classes != det.names:
            raise QuantizationRefused(f"--calibrate {calibrate} names {len(dm.classes)} classes "
                                      f"({', '.join(dm.classes[:5])}...), the model detects {len(det.names)} "
                                      f"({', '.join(det.names[:5])}...): calibrate on data of its own classes")
        split = dm.hparams.val if dm.has(dm.hparams.val) else dm.hparams.train
        ds = dm.split(split)
        enough_images(calibrate, len(ds), calibration, "AP gate", f" in its {split} split")
        order = np.random.default_rng(seed).permutation(len(ds)).tolist()
        images, targets = zip(*(ds[k] for k in order), strict=True)
        x = device_batch(torch.stack(images), dm.data_cfg).numpy()
        held = list(targets[calibration:])
        truth = (truths(held, det.size), [tuple(int(v) for v in t["size"]) for t in held])
        return x[:calibration], Held(x[calibration:], truth, len(held))

    def score(self, model, held: Held) -> float:
        """AP50:95 of ``model`` (an ``OnnxModel`` of the detector) on the held-out images."""
        from vitkit.evaluation.detection import average_precision

        truth, sizes = held.truth
        metric, start = average_precision(), 0
        for x in in_batches(held.x, 16):
            found = self.detector.found(tuple(model.outputs(x)), sizes[start:start + len(x)])
            metric.update(found, truth[start:start + len(x)])
            start += len(x)
        return float(metric.compute()["map"])
