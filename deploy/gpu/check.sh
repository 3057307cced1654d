#!/usr/bin/env bash
# The CUDA check, in one go: run from the project's root on a GPU machine without network, after
# `bash deploy/gpu/prepare.sh` (on a machine with the project's .venv and PyPI) put the wheels the
# project needs beyond a CUDA image's own Python 3.12 + torch into .gpu/ (copy .gpu/ along).
# Each step has its own time limit and writes its result file under $OUT (default ./gpu-out):
#   A  pytest -m gpu (tests/test_gpu.py)                                                   (120 s)
#   B  disco doctor --device cuda on seeded random weights of the default pair's architectures (240 s)
#   C  disco models calibrate on CUDA (target forward over 1..13 new tokens, draft per token) (120 s)
#   D  disco bench-concurrency none / static:3 at 1, 8, 32 sessions over gRPC               (180 s)
#   E  docs/analysis/cuda_exactness.py (where a row gets other bits: linears, attention)    (200 s)
#   F  docs/analysis/static_step_speed.py: the static step (issue 40), eager against its CUDA graphs,
#      by bucket, for both architectures; capture time and memory                          (180 s)
# STEPS=ABCD (the default) selects steps; A-D take about 6-7 minutes on an H200. E_PARTS picks E's parts;
# F_BUCKETS F's buckets (sessions x block).
# Without a CUDA device it stops at once with exit code 2 and says why.
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
STEPS=${STEPS:-ABCD}
HERE=$(cd "$(dirname "$0")" && pwd)
if ! why=$(python3 -c "import torch, sys; sys.exit(0) if torch.cuda.is_available() else print(f'torch {torch.__version__} finds no CUDA device')" 2>&1) || [ -n "$why" ]; then
  echo "the CUDA check needs a CUDA machine: ${why##*$'\n'}" | tee "$OUT/no_cuda.txt"; exit 2
fi
[ -d "$HERE/whl" ] || { echo "no wheels in $HERE/whl: run 'bash deploy/gpu/prepare.sh' on a machine with PyPI first"; exit 3; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; } > "$OUT/env.txt" 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$HERE"/whl/*.whl \
  > "$OUT/pip.txt" 2>&1 || { echo "wheel install failed"; cat "$OUT/pip.txt"; exit 3; }
export PYTHONPATH=/tmp/site:$PWD DISCO_HOME=${DISCO_HOME:-/tmp/disco-home} HF_HUB_OFFLINE=1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))" >> "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
D="import sys; from disco_cli.main import main; sys.exit(main(sys.argv[1:]))"
MODELS=/tmp/disco-random-pair
step() { case "$STEPS" in *"$1"*) return 0;; *) return 1;; esac; }
if step A; then
  echo "== A pytest -m gpu"; timeout 120 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider > "$OUT/A_gpu_tests.log" 2>&1
  echo "rc=$?"; tail -3 "$OUT/A_gpu_tests.log"
fi
if step B || step C || step D; then
  [ -d $MODELS/target ] || python3 -c "from pathlib import Path; from disco_cli.doctor_setup import write_random_pair; write_random_pair(Path('$MODELS'))" \
    > "$OUT/models.log" 2>&1 || { echo "random pair failed"; tail -5 "$OUT/models.log"; }
fi
if step B; then
  echo "== B doctor"; timeout 240 python3 -c "$D" doctor --device cuda --target $MODELS/target --draft $MODELS/draft --json \
    > "$OUT/B_doctor.json" 2> "$OUT/B_doctor.err"; echo "rc=$?"
  python3 -c "
import json, sys
d = json.load(open('$OUT/B_doctor.json')); print('doctor ok:', d['ok'], 'in', d['wall_s'], 's')
for c in d['checks']: print(f\"{c['name']:<15} {c['engine'] or '-':<9} {'ok' if c['ok'] else 'FAIL':<5} {c['detail'][:300]}\")" || tail -5 "$OUT/B_doctor.err"
fi
if step C; then
  echo "== C costs"; timeout 120 python3 -c "$D" models calibrate --target $MODELS/target --draft $MODELS/draft --device cuda \
    --dtype bfloat16 --max-lookahead 12 --draft-tokens 4 --force --json > "$OUT/C_costs.json" 2> "$OUT/C_costs.err"; echo "rc=$?"
  python3 -c "
import json; d = json.load(open('$OUT/C_costs.json'))
for role in ('target', 'draft'): print(role, 'ms by new tokens:', d[role]['forward_ms'], 'prefill s:', round(d[role]['prefill_s'], 4))" || tail -5 "$OUT/C_costs.err"
fi
if step D; then
  echo "== D concurrency"; timeout 180 python3 -c "$D" bench-concurrency --policies none,static:3 --levels 1,8,32 --max-new-tokens 32 \
    --target $MODELS/target --draft $MODELS/draft --device cuda --dtype bfloat16 --json-out "$OUT/D_concurrency.json" \
    > "$OUT/D_concurrency.log" 2>&1; echo "rc=$?"; grep "^concurrency" "$OUT/D_concurrency.log"
fi
if step E; then
  echo "== E exactness analysis"; timeout 200 python3 docs/analysis/cuda_exactness.py --out "$OUT/E_cuda_exactness.json" \
    --parts "${E_PARTS:-linears,linear_ms,attention,model}" \
    > "$OUT/E_cuda_exactness.log" 2>&1; echo "rc=$?"; grep -v "^ " "$OUT/E_cuda_exactness.log" | tail -5
fi
if step F; then
  echo "== F static step and CUDA graphs"; timeout 180 python3 docs/analysis/static_step_speed.py \
    --buckets "${F_BUCKETS:-1x1,1x4,1x8,8x1,8x4,32x1,32x4}" --json "$OUT/F_static_step.json" \
    > "$OUT/F_static_step.log" 2>&1; echo "rc=$?"; grep -v "INFO" "$OUT/F_static_step.log" | tail -16
fi
