#!/usr/bin/env bash
# GPU session: build gpumem, run the GPU test tier and the GPU benchmarks on one CUDA machine,
# unattended, in at most 8 minutes, and print a summary with the results tables last.
#
# What to install. The machine needs Python 3.12 with a CUDA build of torch, triton, nanobind,
# scikit-build-core, cmake, ninja and pytest, and a C++17 compiler (no CUDA toolkit); the lent H200
# image has them (torch 2.11, triton 3.6). The GPU tests also compare against google-crc32c and
# crc32c, which it lacks and cannot download (no network): fetch their wheels into .whl/ on a
# machine with network, once, from the repository root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --platform manylinux1_x86_64 -d .whl google-crc32c crc32c
# The script installs whatever is in .whl/ into /tmp/site first.
#
# The one command, from the repository root (through the device tool: run(command=<it>,
# carry=[".whl"], timeout_s=540)):
#   BENCH_GIT_COMMIT=<commit under test> bash benchmarks/gpu_session.sh
# BENCH_GIT_COMMIT is optional: it names the commit in the results files, since the copy of the
# tree on the machine has no .git ("unknown" without it).
#
# Where the results land: $OUT (default /tmp/gpumem-gpu), 5 files:
#   summary.txt     what prints last: machine, probe, calibration, the GPU tests' tail, each step's
#                   status and time, the results tables
#   results.tar.gz  the benchmarks/results/*.md and *.json this run wrote (triton_crc32c,
#                   checkpoint_gpu, native_gpu_box): unpack with
#                   tar -xzf results.tar.gz -C benchmarks/results, then compare with the committed
#                   run (python benchmarks/compare.py HEAD:benchmarks/results benchmarks/results)
#                   and commit them
#   gpu_tests.log, probe.log, logs.tar.gz (every step's log, the JUnit XML, calibration_gpu.json)
#
# How it runs: every step has a time limit, the steps together never run past
# GPU_SESSION_BUDGET_S (default 450 s), and a failing step does not stop the later ones.
set -uo pipefail
OUT=${OUT:-/tmp/gpumem-gpu}
LOGS=$OUT/logs
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
deadline=$((SECONDS + ${GPU_SESSION_BUDGET_S:-450}))
status=()

step() {  # step NAME SECONDS CMD...: run with a limit (cut to the budget left), log to $LOGS/NAME.log
  local name=$1 limit=$2; shift 2
  local left=$((deadline - SECONDS))
  if ((left < 15)); then
    status+=("$name|skipped|0 s|session budget spent")
    return 1
  fi
  ((limit > left)) && limit=$left
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  ((rc == 124 || rc == 137)) && echo "gpu_session: $name stopped at its ${limit} s limit" >> "$LOGS/$name.log"
  status+=("$name|rc=$rc|$((SECONDS - t0)) s|$(tail -n 1 "$LOGS/$name.log" | cut -c1-90)")
  return $rc
}

if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$LOGS/wheels.log" 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$LOGS/gpu.txt" 2>&1
$PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" >> "$LOGS/gpu.txt" 2>&1

# Priority order: the build, the GPU tier, the checkpoint benchmarks, then the probe and the rest.
if step build 100 $PY -m pip install --no-build-isolation --no-deps -e .; then
  timeout_opt=()
  $PY -c "import pytest_timeout" 2>/dev/null && timeout_opt=(--timeout=90)
  step gpu_tests 130 $PY -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors \
    --durations=15 --junitxml="$LOGS/gpu_tests.xml" ${timeout_opt[@]+"${timeout_opt[@]}"} tests

  # Issue #11's figures: 0.9 and 4 GB states, the checkpoint-every-step loop (GPT 1.2B, bf16,
  # AdamW, coalesce=True, keep=1, 50 steps), then 12 GB (the first to give way to the time
  # limit); each part is written to results/checkpoint_gpu.md as soon as it is measured.
  step bench_checkpoint_gpu 170 $PY benchmarks/bench_checkpoint.py --device cuda \
    --sizes 0.9GB,4GB,every,12GB --repeat 3 --steps 50 --spill-bytes 2GB
  step diagnose_snapshot 35 $PY benchmarks/diagnose_snapshot_gpu.py --repeat 3
  step bench_triton_crc32c 45 $PY benchmarks/bench_triton_crc32c.py --size 1G
  # Facts the CPU machine cannot establish, printed rather than asserted (none is a claim of ours).
  step probe 20 $PY - <<'EOF'
