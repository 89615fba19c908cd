"""Tables printed to a pipe or a file come out whole, one row per line (issue 43).

rich assumes 80 columns off a terminal and wraps every cell that does not fit; the
benches' tables have a dozen columns, so piped output (`| tee`, CI logs) was broken
into fragments. Every command prints through :func:`kvstore.console.make_console`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

WIDE_TABLE = """
from rich.table import Table
from kvstore.console import make_console
t = Table(title="a wide table")
for i in range(12):
    t.add_column(f"column number {i}")
t.add_row(*[f"value-{i}-abcdefgh" for i in range(12)])
make_console().print(t)
"""


def test_piped_tables_print_one_row_per_line() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    out = subprocess.run(
        [sys.executable, "-c", WIDE_TABLE], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any("column number 0" in x and "column number 11" in x for x in lines), out.stdout
    assert any("value-0-abcdefgh" in x and "value-11-abcdefgh" in x for x in lines), out.stdout


def test_columns_still_wins() -> None:
    """An explicit COLUMNS is the user's choice, piped or not."""
    env = {**os.environ, "COLUMNS": "60"}
    out = subprocess.run(
        [sys.executable, "-c", WIDE_TABLE], capture_output=True, text=True, env=env, timeout=60
    )
    assert max(len(x) for x in out.stdout.splitlines()) <= 60


def test_every_command_prints_through_make_console() -> None:
    """No module of the daemons or the benches makes its own rich Console: one made
    with rich's defaults wraps its tables when piped."""
    offenders = []
    for root in ("kvstore", "bench/kvstore_bench"):
        for path in (REPO / root).rglob("*.py"):
            if path.name == "console.py" and path.parent.name == "kvstore":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"\bConsole\(", line):
                    offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not offenders, "use kvstore.console.make_console():\n" + "\n".join(offenders)
