"""The rich console every command prints its tables with.

In a terminal rich fits its output to the window. When stdout is a pipe or a file
(``kvstore bench ... | tee log``, CI logs), rich would assume 80 columns and wrap every
table cell that does not fit, so a row of figures comes out broken over several lines.
Off a terminal the console is as wide as the widest line needs (up to :data:`PIPE_WIDTH`
columns), unless ``COLUMNS`` says otherwise: tables print whole, one row per line.
"""

from __future__ import annotations

import os

from rich.console import Console

__all__ = ["PIPE_WIDTH", "make_console"]

PIPE_WIDTH = 1000  # columns off a terminal: no table of ours is wider


def make_console(*, stderr: bool = False, min_width: int = 0) -> Console:
    """A console for tables and notes: the terminal's width in a terminal (at least
    ``min_width``, for a table that reads better wrapped by the terminal than cut into
    cells); off a terminal (a pipe, a file) :data:`PIPE_WIDTH` columns, or ``COLUMNS``
    when set."""
    console = Console(stderr=stderr)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console.width = PIPE_WIDTH
    elif console.width < min_width:
        console.width = min_width
    return console
