"""``vitkit models``: the presets, with their parameters, GMACs, image size and family."""

from __future__ import annotations

from .common import command_parser


def parser():
    p = command_parser("models")
    p.add_argument("pattern", nargs="?", default="*")
    p.add_argument("--no-flops", action="store_true", help="skip counting GMACs")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    import torch

    import vitkit
    from vitkit.benchmarking.flops import count_gmacs_of
    from vitkit.models.config import pair

    rows = []
    for name in vitkit.list_models(args.pattern):
        fam, cfg = vitkit.family(name), vitkit.get_config(name)
        if fam == "seq2seq":
            kw = dict(src_vocab_size=32000, tgt_vocab_size=32000)
            cfg = vitkit.get_config(name, **kw)
            with torch.device("meta"):
                params = sum(p.numel() for p in vitkit.create_model(name, **kw).parameters())
            size = "-" if cfg.vision_encoder is None else "x".join(map(str, cfg.vision_overrides["img_size"]))
            rows.append((name, f"{params / 1e6:.1f}", "-", size, fam))
            continue
        with torch.device("meta"):
            params = sum(p.numel() for p in vitkit.create_model(name).parameters())
        shape = (cfg.in_chans, *pair(cfg.img_size))
        gmacs = "-" if args.no_flops else f"{count_gmacs_of(lambda n=name: vitkit.create_model(n), shape):.2f}"
        rows.append((name, f"{params / 1e6:.1f}", gmacs, "x".join(map(str, shape[1:])), fam))
    head = ("name", "params (M)", "GMACs", "img size", "family")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, tuple("-" * w for w in widths), *rows]:
        print("  ".join(c.ljust(w) if i == 0 or i == 4 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths,
                                                                                                        strict=True))))
    return 0
