"""``vitkit recipes``: the training recipes that ship in the wheel, one line each."""

from __future__ import annotations

from .common import command_parser


def parser():
    return command_parser("recipes")


def main(argv: list[str]) -> int:
    parser().parse_args(argv)
    from vitkit.recipes import list_recipes, recipes_dir

    found = list_recipes()
    width = max(map(len, found))
    for name, what in found.items():
        print(f"{name:<{width}}  {what}")
    print(f"({len(found)} recipes in {recipes_dir()}; train one with `vitkit train fit --config NAME`)")
    return 0
