"""The light client distribution (client/pyproject.toml, ``kvstore-client``).

An engine's environment installs only this distribution: its wheel must hold the
``kvstore_client`` package and nothing of the daemons, state its dependencies as ranges
(so they fit beside an engine's own pins, e.g. vLLM's numpy<2.4), and work alone: a
process that sees the wheel and the third-party libraries, but not ``kvstore``, puts and
gets bytes exactly against a real cluster. (``make e2e`` installs it with its
dependencies into the vLLM environment; see scripts/e2e.sh.)
"""

from __future__ import annotations

import json
import shutil
import site
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from email import message_from_bytes
from pathlib import Path

import pytest

import kvstore_client
from kvstore.cluster import LocalCluster

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    src = tmp_path_factory.mktemp("src") / "client"  # setuptools writes build/ beside it
    shutil.copytree(ROOT / "client", src, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    (whl,) = out.glob("kvstore_client-*.whl")
    return whl


def _metadata(whl: Path) -> tuple[list[str], object]:
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        return names, message_from_bytes(z.read(meta))


def test_wheel_holds_only_the_client_with_ranged_dependencies(wheel: Path) -> None:
    names, msg = _metadata(wheel)
    packages = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert packages == {"kvstore_client"}
    assert "kvstore_client/proto/store_pb2.py" in names
    assert "kvstore_client/connectors/vllm/__init__.py" in names
    assert msg["Name"] == "kvstore-client"  # type: ignore[index]
    assert msg["Version"] == kvstore_client.__version__  # type: ignore[index]
    requires = msg.get_all("Requires-Dist") or []  # type: ignore[attr-defined]
    base = [r for r in requires if "extra ==" not in r]
    assert {r.split(">")[0].split("<")[0].strip() for r in base} == {
        "grpcio", "protobuf", "numpy", "xxhash", "atomicshm",
    }  # fmt: skip
    for r in requires:
        assert "==" not in r.split(";")[0], f"{r}: the client states ranges, never exact pins"
    numpy = next(r for r in base if r.startswith("numpy"))
    assert "<2.4" not in numpy and ">=1.26" in numpy  # vLLM's numpy<2.4 fits


def test_daemons_pin_exactly_and_require_this_client() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    client = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"]
    assert f"kvstore-client=={client['version']}" in project["dependencies"]
    assert project["version"] == client["version"] == kvstore_client.__version__
    for dep in project["dependencies"]:
        assert "==" in dep, f"{dep}: the daemons pin exactly"


CLIENT_ALONE = r"""
import json, sys
sys.path[:0] = PATHS  # the wheel first, then the third-party libraries (no .pth files)
import numpy as np
from kvstore_client import Client
ns = "dist/test/b16/tp0of1"
keys = [bytes([i]) * 16 for i in range(1, 9)]
vals = [bytes([i]) * (64 << 10) for i in range(1, 9)]
with Client(MASTER, timeout=10.0) as c:
    stored = c.batch_put(ns, keys, vals)
    got = c.batch_get(ns, keys + [b"\xee" * 16])
    bufs = [np.zeros(64 << 10, dtype=np.uint8) for _ in keys]
    hits = c.batch_get_into(ns, keys, bufs).result()
print(json.dumps({
    "stored": stored,
    "exact": [g == v for g, v in zip(got, vals)],
    "miss": got[-1] is None,
    "into": [bool(h) and b.tobytes() == v for h, b, v in zip(hits, bufs, vals)],
    "daemons_loaded": sorted(m for m in sys.modules if m == "kvstore" or m.startswith("kvstore.")),
    "client_from": sys.modules["kvstore_client"].__file__,
}))
"""


def test_the_wheel_alone_talks_to_a_cluster(wheel: Path, cluster: LocalCluster) -> None:
    libs = [p for p in {*site.getsitepackages(), sysconfig.get_paths()["purelib"]}]
    prog = f"PATHS = {[str(wheel), *libs]!r}\nMASTER = {cluster.address!r}\n" + CLIENT_ALONE
    # -S: no site-packages, so no editable finder of the checkout; -I: no cwd, no PYTHON* env.
    r = subprocess.run(
        [sys.executable, "-S", "-I", "-c", prog],
        capture_output=True, text=True, timeout=120, cwd=str(wheel.parent),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["client_from"].startswith(str(wheel)), out["client_from"]
    assert out["stored"] == [True] * 8
    assert out["exact"] == [True] * 8 and out["miss"] is True
    assert out["into"] == [True] * 8
    assert out["daemons_loaded"] == []
