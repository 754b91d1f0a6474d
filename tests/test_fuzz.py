"""Property tests (hypothesis): the attention backends agree on any shapes and masks, Swin takes any
input size, bad inputs get named errors, and no byte string makes the checkpoint loader crash (damaged copies of
valid files of every format: ``test_damaged_checkpoints.py``) or the manifest reader, and any text a request sends
as an image is decoded or refused with a 4xx by ``vitkit serve``.

How many examples each draws comes from the hypothesis profile (tests/conftest.py): 25, derandomized in
CI; `pytest -m fuzz` draws 2,000 each."""

import base64
import json

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from PIL import Image
from torch.testing import assert_close

import vitkit
from vitkit.checkpoints import CheckpointError
from vitkit.data.detection import coco, yolo
from vitkit.errors import UsageError
from vitkit.layers import Attention, CrossAttention

pytestmark = pytest.mark.fuzz


@given(B=st.integers(1, 3), N=st.integers(1, 17), M=st.integers(1, 17), heads=st.sampled_from([(2, 2), (4, 2), (4, 1)]),
       head_dim=st.sampled_from([8, 16]), cross=st.booleans(), causal=st.booleans(), use_bias=st.booleans(),
       use_mask=st.booleans(), pad=st.booleans(), empty_rows=st.booleans(), seed=st.integers(0, 2**16))
def test_sdpa_matches_math_on_any_shape_and_mask(B, N, M, heads, head_dim, cross, causal, use_bias, use_mask, pad,
                                                 empty_rows, seed):
    """With ``empty_rows`` some queries may have every key masked: both paths then give zeros."""
    g = torch.Generator().manual_seed(seed)
    H, Hkv = heads
    C = H * head_dim
    M = M if cross else N
    attn = (CrossAttention if cross else Attention)(C, H, num_kv_heads=Hkv).eval()
    x = torch.randn(B, N, C, generator=g)
    memory = torch.randn(B, M, C, generator=g) if cross else None
    bias = torch.randn(1, H, N, M, generator=g) if use_bias else None
    mask = torch.rand(B, 1, N, M, generator=g) > 0.3 if use_mask else None
    kpm = torch.rand(B, M, generator=g) > 0.7 if pad else None
    if mask is not None and not empty_rows:  # every query may see key 0 (unpadded below)
        mask[..., 0] = True
    if kpm is not None and not empty_rows:
        kpm[:, 0] = False
    kw = dict(bias=bias, attn_mask=mask, key_padding_mask=kpm) | ({} if cross else dict(is_causal=causal))
    with torch.no_grad():
        ref = attn(x, memory, **kw) if cross else attn(x, **kw)
        attn.backend = "math"
        out = attn(x, memory, **kw) if cross else attn(x, **kw)
    assert torch.isfinite(ref).all()
    assert_close(out, ref, atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def tiny_swin():
    return vitkit.create_model("swin_tiny_patch4_window7_224", embed_dim=16, depths=(1, 1, 1), num_heads=(1, 2, 2),
                               window_size=4, img_size=32, num_classes=5).eval()


@given(h=st.integers(1, 70), w=st.integers(1, 70))
def test_swin_takes_any_input_size(tiny_swin, h, w):
    with torch.no_grad():
        out = tiny_swin(torch.randn(1, 3, h, w))
    assert out.shape == (1, 5) and torch.isfinite(out).all()


@given(shape=st.sampled_from([(2, 1, 32, 32), (2, 3, 31, 32), (0, 3, 32, 32), (3, 32, 32)]),
       dtype=st.sampled_from([torch.float32, torch.uint8]), poison=st.sampled_from([None, "nan", "inf"]))
def test_bad_images_get_named_errors(shape, dtype, poison):
    model = vitkit.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1)
    x = torch.zeros(shape, dtype=dtype)
    if poison and dtype.is_floating_point and x.numel():
        x.view(-1)[0] = float(poison)
    with pytest.raises((ValueError, TypeError), match=r"VisionTransformer (expects|got)"):
        model(x)


def test_a_good_image_batch_passes_the_same_checks():
    model = vitkit.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1, num_classes=3)
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 3)
    # finite values whose sum overflows float32 are still finite input (the check sums first, then counts)
    huge = torch.full((2, 3, 32, 32), 3e38)
    assert not torch.isfinite(huge.sum()) and model(huge).shape == (2, 3)


@given(data=st.binary(max_size=2048), suffix=st.sampled_from([".pth", ".bin", ".safetensors", ".ckpt"]))
@example(data=b"M", suffix=".pth")  # struct.error inside torch's unpickler
@example(data=b"", suffix=".pth")
@example(data=b"", suffix=".safetensors")
@example(data=b"\x80\x02}q\x00(K\x01K\x02X\x01\x00\x00\x00aq\x01K\x03u.", suffix=".bin")  # {1: 2, "a": 3}
def test_random_bytes_never_crash_the_loader(tmp_path_factory, data, suffix):
    path = tmp_path_factory.mktemp("fuzz") / f"w{suffix}"
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=r"w\.(pth|bin|safetensors|ckpt)"):
        vitkit.read_checkpoint(path)


