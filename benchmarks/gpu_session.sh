#!/usr/bin/env bash
# The one prepared run for a lent CUDA machine (rule 3: <= 8 minutes, a table printed last).
#
# Before calling the device tool, on the CPU machine (the device has no network; the GPU test tier
# compares against google-crc32c / crc32c, which its image lacks):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl google-crc32c crc32c
# Then: run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=540)
# Everything it writes lands in $OUT (results tables, logs); commit the tables under benchmarks/results/.
set -uo pipefail
OUT=${OUT:-/tmp/gpumem-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
status=()

step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log, remember the outcome
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  status+=("$name|rc=$rc|$((SECONDS - t0)) s|$(tail -n 1 "$OUT/$name.log" | cut -c1-90)")
  return $rc
}

if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
step build 240 $PY -m pip install --no-build-isolation --no-deps -e . || { tail -40 "$OUT/build.log"; exit 1; }
step doctor 60 $PY -m gpumem doctor --size 1GiB
step gpu_tests 200 $PY -m pytest -m gpu -q -p no:cacheprovider tests
step bench_triton_crc32c 90 $PY benchmarks/bench_triton_crc32c.py --size 1G
step bench_native 90 $PY benchmarks/bench_native.py --size 1G --no-write
[ -f benchmarks/bench_checkpoint.py ] && step bench_checkpoint_gpu 120 $PY benchmarks/bench_checkpoint.py --device cuda --sizes 1GB
cp benchmarks/results/*.md "$OUT/" 2>/dev/null

echo "== results tables =="
for f in triton_crc32c native checkpoint_gpu; do
  [ -f "benchmarks/results/$f.md" ] && { echo "-- $f"; grep '^|' "benchmarks/results/$f.md"; }
done
echo "== gpu tests =="; tail -n 15 "$OUT/gpu_tests.log"
echo "== summary =="; cat "$OUT/gpu.txt"
printf '%s\n' "${status[@]}" | column -t -s '|'
