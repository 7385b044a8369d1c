#!/usr/bin/env bash
# One call on the GPU machine: build, then the STEPS (default: gpu tests, sanitizers,
# benchmarks, tuned vs default; tune_causal_linear / tune_rwkv / tune_rwkv_grad / tune_paged / tune_delta_rule / tune_gated_delta_grad / tune_flash_attention / tune_flash_attention_grad a cold and a warm
# tuning run of the family (TUNE_WARM=0: the cold one only; TUNE_RESUME=1: resume from a carried cache; TUNE_BUCKETS="a b": those buckets only) (one worker per visible GPU; BUILD=0 skips the default build); jit_tests / jit_bench (instances built on first use), core_tests / first_use (no prebuilt extension: its bindings and kernels built on first use; first_use in a fresh venv), linear_tests, rwkv_tests/rwkv_bench, paged_tests/paged_bench/paged_serving/paged_host/paged_timeline/paged_graph_timeline/paged_cold, delta_tests/delta_bench/delta_quick/delta_shipped/delta_backward_bench/ncu_gated_delta/rwkv7_profile/ncu_rwkv7_grad/ncu_rwkv7_fwd/rwkv7_kinds, flash_tests/flash_fp8_tests/flash_grad_tests/flash_bench/flash_fp8_bench/flash_grad_det/flash_grad_host/flash_grad_profile/ncu_flash_grad, paged_attention_tests/paged_attention_bench run one family's; `retune` adds a fresh second tuning run compared with the
# committed table; SANITIZE="paged ..." limits the sanitizer steps to the named families). Logs and results go under $OUT
# (also bundled in $OUT/all.tgz); a short table is printed last. `ab` times a change against the
# tree without it in one call (AB_PATCH, AB_CMD: see the step below); `ab_jit` the same with the
# kernels built on first use instead of `make build` (BUILD=0); where AB_CMD prints per-kernel
# listings (bench.rwkv7_profile and the like), $OUT/r/ab_table.md has them side by side.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT/r"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
status=()
JOBS=${JOBS:-$(nproc)}  # compile jobs: every core of the machine
# Unset: the default steps. Set and empty (STEPS=""): none, only the build or PREBUILD (a call that
# then runs its own commands; with ":-" an empty STEPS once ran the whole default list instead).
STEPS=${STEPS-gpu_tests memcheck racecheck bench rwkv_bench paged_bench flash_bench tune_compare}
# The steps run in this file's order, not STEPS' (delta_quick runs before ab_jit whatever STEPS says):
# a capped call loses its last steps in this order.
want() { [[ " $STEPS " == *" $1 "* ]]; }
step() {  # step NAME COMMAND...: run, log to $OUT/r/NAME.log, remember exit status and seconds
  local name=$1; shift
  local t0=$SECONDS
  # STEP_S caps each step (exit 124 when it ran out); CAP, set for one call, overrides it there
  timeout "${CAP:-${STEP_S:-1800}}" "$@" > "$OUT/r/$name.log" 2>&1
  local rc=$?
  status+=("$name|$rc|$((SECONDS - t0))")
  tail -n 3 "$OUT/r/$name.log"
  # The bundle refreshed after every step: a call cut by the device's limit still brings back the
  # logs of the steps it finished (bundled only at the end, they came back only from calls that ended).
  tar -czf "$OUT/all.tgz" -C "$OUT/r" . 2>/dev/null
  return $rc
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/r/device.txt"
if [ "${BUILD:-1}" = 1 ]; then  # BUILD=0: the steps need no default build (the tune steps build their own)
  # The build's own cap (BUILD_S): a STEP_S sized for short steps cut it half way once, and every
  # kernel of the steps after it was then built on first use.
  CAP=${BUILD_S:-900} step build python3 -m codegen build -j "$JOBS" || tail -50 "$OUT/r/build.log"
fi
# PREBUILD="delta_rule gated_delta_grad ...": those families' instances and the bindings built into
# the first-use cache (python -m attngen.prebuild), with BUILD=0 in place of `make build`: their
# tests (which run on first-use builds where no extension is prebuilt) and benchmarks then compile
# nothing, after a build of a tenth of the instances for the delta-rule families.
if [ -n "${PREBUILD:-}" ]; then CAP=${BUILD_S:-900} step prebuild python3 -m attngen.prebuild $PREBUILD -j "$JOBS"; fi
# The benchmark extension (bench-role kinds, forced side by side with the dispatched ones).
# BENCH_SPECS="specs/a.yaml ...": only those specs' bench-role kinds (a shorter build).
bench_specs=(); for s in ${BENCH_SPECS:-}; do bench_specs+=(--spec "$s"); done
if want bench || want paged_bench || want flash_bench || want flash_grad_bench || want delta_bench || want bench_build; then step bench_build python3 -m codegen build --bench -j "$JOBS" "${bench_specs[@]}"; fi
# TEST_K="expr": the test steps run only the tests pytest -k selects (a change's own tests in a
# short call; one call's cap once cut a whole tier before it reached the backward under test).
test_k=(); [ -n "${TEST_K:-}" ] && test_k=(-k "$TEST_K")
want gpu_tests && step gpu_tests python3 -m pytest -q -m gpu tests/gpu "${test_k[@]}" -p no:cacheprovider
want memcheck && step memcheck compute-sanitizer --tool memcheck --error-exitcode 1 python3 tests/gpu/sanitize_small.py ${SANITIZE:-}
want racecheck && step racecheck compute-sanitizer --tool racecheck --error-exitcode 1 python3 tests/gpu/sanitize_small.py ${SANITIZE:-}
want linear_tests && step linear_tests python3 -m pytest -q -m gpu tests/gpu/test_causal_linear.py "${test_k[@]}" -p no:cacheprovider -s
want rwkv_tests && step rwkv_tests python3 -m pytest -q -m gpu tests/gpu/test_rwkv.py "${test_k[@]}" -p no:cacheprovider
want paged_tests && step paged_tests python3 -m pytest -q -m gpu tests/gpu/test_paged.py "${test_k[@]}" -p no:cacheprovider
want jit_tests && step jit_tests python3 -m pytest -q -m gpu tests/gpu/test_jit.py "${test_k[@]}" -p no:cacheprovider -s
want delta_tests && step delta_tests python3 -m pytest -q -m gpu tests/gpu/test_delta_rule.py "${test_k[@]}" -p no:cacheprovider -s
want flash_tests && step flash_tests python3 -m pytest -q -m gpu tests/gpu/test_flash_attention.py "${test_k[@]}" -p no:cacheprovider -s
want flash_fp8_tests && step flash_fp8_tests python3 -m pytest -q -m gpu tests/gpu/test_flash_attention_fp8.py "${test_k[@]}" -p no:cacheprovider
want paged_attention_tests && step paged_attention_tests python3 -m pytest -q -m gpu tests/gpu/test_paged_attention.py "${test_k[@]}" -p no:cacheprovider
want flash_grad_tests && step flash_grad_tests python3 -m pytest -q -m gpu tests/gpu/test_flash_attention_grad.py "${test_k[@]}" -p no:cacheprovider -s
want bench && step bench python3 -m bench.causal_linear ${BENCH_ARGS:-} --out "$OUT/r"
want rwkv_bench && step rwkv_bench python3 -m bench.rwkv ${BENCH_ARGS:-} --out "$OUT/r"
want linear_sweep && step linear_sweep python3 -m bench.chunked_vs_recurrent --out "$OUT/r"
want paged_bench && step paged_bench python3 -m bench.paged ${BENCH_ARGS:-} --out "$OUT/r"
want jit_bench && step jit_bench python3 -m bench.jit_first_use --out "$OUT/r"
want core_tests && step core_tests python3 -m pytest -q -m gpu tests/gpu/test_core.py "${test_k[@]}" -p no:cacheprovider -s
want first_use && step first_use bash bench/first_use.sh "$OUT/r/first_use" && cp "$OUT/r/first_use/first_use.md" "$OUT/"
want delta_bench && step delta_bench python3 -m bench.delta_rule ${BENCH_ARGS:-} --out "$OUT/r"
# Without the benchmark extension: the peers and the dispatched kinds only (no forced instances).
want delta_quick && step delta_quick python3 -m bench.delta_rule --no-forced ${BENCH_ARGS:-} --out "$OUT/r"
# The shipped instances forced beside the dispatch, without building the benchmark extension
# (163 TUs with every spec's bench kinds: a cold call's build and that one leave no time to time).
want delta_shipped && step delta_shipped python3 -m bench.delta_rule ${BENCH_ARGS:-} --out "$OUT/r"
want delta_backward_bench && step delta_backward_bench python3 -m bench.gated_delta_backward --out "$OUT/r"
ncu_stalls() {  # ncu_stalls NAME KERNEL_REGEX COUNT COMMAND...: Nsight Compute over COUNT kernels; stall samples summed by bench/ncu_stalls.py
  local name=$1 regex=$2 count=$3; shift 3
  step "ncu_$name" ncu --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SourceCounters -k regex:"$regex" -c "$count" -f -o "$OUT/r/$name" "$@"
  ncu -i "$OUT/r/$name.ncu-rep" --page details > "$OUT/r/${name}_ncu.txt"
  ncu -i "$OUT/r/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/r/${name}_sass.csv"
  python3 -m bench.ncu_stalls "$OUT/r/${name}_sass.csv" > "$OUT/r/${name}_stalls.txt"
  # The same counters per line of the generated CUDA source (the kernels carry -lineinfo), for
  # reading where a template's phases stall; kept even where this ncu cannot print it.
  ncu -i "$OUT/r/$name.ncu-rep" --page source --csv --print-source cuda > "$OUT/r/${name}_cuda.csv" 2>&1 || true
  gzip -f "$OUT/r/${name}_sass.csv" "$OUT/r/${name}_cuda.csv"
  rm -f "$OUT/r/$name.ncu-rep"
}
# One Gated DeltaNet forward and backward; the flash attention backward at three shapes and two deterministic ones.
want ncu_gated_delta && ncu_stalls gated_delta "prepare_kernel|chunk_kernel|walk_kernel|grads_kernel" 5 python3 -m bench.gated_delta_profile --once
# RWKV-7's training step per kernel (torch.profiler); one dispatched backward under Nsight Compute.
want rwkv7_profile && step rwkv7_profile python3 -m bench.rwkv7_profile
want ncu_rwkv7_grad && ncu_stalls rwkv7_grad "grad_kernel" 1 python3 -m bench.rwkv7_profile --once
want ncu_rwkv7_fwd && ncu_stalls rwkv7_fwd "chunk_kernel" 1 python3 -m bench.rwkv7_profile --once
want rwkv7_kinds && step rwkv7_kinds python3 -m bench.rwkv7_kinds ${KINDS_ARGS:-}
# GRAD_PROFILE_ARGS="--d=256": one head size's shapes only (each profiled kernel counts toward NCU_COUNT).
want flash_grad_profile && step flash_grad_profile python3 -m bench.flash_grad_profile ${GRAD_PROFILE_ARGS:-}
want ncu_flash_grad && ncu_stalls flash_grad "backward_kernel" "${NCU_COUNT:-5}" python3 -m bench.flash_grad_profile --once ${GRAD_PROFILE_ARGS:-}
want flash_bench && step flash_bench python3 -m bench.flash_attention ${BENCH_ARGS:-} --out "$OUT/r"
want flash_fp8_bench && step flash_fp8_bench python3 -m bench.flash_attention_fp8 --out "$OUT/r"
want flash_grad_bench && step flash_grad_bench python3 -m bench.flash_attention_grad ${GRAD_BENCH_ARGS:-} --out "$OUT/r"
want flash_grad_host && step flash_grad_host python3 -m bench.flash_grad_host --out "$OUT/r"
want flash_grad_det && step flash_grad_det python3 -m bench.flash_grad_deterministic ${DET_ARGS:-} --out "$OUT/r"
want paged_attention_bench && step paged_attention_bench python3 -m bench.paged_attention --out "$OUT/r"
want paged_serving && step paged_serving python3 -m bench.paged_serving --out "$OUT/r"
want paged_host && step paged_host python3 -m bench.paged_host --out "$OUT/r"
want paged_timeline && step paged_timeline python3 -m bench.paged_timeline --out "$OUT/r"
want paged_graph_timeline && step paged_graph_timeline python3 -m bench.paged_graph_timeline --out "$OUT/r"
want paged_cold && step paged_cold python3 -m bench.paged_cold --out "$OUT/r"
if want bank_check; then  # the bank model against ncu's per-instruction counts (bench/bank_check.py)
  W="$OUT/r/banks"; mkdir -p "$W"
  step bank_prepare python3 -m bench.bank_check --prepare --work "$W"
  step bank_ncu ncu --clock-control none --section SourceCounters --kernel-name-base mangled --kernel-name regex:attngen \
    -f -o "$W/profile" python3 -m bench.bank_check --launch --work "$W"
  ncu -i "$W/profile.ncu-rep" --page source --csv --print-source sass --print-kernel-base mangled > "$W/sass.csv"
  probe_flags="-O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a"
  nvcc $probe_flags -o "$W/probe" "$PWD/bench/bankprobe/patterns.cu" && nvcc $probe_flags -cubin -o "$W/probe.cubin" \
    "$PWD/bench/bankprobe/patterns.cu" && nvdisasm -c -gi "$W/probe.cubin" > "$W/probe_lines.txt" \
    && ncu --clock-control none --section SourceCounters --kernel-name-base mangled -f -o "$W/probe" "$W/probe" \
    && ncu -i "$W/probe.ncu-rep" --page source --csv --print-source sass --print-kernel-base mangled > "$W/probe_sass.csv"
  rm -rf "$W"/*.ncu-rep "$W"/cubins_* "$W/probe"
  export ATTNGEN_MODEL_COMMIT=${ATTNGEN_COMMIT:-}  # this tree's model judges the counts
  step bank_check python3 -m bench.bank_check --summarize --work "$W" --out "$OUT/r"
fi
want tune_compare && step tune_compare python3 -m bench.tune_compare --out "$OUT/r"
# A/B in one call: AB_PATCH (a `git diff` of the change under test, applied in this tree) is taken
# back, the tree regenerated and rebuilt (ninja redoes what the patch touches) and AB_CMD run with
# its results under $OUT/r/ab_before; then the patch goes back in, the same again into
# $OUT/r/ab_after. AB_CMD is a command line whose {out} is replaced by that folder, e.g.
#   STEPS=ab AB_PATCH=ab.patch AB_CMD='python3 -m bench.paged_serving --out {out}'
if want ab; then
  for side in before after; do
    if [ "$side" = before ]; then patch -R -p1 < "$AB_PATCH"; else patch -p1 < "$AB_PATCH"; fi > "$OUT/r/ab_patch_$side.log" 2>&1 \
      || { echo "ab: the patch did not apply ($side)"; status+=("ab_$side|1|0"); break; }
    step "ab_build_$side" bash -c "python3 -m codegen gen && python3 -m codegen build -j $JOBS" || break
    mkdir -p "$OUT/r/ab_$side"
    ATTNGEN_COMMIT="${ATTNGEN_COMMIT:-tree}-ab-$side" step "ab_$side" bash -c "${AB_CMD//\{out\}/$OUT/r/ab_$side}"
  done
fi
# ab_jit: the same A/B without building the extension: each side's kernels build on first use,
# in a JIT cache of the side's own (the bindings about 20 s, 5-8 s an instance), for a change to
# the few instances AB_CMD calls, where a cold `make build` takes 3-4 minutes of a call. A
# prebuilt extension is moved aside for it: a process loads one before any first-use build (an
# A/B on a warm machine once timed call 3's prebuilt kernels on both sides). Run with BUILD=0.
# GPU tests as AB_CMD build their instances on first use (each side's own cache): name few.
# Several patches, AB_PATCH="a.patch b.patch" (the tree holding them all, in that order): the
# before side without any, then after_1 with a, ..., after with all of them, so that one call
# tells each step's share (this session's first A/B of three changes at once could not).
ab_jit_side() {  # ab_jit_side NAME: the tree regenerated, AB_CMD run with a JIT cache of its own
  python3 -m codegen gen > "$OUT/r/ab_gen_$1.log" 2>&1 || { echo "ab_jit: gen failed ($1)"; return 1; }
  mkdir -p "$OUT/r/ab_$1"
  ATTNGEN_CACHE="/tmp/attngen_ab_jit_$1" ATTNGEN_COMMIT="${ATTNGEN_COMMIT:-tree}-ab-$1" \
    step "ab_$1" bash -c "${AB_CMD//\{out\}/$OUT/r/ab_$1}"
  return 0  # AB_CMD failing on one side still leaves the others to run
}
if want ab_jit; then
  aside=build/lib/attngen_ext.so
  [ -f "$aside" ] && mv "$aside" "$aside.ab_jit"
  read -r -a patches <<< "$AB_PATCH"
  applied=${#patches[@]}
  while [ "$applied" -gt 0 ] && patch -R -p1 < "${patches[applied - 1]}" >> "$OUT/r/ab_patch_before.log" 2>&1; do
    applied=$((applied - 1))
  done
  if [ "$applied" -gt 0 ]; then
    echo "ab_jit: ${patches[applied - 1]} did not come off the tree"; status+=("ab_before|1|0")
  elif ab_jit_side before; then
    for ((i = 1; i <= ${#patches[@]}; i++)); do
      side=after; [ "$i" -lt "${#patches[@]}" ] && side=after_$i
      patch -p1 < "${patches[i - 1]}" > "$OUT/r/ab_patch_$side.log" 2>&1 \
        || { echo "ab_jit: ${patches[i - 1]} did not apply"; status+=("ab_$side|1|0"); break; }
      ab_jit_side "$side" || break
    done
  fi
  [ -f "$aside.ab_jit" ] && mv "$aside.ab_jit" "$aside"
fi
# Per-kernel listings an AB_CMD wrote (bench.*_profile) side by side, for the results file.
if want ab || want ab_jit; then
  python3 -m bench.ab_table "$OUT/r" > "$OUT/r/ab_table.md" && cat "$OUT/r/ab_table.md"
fi
for fam in causal_linear rwkv rwkv_grad paged delta_rule gated_delta_grad flash_attention flash_attention_grad; do  # tune_<family>: a cold tune (its cache cleared), then a warm one
  if want "tune_$fam"; then
    # TUNE_RESUME=1: keep the measurement cache (build/tune/<family>/cache.jsonl, carried in from
    # an earlier call) and time only what it lacks; either way the cache goes back as
    # $OUT/tune_cache_<family>.jsonl, so a tune longer than one call finishes over several.
    if [ "${TUNE_RESUME:-0}" = 1 ]; then
      find "build/tune/$fam" -mindepth 1 ! -name cache.jsonl -delete 2>/dev/null
    else
      rm -rf "build/tune/$fam"
    fi
    # TUNE_BUCKETS="a b": those buckets only (the committed run JSON seeds the other buckets' rows)
    bucket_args=(); for b in ${TUNE_BUCKETS:-}; do bucket_args+=(--bucket "$b"); done
    if [ -n "${TUNE_BUCKETS:-}" ]; then mkdir -p "$OUT/r/tune" && cp "bench/results/h100/tune_$fam.json" "$OUT/r/tune/" 2>/dev/null; fi
    step "tune_$fam" python3 -m codegen tune "specs/$fam.yaml" -j "$JOBS" --out "$OUT/r/tune" "${bucket_args[@]}"
    cp "build/tune/$fam/cache.jsonl" "$OUT/tune_cache_$fam.jsonl" 2>/dev/null
    if [ "${TUNE_WARM:-1}" = 1 ]; then step "tune_${fam}_warm" python3 -m codegen tune "specs/$fam.yaml" -j "$JOBS" --out "$OUT/r/tune_warm"; fi
    cp "tuned/sm_90a/$fam.yaml" "$OUT/r/tune/tuned_$fam.yaml"
    cat "$OUT/r/tune/tune_$fam.md"
  fi
done
# After a tune in this call: the new table's dispatch generated and built, then timed and tested
# (regen, then paged_serving_tuned / paged_tests_tuned / flash_bench_tuned / flash_grad_tests_tuned), before the machine and its table go back.
if want regen; then step regen bash -c "python3 -m codegen gen && python3 -m codegen build -j $JOBS"; fi
want paged_serving_tuned && step paged_serving_tuned python3 -m bench.paged_serving --out "$OUT/r/tuned"
want flash_bench_tuned && step flash_bench_tuned python3 -m bench.flash_attention ${BENCH_ARGS:-} --out "$OUT/r/tuned"
want paged_tests_tuned && step paged_tests_tuned python3 -m pytest -q -m gpu tests/gpu/test_paged.py -p no:cacheprovider
# A table tuned in this call shipped only after the tier ran its instances: its own check is one small shape.
want flash_grad_tests_tuned && step flash_grad_tests_tuned python3 -m pytest -q -m gpu tests/gpu/test_flash_attention_grad.py -p no:cacheprovider -s
if want retune; then
  cp bench/results/h100/tune_causal_linear.json "$OUT/r/tune_first.json"
  rm -rf build/tune
  step retune python3 -m codegen tune specs/causal_linear.yaml -j 16 --out "$OUT/r/retune"
  step retune_check python3 -m bench.tune_repeat_check "$OUT/r/tune_first.json" "$OUT/r/retune/tune_causal_linear.json"
  cp "$OUT/r/retune/tune_causal_linear.json" "$OUT/r/tune_second.json"
  cp tuned/sm_90a/causal_linear.yaml "$OUT/r/tuned_second.yaml"
fi
tar -czf "$OUT/all.tgz" -C "$OUT/r" .
cp "$OUT/r/causal_linear.md" "$OUT/r/chunked_vs_recurrent.md" "$OUT/r/tuned_vs_default.md" "$OUT/r/rwkv.md" "$OUT/r/paged.md" "$OUT/r/flash_attention.md" "$OUT/r/flash_attention_grad.md" "$OUT/r/bank_check.md" "$OUT/r/jit_first_use.md" "$OUT/r/paged_attention.md" "$OUT/r/paged_attention.json" "$OUT/r/flash_attention_fp8.md" "$OUT/r/flash_attention_fp8.json" "$OUT/r/delta_rule.md" "$OUT/r/gated_delta_backward.md" "$OUT/" 2>/dev/null
echo
echo "| step | rc | seconds |"
echo "|---|---|---|"
for s in "${status[@]}"; do IFS='|' read -r n rc sec <<< "$s"; echo "| $n | $rc | $sec |"; done
cat "$OUT/r/causal_linear.md" "$OUT/r/tuned_vs_default.md" "$OUT/r/rwkv.md" "$OUT/r/paged.md" "$OUT/r/flash_attention.md" "$OUT/r/flash_attention_grad.md" "$OUT/r/bank_check.md" 2>/dev/null
if [ -f "$OUT/r/retune_check.log" ]; then cat "$OUT/r/retune_check.log"; fi
