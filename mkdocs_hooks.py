"""mkdocs hook: the command-line reference, written from the commands' own ``--help`` when the site is built."""

from __future__ import annotations

import argparse

MARKER = "<!-- vitkit --help -->"


def _block(title: str, text: str) -> str:
    return f"## `{title}`\n\n```text\n{text.rstrip()}\n```\n"


def cli_reference() -> str:
    from vitkit.cli import parser
    from vitkit.lit.evaluate import parser as evaluate_parser
    from vitkit.tools.bench import parser as bench_parser

    top = parser()
    parts = [_block("vitkit", top.format_help())]
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        if name == "evaluate":
            parts.append(_block("vitkit evaluate", evaluate_parser().format_help()))
        elif name == "bench":
            parts.append(_block("vitkit bench", bench_parser().format_help()))
        elif name != "train":
            parts.append(_block(f"vitkit {name}", p.format_help()))
    return "\n".join(parts)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, cli_reference())
    return markdown
