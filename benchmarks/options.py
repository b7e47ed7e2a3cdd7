"""Command-line options that several benchmarks share."""

from __future__ import annotations

import argparse


def add_set_option(parser: argparse.ArgumentParser, text: str) -> None:
    """``--set KEY=VALUE ...``: dotted config overrides (as ``mmrl train`` takes them), read into ``overrides``;
    ``text`` is its help."""
    parser.add_argument("--set", dest="overrides", nargs="+", default=[], metavar="KEY=VALUE", help=text)
