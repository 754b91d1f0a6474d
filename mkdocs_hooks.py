"""mkdocs hook: the command-line reference, written from the commands' own ``--help`` when the site is built."""

from __future__ import annotations

MARKER = "<!-- vitkit --help -->"


def _block(title: str, text: str) -> str:
    return f"## `{title}`\n\n```text\n{text.rstrip()}\n```\n"


def cli_reference() -> str:
    from vitkit.cli import COMMANDS, command, parser

    parts = [_block("vitkit", parser().format_help())]
    for name in COMMANDS:
        if name != "train":  # LightningCLI's help: `vitkit train fit --help`
            parts.append(_block(f"vitkit {name}", command(name).parser().format_help()))
    return "\n".join(parts)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, cli_reference())
    return markdown
