#!/usr/bin/env bash
# The GPU check on a bare, offline machine (docs/gpu.md): the carried wheels (gpu_wheels/, ignored by git) install
# into a folder of their own, scripts/gpu_check.py runs within 520 s, and $OUT gets 4 files: summary.json,
# sections.json, check.log and gpu_check.tar.gz (everything, machine.txt too). From the repository root:
#   bash scripts/gpu_run.sh                                          # on the GPU machine
#   GPU_CHECK_ARGS="--tiny --device cpu" bash scripts/gpu_run.sh     # the dry run on a CPU
set -u
OUT=${OUT:-gpu_out}
PY=${PYTHON:-python3}
SITE=${GPU_SITE:-/tmp/flowrl_gpu_site}
mkdir -p "$OUT" || exit 2
R=$(mktemp -d)
{ nvidia-smi; "$PY" -m pip --version; } >"$R/machine.txt" 2>&1
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
  "${GPU_WHEELS:-gpu_wheels}"/*.whl >>"$R/machine.txt" 2>&1 || { tail -n 5 "$R/machine.txt"; exit 3; }
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# shellcheck disable=SC2086  # GPU_CHECK_ARGS holds several arguments
timeout -k 15 520 "$PY" scripts/gpu_check.py --out "$R" ${GPU_CHECK_ARGS:-} >"$R/check.log" 2>&1
rc=$?
tail -n 30 "$R/check.log"
for f in summary.json sections.json check.log; do [ -f "$R/$f" ] && cp "$R/$f" "$OUT/"; done
tar -czf "$OUT/gpu_check.tar.gz" -C "$R" .
echo "gpu_run: exit $rc; $OUT holds $(ls "$OUT" | tr '\n' ' ')"
exit $rc
