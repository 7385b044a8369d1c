#!/usr/bin/env bash
# One call on the GPU machine: build, gpu tests, sanitizers, benchmarks. Logs and results go
# under $OUT (the device tool brings them back); a short table is printed last.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
status=()
step() {  # step NAME COMMAND...: run, log to $OUT/NAME.log, remember pass/fail and seconds
  local name=$1; shift
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  status+=("$name|$rc|$((SECONDS - t0))")
  tail -n 5 "$OUT/$name.log"
  return $rc
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
step build python3 -m codegen build -j 16 || { echo "build failed"; cat "$OUT/build.log" | tail -50; }
step gpu_tests python3 -m pytest -q -m gpu tests/gpu -x -p no:cacheprovider
step memcheck compute-sanitizer --tool memcheck --error-exitcode 1 python3 tests/gpu/sanitize_small.py
step racecheck compute-sanitizer --tool racecheck --error-exitcode 1 python3 tests/gpu/sanitize_small.py
step bench python3 -m bench.causal_linear ${BENCH_ARGS:---quick} --out "$OUT"
echo
echo "| step | rc | seconds |"
echo "|---|---|---|"
for s in "${status[@]}"; do IFS='|' read -r n rc sec <<< "$s"; echo "| $n | $rc | $sec |"; done
[ -f "$OUT/causal_linear.md" ] && cat "$OUT/causal_linear.md"
