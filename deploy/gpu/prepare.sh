#!/usr/bin/env bash
# Prepare a CUDA check for a machine with a GPU and no network (Python 3.12, its own CUDA torch and
# transformers-era packages): download, for Python 3.12 / manylinux x86_64, the wheels the project
# needs beyond such an image, and copy this script's check beside them.
#   usage (from the project's root): bash deploy/gpu/prepare.sh [DIR]   (default DIR: .gpu)
# DIR ends up holding whl/ and check.sh; keep DIR out of git (it is added to .git/info/exclude).
set -euo pipefail
DIR=${1:-.gpu}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$DIR/whl"
grep -qx "/$DIR/" .git/info/exclude 2>/dev/null || echo "/$DIR/" >> .git/info/exclude
# Versions as the project's own virtualenv has them (pip freeze), where it has them.
pin() { (.venv/bin/pip show "$1" 2>/dev/null || true) | sed -n 's/^Version: //p'; }
want=""
for name in protobuf grpcio grpcio-health-checking grpcio-reflection gguf skops transformers huggingface_hub \
            httpx2 httpcore2 truststore hf-xet kernels tomlkit regex; do
  v=$(pin "$name"); [ -n "$v" ] && want="$want $name==$v"
done
[ -n "$want" ] || { echo "no .venv here: run 'make install' first"; exit 1; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DIR/whl" $want
cp "$HERE/check.sh" "$DIR/check.sh"
du -sh "$DIR"
echo "ready: on the CUDA machine, from the project's root: bash $DIR/check.sh   (results under \$OUT, else ./gpu-out)"
