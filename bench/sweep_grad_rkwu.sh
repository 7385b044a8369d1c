#!/usr/bin/env bash
# Times the wkv backward's parts under variants of grad_rkwu's build-time knobs (the
# `fixed: grad_rkwu:` section of specs/rwkv.yaml), each set in the spec, regenerated and
# rebuilt, one table per variant:
#   bash bench/sweep_grad_rkwu.sh "minb=3" "prefetch=0 float_v=0"
# Needs a GPU and CUDA torch; the spec and the default build are restored at the end. No
# generated file is edited: a variant goes through the spec, its checks and `codegen gen`.
set -euo pipefail
spec=specs/rwkv.yaml
cp "$spec" /tmp/rwkv.default.yaml
build() { python3 -m codegen build > /dev/null; }
trap 'cp /tmp/rwkv.default.yaml "$spec"; build' EXIT
for variant in default "$@"; do
  cp /tmp/rwkv.default.yaml "$spec"
  if [ "$variant" != default ]; then
    for knob in $variant; do  # rewrite "    <knob>: <value>" inside the grad_rkwu block
      python3 - "$spec" "${knob%%=*}" "${knob#*=}" <<'PY'
import re, sys
path, knob, value = sys.argv[1:]
text = open(path).read()
head, sep, block = text.partition("\n  grad_rkwu:\n")
block, n = re.subn(rf"^(    {knob}: )\d+", rf"\g<1>{value}", block, count=1, flags=re.M)
if not sep or n != 1:
    sys.exit(f"sweep_grad_rkwu: no knob {knob!r} under fixed.grad_rkwu in {path}")
open(path, "w").write(head + sep + block)
PY
    done
  fi
  build
  echo "### $variant"
  python3 -m bench.rwkv_backward_parts
done
