#!/usr/bin/env bash
# One device call: load (or build) the kernels, SASS summary, GPU tests, compute-sanitizer, benchmark.
# Logs go to $OUT (default out/gpu_check). Usage on the GPU machine, from the repo root:
#   BENCH=quick|full|none TESTS=1 SANITIZE=1 bash scripts/gpu_check.sh
# GPU_TESTS: test paths (default tests/gpu/test_kernel_8b.py); PYTEST_TIMEOUT (s, default 420); PYTEST_ARGS: extra.
# Uses a prebuilt out/device/libsage_kernels.so + out/device/sanitize_check when present (carried), else builds
# for sm_90a here.
set -u
OUT=${OUT:-out/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
BENCH=${BENCH:-quick}; TESTS=${TESTS:-1}; SANITIZE=${SANITIZE:-1}
PY=python3
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }

nvidia-smi -L 2>&1 | tee -a "$OUT/summary.txt"
if [ -f out/device/libsage_kernels.so ]; then
  cp out/device/libsage_kernels.so sage_patch/kernels/
else
  t0=$(date +%s)
  SAGE_PATCH_CUDA_ARCHS=${SAGE_PATCH_CUDA_ARCHS:-90a} timeout 300 $PY kernels_cuda/build_kernels.py 2>&1 | tail -3
  log "build: $(( $(date +%s) - t0 )) s"
fi
$PY -c "import sage_patch.kernels as K, torch; print(torch.__version__, K.status())" 2>&1 | tee -a "$OUT/summary.txt"

if command -v cuobjdump >/dev/null; then
  cuobjdump --dump-sass sage_patch/kernels/libsage_kernels.so > /tmp/sass.txt 2>&1
  $PY - /tmp/sass.txt <<'EOF' | tee -a "$OUT/summary.txt"
import re, sys, collections
cur, counts = None, collections.OrderedDict()
for line in open(sys.argv[1]):
    m = re.search(r"Function : (\S+)", line)
    if m:
        cur = m.group(1); counts[cur] = collections.Counter(); continue
    if cur:
        for op in ("IMMA", "HMMA", "QMMA", "HGMMA", "IGMMA", "QGMMA", "UBLKCP", "SYNCS", "LDSM", "LDL", "STL", "F2FP"):
            if re.search(r"\b" + op + r"\b", line) or re.search(r"\b" + op + r"\.", line):
                counts[cur][op] += 1
for f, c in counts.items():
    if "attn_kernel" in f:
        print(f[-70:], dict(c))
EOF
fi

if [ "$TESTS" = 1 ]; then
  log "pytest -m gpu tests/gpu"
  SAGE_TEST_RESULTS=$OUT/accuracy.jsonl timeout ${PYTEST_TIMEOUT:-420} $PY -m pytest -m gpu \
      ${GPU_TESTS:-tests/gpu/test_kernel_8b.py} -q -p no:cacheprovider -rfEs -s ${PYTEST_ARGS:-} \
      > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$?" | tee -a "$OUT/summary.txt"
  grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3 | tee -a "$OUT/summary.txt"
  grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/pytest.log" | head -30
fi

if [ "$SANITIZE" = 1 ]; then
  SAN=out/device/sanitize_check
  if [ ! -x "$SAN" ]; then
    nvcc -std=c++17 -O1 -gencode=arch=compute_90a,code=sm_90a -o /tmp/sanitize_check kernels_cuda/sanitize_check.cu \
      -Isage_patch/kernels -Ikernels_cuda -Lsage_patch/kernels -lsage_kernels -Xlinker -rpath,$PWD/sage_patch/kernels
    SAN=/tmp/sanitize_check
  else
    export LD_LIBRARY_PATH=$PWD/out/device${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  fi
  for tool in memcheck racecheck initcheck synccheck; do
    timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 "$SAN" > /tmp/san.log 2>&1
    echo "compute-sanitizer $tool rc=$? : $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^OK|FAILED' /tmp/san.log | tr '\n' ' ')" \
      | tee -a "$OUT/summary.txt"
    { echo "=== $tool"; head -c 20000 /tmp/san.log; } >> "$OUT/sanitizer.log"
  done
fi

if [ "$BENCH" != none ]; then
  log "bench ($BENCH)"
  ARGS="--out $OUT/bench"
  [ "$BENCH" = quick ] && ARGS="$ARGS --quick"
  [ -n "${BENCH_ARGS:-}" ] && ARGS="$ARGS $BENCH_ARGS"
  [ "$BENCH" = full ] && ARGS="$ARGS --profile ${PROFILE_N:-4096}"
  timeout 400 $PY scripts/bench_kernel.py $ARGS > "$OUT/bench.log" 2>&1
  echo "bench rc=$?" | tee -a "$OUT/summary.txt"
  tail -40 "$OUT/bench.log"
fi
cat "$OUT/summary.txt"