@given(data=st.one_of(st.binary(max_size=512), st.text(max_size=256).map(lambda t: ("image,labels\n" + t).encode()),
                      st.text(max_size=256).map(lambda t: ('{"image": "a.png", "labels": ' + t).encode())),
       suffix=st.sampled_from([".csv", ".jsonl"]))
@example(data=b"image,labels\na.png,x y\n", suffix=".csv")  # a row that reads: its image exists
@example(data=b'{"image": "a.png", "labels": 3}\n', suffix=".jsonl")  # labels as a number, not a list or text
@example(data=b'["a.png"]\n', suffix=".jsonl")
@example(data=b"image,labels\n~\x01", suffix=".csv")  # "~name": the home of a user who is not there
@example(data=b"image,labels\n~\x00", suffix=".csv")  # a NUL byte in a path
def test_any_manifest_reads_or_names_the_file_in_its_error(tmp_path_factory, data, suffix):
    """A manifest of any bytes is read, or refused by a ValueError / FileNotFoundError that names the manifest
    (what ``vitkit train`` prints as its one error line); nothing else escapes."""
    from vitkit.data.manifest import read_manifest

    root = tmp_path_factory.mktemp("manifest")
    (root / "a.png").write_bytes(b"")
    path = root / f"m{suffix}"
    path.write_bytes(data)
    try:
        manifest = read_manifest(path)
    except (ValueError, FileNotFoundError) as e:
        assert str(path) in str(e), e
        return
    assert len(manifest.images) == len(manifest.labels) > 0
    assert all(isinstance(name, str) for row in manifest.labels for name in row)


@given(text=st.one_of(st.text(max_size=200), st.binary(max_size=300).map(lambda b: base64.b64encode(b).decode())),
       prefix=st.sampled_from(["", "data:image/png;base64,", "data:"]))
@example(text="iVBORw0KGgo", prefix="")  # a PNG's signature, cut short
def test_any_text_sent_as_an_image_is_decoded_or_refused_with_a_4xx(text, prefix):
    """What a JSON request carries as an image, any text: ``vitkit serve`` decodes it or answers a 4xx with one line;
    nothing else escapes the worker's decoding."""
    import binascii

    from fastapi import HTTPException

    from vitkit.serving.api import decode_image, from_base64

    try:
        data = from_base64(prefix + text)
    except (binascii.Error, ValueError, TypeError):
        return  # the worker answers 400 "image i is not base64"
    try:
        image = decode_image(data, "the image", max_pixels=10_000)
    except HTTPException as e:
        assert 400 <= e.status_code < 500 and "\n" not in e.detail
    else:  # within the pixel limit, and 16-bit grey brought to 8 bits
        assert image.width * image.height <= 10_000 and not image.mode.startswith("I")


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 300) | st.floats(-1e3, 1e3) | st.text(max_size=6),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                         st.sampled_from(["id", "image_id", "bbox", "category_id", "file_name", "name", "iscrowd",
                                          "images", "annotations", "categories"]), inner, max_size=6),
                     max_leaves=24)


@given(data=st.one_of(_JSON.map(lambda v: json.dumps(v).encode()), st.binary(max_size=300)),
       labels=st.text(max_size=80))
def test_any_detection_annotations_read_or_end_in_one_line(tmp_path_factory, data, labels):
    """Any COCO JSON (or bytes) and any YOLO label text: the split reads, with every box a float (x1, y1, x2, y2),
    or the reader ends in a UsageError naming the file."""
    root = tmp_path_factory.mktemp("det")
    (root / "train.json").write_bytes(data)
    (root / "images" / "train").mkdir(parents=True)
    (root / "labels" / "train").mkdir(parents=True)
    Image.new("RGB", (8, 6)).save(root / "images" / "train" / "a.png")
    (root / "labels" / "train" / "a.txt").write_text(labels)
    for read in (lambda: coco(root / "images" / "train", root / "train.json"), lambda: yolo(root, "train", ["x"])):
        try:
            split = read()
        except UsageError:
            continue
        assert split.category_ids is None or len(split.category_ids) == len(split.class_names)  # an id per class
        for _, boxes, classes, _ in split.samples:
            assert boxes.dtype == torch.float32 and boxes.shape == (len(classes), 4)


@given(text=st.text(max_size=200))
@example(text="a.png d.npy 518.8\nb.png None 518.8\n")  # a line without ground truth beside one with
@example(text="a.png\n")
def test_any_depth_split_file_reads_or_names_the_file(tmp_path_factory, text):
    """A depth split file of any text (BTS's 'image depth focal' lines): its pairs are read, or the reader ends in a
    UsageError or MissingFileError naming the file."""
    from vitkit.data.depth import list_pairs
    from vitkit.errors import MissingFileError

    root = tmp_path_factory.mktemp("split")
    Image.new("RGB", (8, 6)).save(root / "a.png")
    np.save(root / "d.npy", np.ones((6, 8), np.float32))
    (root / "split.txt").write_text(text)
    try:
        pairs = list_pairs(root, "split.txt")
    except (UsageError, MissingFileError) as e:
        assert "split.txt" in str(e), e
        return
    assert pairs and all(image.is_file() and depth.is_file() for image, depth in pairs)
