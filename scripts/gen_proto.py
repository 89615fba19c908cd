"""Regenerate the protobuf and gRPC stubs from proto/ into a target folder.

Usage: python scripts/gen_proto.py [OUT_DIR]   (default: client/kvstore_client/proto)

The generated modules import each other relatively, so they live inside the
kvstore_client package without clashing with the `kvstore` daemon package.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto" / "kvstore" / "v1"


def generate(out: pathlib.Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # protoc finds the mypy plugins next to the running interpreter (the venv's bin/).
    bindir = str(pathlib.Path(sys.executable).parent)
    os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    protos = sorted(str(p.name) for p in PROTO_DIR.glob("*.proto"))
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for f in out.glob("*.py*"):
        text = f.read_text()
        fixed = re.sub(r"^import (\w+_pb2)", r"from . import \1", text, flags=re.M)
        f.write_text(fixed)
    (out / "__init__.py").write_text('"""Generated protobuf and gRPC stubs (make proto)."""\n')


if __name__ == "__main__":
    target = (
        pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "client/kvstore_client/proto"
    )
    generate(target)
