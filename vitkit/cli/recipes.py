"""``vitkit recipes``: the training recipes that ship in the wheel: each one's hardware, data, time scale and what it
trains."""

from __future__ import annotations

import textwrap

from .common import command_parser


def parser():
    return command_parser("recipes")


def main(argv: list[str]) -> int:
    parser().parse_args(argv)
    from vitkit.recipes import list_recipes, recipes_dir

    found = list_recipes()
    for name, info in found.items():
        print(f"{name}: {info.hardware}; {info.data or 'data: see the recipe'}; {info.time or 'time: see the recipe'}")
        print(textwrap.fill(info.summary, width=110, initial_indent="    ", subsequent_indent="    "))
    print(f"({len(found)} recipes in {recipes_dir()}; `vitkit train fit -c NAME --print_config` shows one whole, "
          "`vitkit train fit -c NAME` trains it; GPU only: its trainer asks for accelerator gpu)")
    return 0