import time
import torch
from gpumem._native import cuda_runtime
from gpumem.arena import HostArena
print("runtime:", cuda_runtime())
n = (1 << 30) + (64 << 20)
arena = HostArena(n, pinned=True)
t0 = time.perf_counter()
arena.wait_pinned()
print(f"pinned {n} bytes in {time.perf_counter() - t0:.2f} s (in {arena.pin_chunk} byte registrations)")
at = (1 << 30) - (16 << 20)  # 32 MiB across the first registration boundary
print("is_pinned() of an arena view:", arena.view(at, 1 << 20).is_pinned())
big = torch.randint(0, 256, ((1 << 30) - (64 << 20),), dtype=torch.uint8, device="cuda")
for name, dst in (("arena", None), ("torch pinned", torch.empty(big.numel(), dtype=torch.uint8, pin_memory=True)),
                  ("pageable", torch.empty(big.numel(), dtype=torch.uint8))):
    for _ in range(2):  # the second is timed
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        arena.copy_from_device(big, 0) if dst is None else dst.copy_(big, non_blocking=True)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
    print(f"D2H {big.numel() >> 20} MiB into {name}: call returned after {(t1 - t0) * 1e3:.2f} ms, "
          f"done after {(t2 - t0) * 1e3:.1f} ms ({big.numel() / (t2 - t0) / 1e9:.1f} GB/s)")
src = big[: 32 << 20]
arena.copy_from_device(src, at)
torch.cuda.synchronize()
print("copy_from_device across the boundary, bytes right:", torch.equal(arena.view(at, 32 << 20), src.cpu()))
try:  # one raw D2H copy spanning two registrations: does the driver take it (last: it may fail)?
    arena.view(at, 32 << 20).copy_(src.flip(0), non_blocking=True)
    torch.cuda.synchronize()
    print("raw copy across two registrations: accepted, bytes right:",
          torch.equal(arena.view(at, 32 << 20), src.flip(0).cpu()))
except RuntimeError as exc:
    print("raw copy across two registrations: REFUSED:", str(exc).splitlines()[0])
EOF

  step calibrate_gpu 30 $PY -m gpumem calibrate --device cuda --sizes 256MiB,1GiB --repeat 3 \
    --dir /tmp --out "$LOGS/calibration_gpu.json"
  step doctor 15 $PY -m gpumem doctor
  step bench_native 20 $PY benchmarks/bench_native.py --size 256M --no-write --no-triton --name native_gpu_box
  # the estimator's CUDA memory fit (allocator rounding, fragmentation): a memory section added
  # to the same calibration file, last because the gpu tier already checks it
  step calibrate_memory_gpu 40 $PY -m gpumem calibrate --memory --arch llama --device cuda \
    --out "$LOGS/calibration_gpu.json"
else
  tail -n 40 "$LOGS/build.log"
fi

# What comes back (the device tool returns 8 files at most): the results this run wrote (not a
# committed one), the test log, the probe, the summary, all logs.
fresh=()
for f in triton_crc32c checkpoint_gpu native_gpu_box; do
  for ext in md json; do
    [ "benchmarks/results/$f.$ext" -nt "$LOGS/gpu.txt" ] && fresh+=("$f.$ext")
  done
done
((${#fresh[@]})) && tar -czf "$OUT/results.tar.gz" -C benchmarks/results "${fresh[@]}"
[ -f "$LOGS/gpu_tests.log" ] && cp "$LOGS/gpu_tests.log" "$OUT/"
[ -f "$LOGS/probe.log" ] && cp "$LOGS/probe.log" "$OUT/"
{  # the results tables last: the device tool returns the end of the output
  echo "== machine =="; cat "$LOGS/gpu.txt"
  echo "== probe =="; cat "$LOGS/probe.log" 2>/dev/null
  echo "== calibrate --device cuda =="; cat "$LOGS/calibrate_gpu.log" 2>/dev/null
  echo "== where the snapshot's D2H time goes =="; cat "$LOGS/diagnose_snapshot.log" 2>/dev/null
  echo "== gpu tests =="; tail -n 25 "$LOGS/gpu_tests.log" 2>/dev/null
  echo "== steps =="; printf '%s\n' "${status[@]}" | { column -t -s '|' 2>/dev/null || tr '|' ' '; }
  echo "== results tables (unpack results.tar.gz into benchmarks/results/) =="
  for f in ${fresh[@]+"${fresh[@]}"}; do
    [[ $f == *.md ]] && { echo "-- ${f%.md}"; grep '^|' "benchmarks/results/$f"; }
  done
} > "$LOGS/summary.txt"
cp "$LOGS/summary.txt" "$OUT/"
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
cat "$OUT/summary.txt"
