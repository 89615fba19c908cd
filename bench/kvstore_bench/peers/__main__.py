"""``python -m kvstore_bench.peers mooncake-segment --master ADDR --segment-size N``:
the Mooncake segment host of the transfer bench (internal)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .mooncake import _segment_host_main


def main(argv: Sequence[str] | None = None) -> int:
    """Internal entry point: ``mooncake-segment --master ADDR --segment-size N``."""
    p = argparse.ArgumentParser(prog="python -m kvstore_bench.peers")
    sub = p.add_subparsers(dest="cmd", required=True)
    seg = sub.add_parser("mooncake-segment", help="mount a Mooncake segment and idle")
    seg.add_argument("--master", required=True)
    seg.add_argument("--segment-size", type=int, required=True)
    args = p.parse_args(argv)
    return _segment_host_main(args.master, args.segment_size)


if __name__ == "__main__":
    sys.exit(main())
