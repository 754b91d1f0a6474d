"""``vitkit serve``: every kind of model file answers what ``vitkit predict`` says of the same image (the server's
model code, ``vitkit.serving.api.VitkitAPI``, against the predict command's predictor, within 1e-5); a real server
answers over HTTP in every request form, refuses bad input with one line and goes on, asks for its key, counts its
requests, describes its API, and stops cleanly on SIGTERM; a file it cannot serve refuses to start in one line."""

import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

import vitkit
from tests.commands import run_cli
from vitkit.serving.api import VitkitAPI
from vitkit.serving.model import load_predictor, source_of

TINY = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, crop_pct=1.0)
CHROMIUM = "/usr/bin/chromium"  # Debian's (`.ci/run` installs it); Playwright's own download is not reachable
BROWSER_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
NAMES = ["zero", "one", "two"]


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _photo(seed: int = 0, size: tuple[int, int] = (48, 40)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """One classifier file of each kind vitkit serves: a saved folder and its ONNX export (plain and --packed), a
    multi-label folder and its export, a checkpoint, int8 ONNX and .pt2; and the page's segmenter checkpoint (every
    task's checkpoint and export through the server: tests/test_task_contract.py)."""
    root = tmp_path_factory.mktemp("served")
    torch.manual_seed(0)
    net = vitkit.create_model("vit_tiny_patch16_224", num_classes=3, dynamic_img_size=True, **TINY).eval()
    out = {"folder": vitkit.save_pretrained(net, root / "folder", class_names=NAMES)}
    multi = vitkit.create_model("vit_tiny_patch16_224", num_classes=3, **TINY).eval()
    multi.thresholds = [0.3, 0.5, 0.7]
    out["multi"] = vitkit.save_pretrained(multi, root / "multi", class_names=NAMES)
    from tests.tasks.segmentation_digits import write_digit_masks
    from vitkit.cli import main as vitkit_main
    from vitkit.cli.train import cli_main

    for name, src, extra in (("onnx", "folder", []), ("packed", "folder", ["--packed"]), ("multi_onnx", "multi", [])):
        assert vitkit_main(["export", str(out[src]), "-o", str(root / f"{name}.onnx"), *extra]) == 0
        out[name] = root / f"{name}.onnx"

    masks = write_digit_masks(root / "masks", train=8, val=4, size=32, glyph_size=16)
    overrides = json.dumps({k: v for k, v in TINY.items() if k not in ("img_size", "crop_pct")})
    cli_main(["fit", "-c", "seg_linear_probe", "--model.model_name", "vit_tiny_patch16_224", "--model.model_overrides",
              overrides, "--data.root", str(masks), "--data.img_size", "32", "--data.batch_size", "4",
              "--data.num_workers", "0", "--trainer.max_steps", "1", "--trainer.accelerator", "cpu",
              "--trainer.devices", "1", "--trainer.precision", "32-true", "--trainer.logger", "false",
              "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(root / "seg_run")])
    out["seg"] = root / "seg_run" / "checkpoints" / "last.ckpt"  # the page's segmenter
    cli_main(["fit", "-c", "vit_tiny_digits", "--model.model_overrides", json.dumps({"depth": 1}),
              "--trainer.max_steps", "1", "--trainer.accelerator", "cpu", "--trainer.logger", "false",
              "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(root / "cls_run")])
    out["ckpt"] = root / "cls_run" / "checkpoints" / "last.ckpt"
    rng = np.random.default_rng(0)
    for i in range(120):  # labelled images to calibrate the int8 files on (and to score them: the gate is lifted)
        (root / "cal" / NAMES[i % 3]).mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / "cal" / NAMES[i % 3] / f"{i}.png")
    for name, src, extra in (("int8", out["onnx"], []), ("pt2", out["folder"], ["--format", "torch-export"])):
        out[name] = root / ("model.int8.onnx" if name == "int8" else "model.int8.pt2")
        assert vitkit_main(["export", str(src), "--int8", "--calibrate", str(root / "cal"), "--calibration-size",
                            "20", "--max-drop", "100", "-o", str(out[name]), *extra]) == 0
    return out


def _served(path: Path, options: dict, images: list[Image.Image], fmt: str = "json") -> dict:
    """What the server's model code answers for ``images`` in one request (decode, predict, encode)."""
    api = VitkitAPI(source_of(str(path), False), options, threads=1)
    api.setup("cpu")
    request = api.decode_request({"images": [base64.b64encode(_png(i)).decode() for i in images], "format": fmt})
    return api.encode_response(api.predict(request))


@pytest.mark.parametrize("kind", ["folder", "ckpt", "onnx", "packed", "int8", "pt2", "multi", "multi_onnx"])
def test_the_server_answers_what_predict_says_for_every_kind_of_model(files, kind):
    options = {"topk": 3, "max_patches": None, "mode": "whole"}
    images = [_photo(0), _photo(1, (24, 64))]  # two shapes in one request: a packed file batches them together
    answer = _served(files[kind], options, images)
    predictor, task = load_predictor(source_of(str(files[kind]), False), options)
    for image, served in zip(images, answer["predictions"], strict=True):
        expected = predictor.result(image, predictor.run([predictor.prepare(image)])[0], options)
        assert [t["label"] for t in served["top"]] == [t["label"] for t in expected.record["top"]]
        np.testing.assert_allclose([t["probability"] for t in served["top"]],
                                   [t["probability"] for t in expected.record["top"]], atol=1e-5)
        assert ("labels" in served) == kind.startswith("multi")
    assert answer["ms"] >= 0


def test_a_timm_name_with_pretrained_weights_is_served_as_predict_runs_it(tmp_path, monkeypatch):
    """``vitkit serve NAME --pretrained``: the weights from the hub cache (written here, random), offline."""
    import timm

    from tests.hub_cache import cache_weights, use_offline_cache

    tag = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"
    use_offline_cache(monkeypatch, tmp_path / "hf")
    torch.manual_seed(0)
    cache_weights(tmp_path / "hf", tag, timm.create_model(tag.split(".")[0], num_classes=1000), tmp_path)
    options = {"topk": 5, "max_patches": None, "mode": "whole"}
    api = VitkitAPI(source_of(tag, True), options, threads=1)
    api.setup("cpu")
    image = _photo(0, (240, 320))
    answer = api.encode_response(api.predict(api.decode_request({"images": [base64.b64encode(_png(image)).decode()]})))
    predictor, _ = load_predictor(("name", tag), options)
    expected = predictor.result(image, predictor.run([predictor.prepare(image)])[0], options).record
    assert [t["label"] for t in answer["predictions"][0]["top"]] == [t["label"] for t in expected["top"]]
    np.testing.assert_allclose([t["probability"] for t in answer["predictions"][0]["top"]],
                               [t["probability"] for t in expected["top"]], atol=1e-5)
    assert expected["top"][0]["label"][0].isalpha()  # ImageNet's names, from the tag


def test_a_segmenter_answers_its_overlay_and_a_classifier_refuses_to(files):
    overlay = _served(files["seg"], {"mode": "whole"}, [_photo(0)], fmt="overlay")
    assert overlay.media_type == "image/png" and Image.open(io.BytesIO(overlay.body)).size == (40, 48)
    refused = _served(files["onnx"], {"topk": 3}, [_photo(0)], fmt="overlay")
    assert refused.status_code == 400
    assert "format=overlay draws a segmenter's mask or a detector's boxes" in json.loads(refused.body)["detail"]


def test_a_refused_request_in_a_batch_leaves_its_batch_mates_answered(files):
    """LitServe answers a whole batch with the error a hook raises: a bad image batched with good ones gets its 4xx
    alone, and the good ones their predictions."""
    api = VitkitAPI(source_of(str(files["onnx"]), False), {"topk": 3}, threads=1)
    api.setup("cpu")
    good = {"images": [base64.b64encode(_png(_photo(0))).decode()]}
    requests = [api.decode_request(r) for r in (good, {"images": [base64.b64encode(b"not an image").decode()]},
                                                {"images": ["***"]}, good)]
    answers = [api.encode_response(a) for a in api.unbatch(api.predict(api.batch(requests)))]
    assert [getattr(a, "status_code", 200) for a in answers] == [200, 415, 400, 200]
    assert answers[0]["predictions"] == answers[3]["predictions"] and len(answers[0]["predictions"][0]["top"]) == 3
    assert "not an image file" in json.loads(answers[1].body)["detail"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(model: Path, *flags: str, env: dict | None = None):
    """``vitkit serve MODEL`` in a process of its own, ready (``/health``); stopped by SIGTERM, which it must answer
    by exiting 0."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "vitkit.cli", "serve", str(model), "--port", str(port), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise AssertionError(proc.stderr.read()[-3000:])
            time.sleep(0.5)
        else:
            raise AssertionError("the server was not ready in 120 s")
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.mark.slow
def test_a_served_classifier_over_http(files, tmp_path):
    """Every request form, one image or several; bad input of every kind gets a 4xx and one line, and the next
    good request is answered; the key guards all but /health; /metrics counts; /openapi.json describes /predict;
    a request in flight when SIGTERM comes is answered, and the server exits 0."""
    good = _png(_photo(0))
    with serving(files["onnx"], "--api-key", "sesame", "--max-body-mb", "8", "--batch-timeout", "0.2") as (url, proc):
        key = {"X-API-Key": "sesame"}
        assert httpx.get(f"{url}/health").status_code == 200  # no key needed
        assert httpx.post(f"{url}/predict", content=good, headers={"Content-Type": "image/png"}).status_code == 401
        assert httpx.get(f"{url}/metrics").status_code == 401 and httpx.get(f"{url}/").status_code == 401
        raw = httpx.post(f"{url}/predict", content=good, headers={**key, "Content-Type": "image/png"}).json()
        upload = httpx.post(f"{url}/predict", files=[("file", ("a.png", good)), ("file", ("b.png", good))],
                            headers=key).json()
        by_json = httpx.post(f"{url}/predict", json={"images": [base64.b64encode(good).decode()]}, headers=key).json()
        assert raw["predictions"][0] == upload["predictions"][0] == upload["predictions"][1] \
            == by_json["predictions"][0]
        jpeg = io.BytesIO()
        _photo(2, (400, 300)).save(jpeg, format="JPEG")
        bomb = io.BytesIO()
        Image.new("1", (20000, 20000)).save(bomb, format="PNG")
        bad = [(b"", "image/png", 400, "empty"), (b"not an image at all", "image/jpeg", 415, "not an image file"),
               (jpeg.getvalue()[: len(jpeg.getvalue()) // 2], "image/jpeg", 400, "truncated or damaged"),
               (bomb.getvalue(), "image/png", 413, "400,000,000 pixels"),
               (b"x" * (9 * 2**20), "image/png", 413, "--max-body-mb"),
               (good, "text/plain", 415, "got text/plain")]
        for body, kind, status, says in bad:
            answer = httpx.post(f"{url}/predict", content=body, headers={**key, "Content-Type": kind})
            assert answer.status_code == status and says in answer.json()["detail"], (kind, answer.text)
            assert "\n" not in answer.json()["detail"] and "Traceback" not in answer.text
        grey = _photo(0).convert("L")  # a 16-bit grey PNG is scaled to 8 bits (Pillow's convert would clip it white)
        sixteen = io.BytesIO()
        Image.fromarray(np.asarray(grey, dtype=np.uint16) * 257).save(sixteen, format="PNG")
        assert Image.open(io.BytesIO(sixteen.getvalue())).mode.startswith("I")
        as_grey = httpx.post(f"{url}/predict", content=_png(grey), headers={**key, "Content-Type": "image/png"}).json()
        as_16 = httpx.post(f"{url}/predict", content=sixteen.getvalue(), headers={
            **key, "Content-Type": "image/png"}).json()
        assert as_16["predictions"] == as_grey["predictions"]
        text = base64.encodebytes(good).decode()  # base64 with line breaks, and a data URL, as tools write them
        for form in (text, "data:image/png;base64," + base64.b64encode(good).decode()):
            assert httpx.post(f"{url}/predict", json={"image": form}, headers=key).json()["predictions"] == \
                raw["predictions"]
        assert httpx.post(f"{url}/predict", content=good, headers={"Authorization": "bearer sesame",
                                                                    "Content-Type": "image/png"}).status_code == 200
        tiny = base64.b64encode(_png(Image.new("RGB", (1, 1)))).decode()
        for body, status, says in (({"images": [tiny] * 65}, 413, "--max-images"),  # many tiny images in a small
                                   ({"image": tiny, "images": [tiny]}, 400, "one of the two")):  # request: refused
            answer = httpx.post(f"{url}/predict", json=body, headers=key)
            assert answer.status_code == status and says in answer.json()["detail"], answer.text
        answer = httpx.post(f"{url}/predict", files=[("file", (f"{i}.png", _png(Image.new("RGB", (1, 1)))))
                                                     for i in range(70)], headers=key)
        assert answer.status_code == 413 and "--max-images" in answer.json()["detail"]
        half = io.BytesIO()
        Image.new("1", (5000, 6000)).save(half, format="PNG")  # 30 million pixels: one is served, two are too many
        halves = {"images": [base64.b64encode(half.getvalue()).decode()] * 2}
        answer = httpx.post(f"{url}/predict", json=halves, headers=key)
        assert answer.status_code == 413 and "image 1 brings the request's images to 60,000,000" in answer.text
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(3) as pool:  # batched together (--batch-timeout 0.2): the bad one is answered alone
            together = list(pool.map(lambda body: httpx.post(f"{url}/predict", content=body, timeout=30, headers={
                **key, "Content-Type": "image/png"}), [good, b"not an image at all", good]))
        assert [a.status_code for a in together] == [200, 415, 200]
        assert together[0].json()["predictions"] == together[2].json()["predictions"] == raw["predictions"]
        answer = httpx.post(f"{url}/predict?format=overlay", content=good, headers={**key, "Content-Type": "image/png"})
        assert answer.status_code == 400 and "segmenter" in answer.json()["detail"]
        answer = httpx.post(f"{url}/predict", files={"file": ("a.png", good)}, data={"format": "overlay"}, headers=key)
        assert answer.status_code == 400 and "segmenter" in answer.json()["detail"]  # a form's format field is read
        assert httpx.post(f"{url}/predict", content=good, headers={**key, "Content-Type": "image/png"}).json() == \
            {**raw, "ms": pytest.approx(raw["ms"], abs=1e9)}  # still answering
        metrics = httpx.get(f"{url}/metrics", headers=key).text
        assert 'vitkit_requests_total{path="/predict",method="POST",status="200"}' in metrics
        assert 'vitkit_request_seconds_bucket{path="/predict",method="POST",le="+Inf"}' in metrics
        assert httpx.get(f"{url}/info", headers=key).json()["model"] == {"model": files["onnx"].name,
                                                                          "task": "classification"}
        spec = httpx.get(f"{url}/openapi.json", headers=key).json()
        assert set(spec["paths"]["/predict"]["post"]["requestBody"]["content"]) >= {"multipart/form-data",
                                                                                    "application/json"}
        from sklearn.datasets import load_sample_image

        photo = io.BytesIO()
        Image.fromarray(load_sample_image("china.jpg")).save(photo, format="JPEG", quality=90)  # 427x640, ~80 kB
        many = {"images": [base64.b64encode(photo.getvalue()).decode()] * 40}  # seconds of decoding, under 8 MiB
        import threading

        answers, stopped = [], []
        slow = threading.Thread(target=lambda: answers.append((httpx.post(f"{url}/predict", json=many, headers=key,
                                                                          timeout=60), time.perf_counter())))
        slow.start()
        time.sleep(0.2)
        stopped.append(time.perf_counter())
        proc.send_signal(signal.SIGTERM)
        slow.join(60)
        answer, answered = answers[0]
        assert answer.status_code == 200 and len(answer.json()["predictions"]) == 40
        assert answered > stopped[0]  # in flight when the signal came, and answered
        assert proc.wait(timeout=60) == 0


def test_a_file_it_cannot_serve_refuses_to_start_in_one_line(tmp_path, capsys):
    (tmp_path / "broken.onnx").write_bytes(b"\x08\x01garbage")
    status, err = run_cli(["serve", str(tmp_path / "broken.onnx")], capsys)
    assert status == 1 and err.count("error:") == 1 and "Traceback" not in err
    assert err.startswith("error: cannot serve ") and "broken.onnx is not an ONNX model onnxruntime can load" in err
    assert "'" not in err  # the loader's line as it is, not its repr
    status, err = run_cli(["serve", str(tmp_path / "nowhere.ckpt")], capsys)
    assert status == 1 and "is not a file or folder" in err
    status, err = run_cli(["serve", "x.onnx", "--workers", "0"], capsys)
    assert status == 1 and "--workers expects 1 or more" in err
    import onnx  # an ONNX file vitkit export did not write: no preprocessing recorded, refused before it listens
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 8, 8])
    onnx.save(helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])),
              tmp_path / "foreign.onnx")
    status, err = run_cli(["serve", str(tmp_path / "foreign.onnx")], capsys)
    assert status == 1 and err.count("\n") == 1 and "has no vitkit.input_size metadata" in err

    with socket.socket() as held:  # a port another process listens on
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        status, err = run_cli(["serve", str(tmp_path / "foreign.onnx"), "--port", str(port)], capsys)
    assert status == 1 and f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err


@pytest.mark.slow
def test_the_page_classifies_an_uploaded_photo_in_a_real_browser(files, tmp_path):
    """The page at ``/``, in Debian's Chromium driven by Playwright: a real photo chosen in its file input comes back
    as bars of the server's top-k (the same labels and probabilities as ``/predict``) and the time it took; for a
    segmenter, the mask over the image. The browser loads nothing from another host. ``VITKIT_SCREENSHOTS=docs/images``
    keeps its screenshots for the manual."""
    from playwright.sync_api import sync_playwright
    from sklearn.datasets import load_sample_image

    photo = tmp_path / "china.jpg"
    Image.fromarray(load_sample_image("china.jpg")).save(photo, quality=90)
    outside = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=BROWSER_FLAGS)
        try:
            for model in ("onnx", "seg"):
                with serving(files[model]) as (url, _):
                    page = browser.new_page(viewport={"width": 960, "height": 720})
                    page.on("request", lambda r, url=url: None if r.url.startswith((url, "blob:", "data:")) else
                            outside.append(r.url))
                    page.goto(f"{url}/")
                    page.set_input_files("#file", str(photo))
                    page.wait_for_selector("#time:has-text('the server took')", timeout=60_000)
                    bars = page.eval_on_selector_all(".bar", "rows => rows.map(r => [r.dataset.label, "
                                                               "Number(r.dataset.value)])")
                    answer = httpx.post(f"{url}/predict", files=[("file", ("china.jpg", photo.read_bytes()))]).json()
                    p = answer["predictions"][0]
                    expected = [(c["label"], c["share"]) for c in p["classes"][:8]] if model == "seg" else \
                        [(t["label"], t["probability"]) for t in p["top"]]
                    assert [b[0] for b in bars] == [e[0] for e in expected], (bars, expected)
                    np.testing.assert_allclose([b[1] for b in bars], [e[1] for e in expected], atol=1e-6)
                    if model == "seg":
                        page.wait_for_selector("#overlay:not([hidden])", timeout=60_000)
                    shots = Path(os.environ.get("VITKIT_SCREENSHOTS") or tmp_path)  # docs/images: the manual's
                    page.screenshot(path=str(shots / f"serve_page_{model}.png"))
        finally:
            browser.close()
    assert not outside, outside
