"""``vitkit attention-map``: where a classifier looks in an image: attention rollout over every layer (ViT), or the
attention one shifted-window block gives each position (Swin)."""

from __future__ import annotations

from .common import add_model_source, command_parser, load_classifier, read_image


def parser():
    p = command_parser("attention-map")
    p.add_argument("image")
    add_model_source(p, "any format vitkit reads; without it, --model names pretrained weights")
    p.add_argument("-o", "--output", default="attention.png")
    p.add_argument("--stage", type=int, default=0, help="Swin: which stage")
    p.add_argument("--block", type=int, default=1, help="Swin: which block (1 = the first shifted one)")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    from vitkit.evaluation.plots import attention_rollout, overlay, swin_window_attention

    net = load_classifier(args)
    x, shown = read_image(args.image, net.cfg)
    if hasattr(net, "blocks"):  # ViT: rollout over every layer
        maps = net.attention_maps(x)
        heat = attention_rollout(maps, net.num_prefix_tokens, net.cfg.grid_size)[0]
        title = f"attention rollout, {len(maps)} layers"
    else:  # Swin: attention received per position inside the windows of one block
        attn, plan = net.attention_maps(x, stage=args.stage, block=args.block)
        heat = swin_window_attention(attn, plan)  # attn: (nW, heads, N, N) for the one image
        title = f"stage {args.stage} block {args.block}, windows {plan.window[0]}x{plan.window[1]}"
    print(overlay(shown, heat, args.output, title))
    return 0
