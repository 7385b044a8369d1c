#!/usr/bin/env bash
# Times the wkv backward's parts under variants of grad_rkwu's build-time knobs (the #defines
# at the top of templates/rwkv/grad_rkwu.cu.j2), each rebuilt in place, one table per variant:
#   bash bench/sweep_grad_rkwu.sh "GRAD_RKWU_MINB=2" "GRAD_RKWU_PREFETCH=0 GRAD_RKWU_FLOAT_V=0"
# Needs a built tree (make build) and a GPU; the default build is restored at the end.
set -euo pipefail
src=generated/rwkv/grad_rkwu.cu
build() { ninja -f generated/build.ninja build/lib/attngen_ext.so > /dev/null; }
cp "$src" /tmp/grad_rkwu.default.cu
trap 'cp /tmp/grad_rkwu.default.cu "$src"; build' EXIT
for variant in default "$@"; do
  cp /tmp/grad_rkwu.default.cu "$src"
  if [ "$variant" != default ]; then
    for knob in $variant; do sed -i "s/^#define ${knob%%=*} .*/#define ${knob%%=*} ${knob#*=}/" "$src"; done
  fi
  build
  echo "### $variant"
  python3 -m bench.rwkv_backward_parts
done
