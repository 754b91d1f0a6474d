"""``vitkit pos-embed``: the cosine similarity of each learned position embedding to the others, beside the fixed
2-D sin-cos embedding of the same grid."""

from __future__ import annotations

import dataclasses

from vitkit.errors import UsageError

from .common import add_model_source, command_parser, load_classifier


def parser():
    p = command_parser("pos-embed")
    add_model_source(p, "any format vitkit reads; without it, --model names pretrained weights")
    p.add_argument("-o", "--output", default="pos_embed.png")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    import vitkit
    from vitkit.evaluation.plots import pos_embed_similarity

    net = load_classifier(args)
    if not hasattr(net, "pos_embed"):
        raise UsageError(f"{net.name} has no absolute position embedding (Swin uses relative biases)")
    fixed = vitkit.create_model(net.name, **{**dataclasses.asdict(net.cfg), "pos_embed": "sincos"})
    print(pos_embed_similarity({f"{net.name} (learned)": net, "2-D sin-cos (fixed)": fixed}, args.output))
    return 0
