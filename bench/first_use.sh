#!/usr/bin/env bash
# The first hour on the GPU machine, as a new user meets it: a fresh virtual environment that sees
# the machine's torch (a .pth line, since that torch lives in another venv), `pip install
# --no-build-isolation .` with nothing prebuilt, then README's quick-start example run twice from
# /tmp with an empty cache: the first process builds the extension's bindings and the kernels it
# calls, the second loads them. Writes first_use.md (and the logs) under $1.
#   bash bench/first_use.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: bench/first_use.sh OUT_DIR}
mkdir -p "$OUT"
SRC=$PWD
VENV=/tmp/attngen-first-use-venv
export ATTNGEN_CACHE=/tmp/attngen-first-use-cache
rm -rf "$VENV" "$ATTNGEN_CACHE"
unset PYTHONPATH ATTNGEN_LIB ATTNGEN_JIT

torch_site=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m venv "$VENV"
echo "$torch_site" > "$("$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')/gpu_machine_torch.pth"

seconds() { local t0=$1; python3 -c "import time; print(f'{time.time() - $t0:.1f}')"; }
t0=$(date +%s.%N)
"$VENV/bin/pip" install --no-build-isolation --no-deps --no-index . > "$OUT/pip.log" 2>&1
pip_rc=$?
pip_s=$(seconds "$t0")

cat > /tmp/readme_example.py <<'EOF'
import time; started = time.monotonic()
import torch, attngen
q = torch.randn(2, 8, 4096, 64, device="cuda")          # [B, H, L, E]
k = torch.randn(2, 8, 4096, 64, device="cuda")
v = torch.randn(2, 8, 4096, 64, device="cuda")          # [B, H, L, M]
o = attngen.causal_dot_product(q, k, v)                  # o_t = q_t . sum_{s<=t} k_s^T v_s
x = torch.randn(2, 4096, 8, 64, device="cuda")          # fast-transformers layout [B, L, H, E]
y = attngen.causal_linear_attention(x, x, x)             # elu+1 feature map, normaliser
# not in README: the example's own time, then the check that the answers are right
torch.cuda.synchronize()
print(f"README example: {time.monotonic() - started:.1f} s in this process (imports, CUDA start, builds or loads, the calls)")
from attngen import reference
ref = reference.causal_dot_product(q, k, v)
err = ((o.double() - ref).norm() / ref.norm()).item()
y_ref = reference.causal_linear_attention(x, x, x)
y_err = ((y.double() - y_ref.double()).norm() / y_ref.double().norm()).item()
print(f"attngen from {attngen.__file__}; causal_dot_product rel err {err:.2e}; causal_linear_attention rel err {y_err:.2e}")
assert err < 1e-5 and y_err < 1e-5
EOF
run_example() {  # run_example NAME: README's example from /tmp in a process of its own
  local t0; t0=$(date +%s.%N)
  (cd /tmp && "$VENV/bin/python" /tmp/readme_example.py) > "$OUT/$1.log" 2>&1
  echo "$? $(seconds "$t0")"
}
read -r first_rc first_s <<< "$(run_example first_process)"
read -r second_rc second_s <<< "$(run_example second_process)"
(cd /tmp && "$VENV/bin/python" -m attngen.info) > "$OUT/info.log" 2>&1

{
  echo "# The first hour on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), commit ${ATTNGEN_COMMIT:-unknown}"
  echo
  echo "A fresh venv seeing the machine's torch ($torch_site), \`pip install --no-build-isolation --no-deps --no-index .\`"
  echo "with nothing prebuilt, then README's example from /tmp twice with an empty cache (bench/first_use.sh)."
  echo
  echo "| step | exit | seconds |"
  echo "|---|---|---|"
  echo "| pip install | $pip_rc | $pip_s |"
  echo "| first process (builds the bindings and the kernels it calls) | $first_rc | $first_s |"
  echo "| second process (loads them from the cache) | $second_rc | $second_s |"
  echo
  echo "## first process (stderr and stdout)"
  echo '```'; cat "$OUT/first_process.log"; echo '```'
  echo "## second process"
  echo '```'; cat "$OUT/second_process.log"; echo '```'
  echo "## python -m attngen.info"
  echo '```'; cat "$OUT/info.log"; echo '```'
  echo "## pip install (tail)"
  echo '```'; tail -5 "$OUT/pip.log"; echo '```'
} > "$OUT/first_use.md"
cat "$OUT/first_use.md"
[ "$pip_rc" = 0 ] && [ "$first_rc" = 0 ] && [ "$second_rc" = 0 ]
