#!/usr/bin/env bash
# `make gpu-bundle`: dist/gpu-bundle/, one folder that runs the GPU check
# (tests/gpu/check_gpu.py) on a bare machine that has Python, torch and numpy and no
# network: the checkout's code (tracked files of client/, kvstore/, bench/,
# tests/gpu/, scripts/e2e.sh, pyproject.toml), the wheels of every other package the
# check imports for CPython 3.10-3.13 on x86_64 and aarch64 Linux (atomicshm
# included), and run.sh. Copy the folder over and run
#
#   OUT=/some/dir dist/gpu-bundle/run.sh            # the check on the GPU
#   dist/gpu-bundle/run.sh --dry-run                # CPU torch: same steps, no figures
#
# run.sh installs the wheels with --no-index into a scratch target (per Python
# version, under $TMPDIR) and runs the check with ${PYTHON:-python3}; the JSON goes
# to $OUT/gpu-check.json when OUT is set. Wheels are fetched with pip download
# (--only-binary, per Python version and platform) once; a re-run reuses them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=dist/gpu-bundle
WHEELS=$DEST/wheels
# The check's needs beyond torch and numpy, at the versions pyproject.toml pins
# (their own dependencies are resolved by pip for each Python version).
PKGS=$(sed -n '/^dependencies = \[/,/^\]/p' pyproject.toml | grep -o '"[^"]*"' | tr -d '"' \
  | grep -v -E '^(kvstore-client|numpy|etcd-sdk-python)')
rm -rf "$DEST/code"
mkdir -p "$DEST/code" "$WHEELS"
git ls-files -z client kvstore bench tests/gpu tests/__init__.py scripts/e2e.sh pyproject.toml \
  | xargs -0 cp --parents -t "$DEST/code"
fetch() {  # fetch VERSION ARCH PACKAGE...
  local v=$1 arch=$2
  shift 2
  "$PY" -m pip download -q --only-binary=:all: --python-version "$v" --implementation cp \
    --platform "manylinux_2_28_$arch" --platform "manylinux_2_17_$arch" \
    --platform "manylinux2014_$arch" --platform "manylinux_2_5_$arch" \
    --platform "manylinux1_$arch" -d "$WHEELS" "$@" 2>&1 | grep -v "^WARNING: Location" || true
}
# atomicshm publishes one cp311-abi3 wheel (x86_64) and an sdist: the sdist travels
# too, with setuptools and wheel, so that run.sh builds it (a C compiler needed)
# where no wheel fits (CPython 3.10, aarch64).
OTHERS=$(echo "$PKGS" | grep -v '^atomicshm')
SHM=$(echo "$PKGS" | grep '^atomicshm')
for v in 3.10 3.11 3.12 3.13; do
  for arch in x86_64 aarch64; do
    fetch "$v" "$arch" $OTHERS
    fetch "$v" "$arch" --no-deps "$SHM"
  done
done
"$PY" -m pip download -q --no-deps --no-binary=:all: -d "$WHEELS" "$SHM" 2>&1 \
  | grep -v "^WARNING: Location" || true
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$WHEELS" setuptools wheel 2>&1 \
  | grep -v "^WARNING: Location" || true
rm -f "$WHEELS"/numpy-*.whl "$WHEELS"/torch-*.whl
cat > "$DEST/run.sh" <<'RUN'
#!/usr/bin/env bash
# The GPU check from this bundle, no network: run.sh [check_gpu.py options]
# (--dry-run: CPU torch). PYTHON picks the interpreter (it must have torch and numpy);
# OUT, when set, receives gpu-check.json.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python3}
TAG=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
SITE=${TMPDIR:-/tmp}/kvstore-gpu-site-$TAG
if [ ! -f "$SITE/.done" ]; then
  rm -rf "$SITE"
  "$PYTHON" -m pip install -q --no-warn-conflicts --no-index --find-links "$HERE/wheels" --target "$SITE" \
    $(ls "$HERE/wheels" | sed -E 's/-[0-9][^-]*(-.*|\.tar\.gz)$//' | sort -u \
      | grep -v -E '^(numpy|torch|setuptools|wheel)$')
  touch "$SITE/.done"
fi
ARGS=("$@")
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  ARGS+=(--out "$OUT/gpu-check.json")
fi
PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" "$HERE/code/tests/gpu/check_gpu.py" "${ARGS[@]}"
RUN
chmod +x "$DEST/run.sh"
echo "== $DEST: $(ls "$WHEELS" | wc -l) wheels, $(du -sh "$DEST" | cut -f1)"
