#!/usr/bin/env bash
# One device call: full-size transformers/diffusers architectures (random bf16 weights) with and without sage,
# plus the runtime guard's cost. Needs the diffusers wheel carried in .whl/ (the GPU image has no diffusers).
#   OUT=... TF_SEQS="8192 32768" DIFF_CASES="flux-1024 flux-2048 sd35-1024" bash scripts/gpu_integrations.sh
set -u
OUT=${OUT:-out/gpu_integrations}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -f out/device/libsage_kernels.so ]; then cp out/device/libsage_kernels.so sage_patch/kernels/
else SAGE_PATCH_CUDA_ARCHS=90a timeout 300 python3 kernels_cuda/build_kernels.py 2>&1 | tail -2; fi
python3 -c "import sage_patch, torch; from sage_patch import kernels; print(torch.__version__, kernels.status()); print(sage_patch.integrations.STATUS)" 2>&1 | tail -2 | tee "$OUT/summary.txt"

timeout ${TF_TIMEOUT:-240} python3 scripts/bench_transformers.py --seqs ${TF_SEQS:-8192 32768} --out "$OUT/tf" > "$OUT/tf.log" 2>&1
echo "bench_transformers rc=$?" | tee -a "$OUT/summary.txt"; tail -15 "$OUT/tf.log"
timeout ${DIFF_TIMEOUT:-220} python3 scripts/bench_diffusers.py --cases ${DIFF_CASES:-flux-1024 flux-2048 sd35-1024} \
  --json "$OUT/diffusers.json" --md "$OUT/diffusers.md" > "$OUT/diffusers.log" 2>&1
echo "bench_diffusers rc=$?" | tee -a "$OUT/summary.txt"; tail -15 "$OUT/diffusers.log"
timeout 60 python3 scripts/guard_cost.py --n 4096 --heads 24 --dim 128 --calls 200 > "$OUT/guard.log" 2>&1
cat "$OUT/guard.log"
