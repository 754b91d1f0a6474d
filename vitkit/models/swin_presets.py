"""The Swin presets: timm's names -> SwinConfig fields, one row each (``vitkit.models.registry`` lists them)."""

from __future__ import annotations

from .config import IMAGENET


def _row(embed_dim: int, depths: tuple[int, ...], heads: tuple[int, ...], window: int, img: int, **kw) -> dict:
    return dict(embed_dim=embed_dim, depths=depths, num_heads=heads, window_size=window, img_size=img,
                crop_pct=0.9 if img in (192, 224, 256) else 1.0, **IMAGENET) | kw


T, S, B, L = (96, (2, 2, 6, 2), (3, 6, 12, 24)), (96, (2, 2, 18, 2), (3, 6, 12, 24)), \
    (128, (2, 2, 18, 2), (4, 8, 16, 32)), (192, (2, 2, 18, 2), (6, 12, 24, 48))
V2 = dict(version=2)
V2_FROM_192 = dict(version=2, pretrained_window_sizes=(12, 12, 12, 6))  # fine-tuned from 192 px, window 12


# Keyed by timm's names.
SWIN_PRESETS: dict[str, dict] = {
    "swin_tiny_patch4_window7_224": _row(96, (2, 2, 6, 2), (3, 6, 12, 24), 7, 224),
    "swin_small_patch4_window7_224": _row(96, (2, 2, 18, 2), (3, 6, 12, 24), 7, 224),
    "swin_base_patch4_window7_224": _row(128, (2, 2, 18, 2), (4, 8, 16, 32), 7, 224),
    "swin_base_patch4_window12_384": _row(128, (2, 2, 18, 2), (4, 8, 16, 32), 12, 384),
    "swin_large_patch4_window7_224": _row(192, (2, 2, 18, 2), (6, 12, 24, 48), 7, 224),
    "swin_large_patch4_window12_384": _row(192, (2, 2, 18, 2), (6, 12, 24, 48), 12, 384),
    # Swin V2 (Liu et al., 2022)
    "swinv2_tiny_window8_256": _row(*T, 8, 256, **V2),
    "swinv2_tiny_window16_256": _row(*T, 16, 256, **V2),
    "swinv2_small_window8_256": _row(*S, 8, 256, **V2),
    "swinv2_small_window16_256": _row(*S, 16, 256, **V2),
    "swinv2_base_window8_256": _row(*B, 8, 256, **V2),
    "swinv2_base_window16_256": _row(*B, 16, 256, **V2),
    "swinv2_base_window12_192": _row(*B, 12, 192, **V2, num_classes=21841),
    "swinv2_base_window12to16_192to256": _row(*B, 16, 256, **V2_FROM_192),
    "swinv2_base_window12to24_192to384": _row(*B, 24, 384, **V2_FROM_192),
    "swinv2_large_window12_192": _row(*L, 12, 192, **V2, num_classes=21841),
    "swinv2_large_window12to16_192to256": _row(*L, 16, 256, **V2_FROM_192),
    "swinv2_large_window12to24_192to384": _row(*L, 24, 384, **V2_FROM_192),
}
