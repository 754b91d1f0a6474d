"""The model behind ``vitkit serve``: a LitServe ``LitAPI`` over a task's predictor (``vitkit.tasks.protocol``), the
same preparation and outputs as ``vitkit predict``. LitServe runs it in its worker processes, batching requests
(``--max-batch-size``, ``--batch-timeout``); each request holds one image or several, checked as they are decoded.
A request refused there is answered alone: LitServe answers a whole batch with the error a hook raises, so the
hooks carry a refusal to ``encode_response`` as a value instead, and its batch-mates are answered as usual."""

from __future__ import annotations

import base64
import binascii
import io
import os
import time
from typing import Any

import litserve as ls
from fastapi import HTTPException

MAX_PIXELS = 50_000_000  # a request's images above this many pixels together are refused from their headers (a
# decompression bomb, or thousands of images in one small request)


def from_base64(text: str) -> bytes:
    """An image's base64 text as JSON requests carry it: standard or URL-safe, with or without line breaks and
    padding, or a data URL (``data:image/png;base64,...``)."""
    if text.startswith("data:") and ";base64," in text[:100]:
        text = text.split(",", 1)[1]
    text = "".join(text.split())
    text += "=" * (-len(text) % 4)
    if "-" in text or "_" in text:
        return base64.urlsafe_b64decode(text.encode("ascii"))
    return base64.b64decode(text, validate=True)


def decode_image(data: bytes, where: str, max_pixels: int = MAX_PIXELS, before: int = 0):
    """Bytes of an image file -> the decoded PIL image, or an HTTP 4xx that names what is wrong with it (``where``:
    which file of the request): empty, not an image, too many pixels with the request's images ``before`` it (read
    from the header, before any decoding), or truncated or damaged."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise HTTPException(400, f"{where} is empty (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data))  # the header alone: its size is checked below, before decoding
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise HTTPException(415, f"{where} is not an image file Pillow reads ({type(e).__name__}); send a JPEG, PNG, "
                            "WebP, BMP or TIFF file") from None
    width, height = image.size
    if width * height > max_pixels:
        raise HTTPException(413, f"{where} is {width}x{height} = {width * height:,} pixels, above the "
                            f"{max_pixels:,} the server decodes")
    if before + width * height > max_pixels:
        raise HTTPException(413, f"{where} brings the request's images to {before + width * height:,} pixels, above "
                            f"the {max_pixels:,} the server decodes for one request: send fewer at a time")
    try:
        image.load()
    except Exception as e:  # noqa: BLE001 - Pillow's errors for a truncated or damaged file vary by format
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HTTPException(400, f"{where} does not decode ({text}): truncated or damaged") from None
    from vitkit.image_files import eight_bit

    return eight_bit(image)


class VitkitAPI(ls.LitAPI):
    """A model file's task predictor, served. ``source`` is what ``vitkit predict`` reads (``("onnx", path)``,
    ``("program", path)``, ``("checkpoint", path)`` or ``("name", tag)``), ``options`` the predictor's (top-k,
    budget, mode), ``threads`` the intra-op threads of each worker (the cores over the workers: more workers never
    oversubscribe the CPU)."""

    def __init__(self, source: tuple[str, str], options: dict[str, Any], threads: int, max_pixels: int = MAX_PIXELS,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.source, self.options, self.threads, self.max_pixels = source, options, threads, max_pixels

    def setup(self, device: str) -> None:
        from PIL import Image

        from .model import load_predictor

        Image.MAX_IMAGE_PIXELS = None  # decode_image checks each size against the server's own limit, from the header

        os.environ["OMP_NUM_THREADS"] = str(self.threads)  # onnxruntime and oneDNN read it when they start
        self.predictor, self.task = load_predictor(self.source, self.options, self.threads)
        blank = Image.new("RGB", (64, 64), (128, 128, 128))  # the first call compiles or plans: before /health is ok
        self.predictor.run([self.predictor.prepare(blank)])

    def decode_request(self, request: dict, **kwargs: Any) -> dict:
        try:
            return self._decode(request)
        except HTTPException as e:  # this request's answer, not its batch's
            return {"refused": e}

    def _decode(self, request: dict) -> dict:
        images = request.get("images") if isinstance(request, dict) else None
        if not isinstance(images, list) or not images:
            raise HTTPException(400, "the request holds no image")
        decoded, pixels = [], 0
        for i, text in enumerate(images):
            try:
                data = from_base64(text)
            except (binascii.Error, ValueError, TypeError):
                raise HTTPException(400, f"image {i} is not base64 (JSON requests carry each image base64-encoded)") \
                    from None
            decoded.append(decode_image(data, "the image" if len(images) == 1 else f"image {i}", self.max_pixels,
                                        pixels))
            pixels += decoded[-1].width * decoded[-1].height
        fmt = request.get("format") or "json"
        if fmt not in ("json", "overlay"):
            raise HTTPException(400, f"format must be json or overlay, got {fmt!r}")
        if fmt == "overlay" and not getattr(self.predictor, "draws_overlay", False):
            raise HTTPException(400, f"format=overlay draws a segmenter's mask or a detector's boxes over the image, "
                                f"or a depth model's coloured map; "
                                f"this model is a {self.task} model")
        if fmt == "overlay" and len(decoded) != 1:
            raise HTTPException(400, "format=overlay answers one image: send one")
        return {"images": decoded, "format": fmt, "start": time.perf_counter()}

    def batch(self, inputs: list[dict]) -> list[dict]:
        return inputs  # requests of one image or several; predict runs them as one batch of images

    def predict(self, requests: list[dict] | dict, **kwargs: Any) -> list[dict] | dict:
        single = isinstance(requests, dict)
        requests = [requests] if single else requests
        images = [image for r in requests if "refused" not in r for image in r["images"]]
        chunk = max(1, self.max_batch_size)  # a request of many images runs as batches of --max-batch-size
        outputs = [out for i in range(0, len(images), chunk)
                   for out in self.predictor.run([self.predictor.prepare(image) for image in images[i:i + chunk]])]
        answers, k = [], 0
        for r in requests:
            if "refused" in r:
                answers.append(r)
                continue
            n = len(r["images"])
            results = [self.predictor.result(image, out, self.options)
                       for image, out in zip(r["images"], outputs[k:k + n], strict=True)]
            answers.append({"results": results, "format": r["format"],
                            "ms": round(1000 * (time.perf_counter() - r["start"]), 2)})
            k += n
        return answers[0] if single else answers

    def unbatch(self, output: list[dict]) -> list[dict]:
        return output

    def encode_response(self, output: dict, **kwargs: Any):
        from fastapi import Response
        from fastapi.responses import JSONResponse

        if "refused" in output:
            return JSONResponse({"detail": output["refused"].detail}, status_code=output["refused"].status_code)
        if output["format"] == "overlay":
            drawn = getattr(self.predictor, "overlay_file", "_overlay.png")
            return Response(output["results"][0].files[drawn], media_type="image/png",
                            headers={"X-Vitkit-Ms": str(output["ms"])})
        predictions = []
        for result in output["results"]:
            record = dict(result.record)
            for suffix, key in getattr(self.predictor, "served_files", {}).items():  # a mask, a depth map
                if suffix in result.files:
                    record[key] = base64.b64encode(result.files[suffix]).decode()
            predictions.append(record)
        return {"predictions": predictions, "ms": output["ms"]}
