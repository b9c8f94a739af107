#!/usr/bin/env bash
# The one GPU check: run on the GPU machine from the repository root. Each option adds a stage; with no stage option
# it runs --smoke --tests --sanitize --bench quick (the check before merging a kernel change).
#
#   bash tools/gpu_check.sh                                   # smoke, GPU tests, compute-sanitizer, quick benchmark
#   bash tools/gpu_check.sh --tests tests/gpu --bench full --bench-args "--impls sage8b,cudnn,flash" --profile 1024,4096
#   bash tools/gpu_check.sh --integrations                    # transformers + diffusers end to end, guard cost
#   bash tools/gpu_check.sh --variants "old new old new"      # same-run A/B of builds in out/device/<name>/
#   bash tools/gpu_check.sh --fingerprint "old new"           # bitwise identity of two builds' outputs
#   bash tools/gpu_check.sh --ncu "new" --ncu-shape "1 32 8192 128 0"
#
# Options:
#   --out DIR            logs and results (default out/gpu_check; summary.txt collects the one-line results)
#   --lib PATH           use this libsage_kernels.so (default: out/device/libsage_kernels.so when present, else build)
#   --archs LIST         SAGE_PATCH_CUDA_ARCHS for the build (default 90a)
#   --sass               registers, spills and instruction counts per kernel (tools/sass_summary.py)
#   --smoke              a few calls of the Hopper kernel against the portable kernel (exit on a mismatch)
#   --tests [PATHS]      pytest -m gpu (default tests/gpu); env PYTEST_TIMEOUT (s, 420), PYTEST_ARGS
#   --sanitize           compute-sanitizer memcheck, racecheck, initcheck, synccheck on kernels_cuda/sanitize_check.cu;
#                        memcheck, racecheck on tools/sagebwd_sanitize.py (the SageBwd kernels: Triton, sm_90a)
#   --bench MODE         benchmarks/bench_kernel.py: quick | full | none; --bench-args "..." extra arguments,
#                        --profile N[,N] per-kernel device times at B=4 H=32 D=128 N
#   --integrations       benchmarks/bench_transformers.py (env TF_SEQS, "8192 32768"), bench_diffusers.py (env
#                        DIFF_CASES, "flux-1024 flux-2048 sd35-1024"), guard_cost.py
#   --variants "A B ..." per build out/device/<A>/libsage_kernels.so: smoke + bench (env BENCH_NS, 1024,4096,16384;
#                        PEERS, sage8b,cudnn for the first variant; NO_SMOKE, builds that skip the smoke check)
#   --multi-gpu          the multi-GPU tests (pytest -m gpu; env MGPU_TESTS, default tests/gpu/test_multigpu_gpu.py
#                        tests/gpu/test_tensor_parallel_gpu.py), then torchrun over every GPU of benchmarks/bench_multigpu.py (env MGPU_ARGS: its arguments;
#                        MGPU_TIMEOUT, s, 420)
#   --fingerprint "A B"  tools/kernel_fingerprint.py --save with each build, then --compare
#   --ncu "A ..."        an ncu profile of one attention launch per build (--ncu-shape "B H N D causal"), with the
#                        source-level summary of tools/ncu_summary.py
#   --tar                pack DIR into DIR.tgz at the end (for harnesses that return few files)
set -u
OUT=out/gpu_check; LIB=""; ARCHS=90a; SASS=0; SMOKE=0; TESTS=""; SANITIZE=0; BENCH=none; BENCH_ARGS=""; PROFILE_N=""
INTEG=0; MGPU=0; VARIANTS=""; FINGERPRINT=""; NCU=""; NCU_SHAPE="1 32 8192 128 0"; TAR=0; STAGES=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift ;;
    --lib) LIB=$2; shift ;;
    --archs) ARCHS=$2; shift ;;
    --sass) SASS=1; STAGES=1 ;;
    --smoke) SMOKE=1; STAGES=1 ;;
    --tests) STAGES=1; if [ $# -gt 1 ] && [ "${2#--}" = "$2" ]; then TESTS=$2; shift; else TESTS=tests/gpu; fi ;;
    --sanitize) SANITIZE=1; STAGES=1 ;;
    --bench) BENCH=$2; STAGES=1; shift ;;
    --bench-args) BENCH_ARGS=$2; shift ;;
    --profile) PROFILE_N=$2; shift ;;
    --integrations) INTEG=1; STAGES=1 ;;
    --multi-gpu) MGPU=1; STAGES=1 ;;
    --variants) VARIANTS=$2; STAGES=1; shift ;;
    --fingerprint) FINGERPRINT=$2; STAGES=1; shift ;;
    --ncu) NCU=$2; STAGES=1; shift ;;
    --ncu-shape) NCU_SHAPE=$2; shift ;;
    --tar) TAR=1 ;;
    -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[ $STAGES = 0 ] && { SMOKE=1; TESTS=tests/gpu/test_kernel_8b.py; SANITIZE=1; BENCH=quick; }

mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=python3
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }
lib_of() { echo "$PWD/out/device/$1/libsage_kernels.so"; }

# --- set-up: wheels carried in .whl/ (e.g. diffusers), the package dirs of pyproject.toml, the library
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv 2>&1 | tee -a "$OUT/summary.txt"
[ -z "$LIB" ] && [ -f out/device/libsage_kernels.so ] && LIB=out/device/libsage_kernels.so
if [ -n "$LIB" ]; then
  cp "$LIB" sage_patch/kernels/libsage_kernels.so
else
  t0=$(date +%s)
  SAGE_PATCH_CUDA_ARCHS=$ARCHS timeout 600 $PY kernels_cuda/build_kernels.py 2>&1 | tail -3
  log "build ($ARCHS): $(( $(date +%s) - t0 )) s"
fi
$PY -c "import sage_patch.kernels as K, torch; print(torch.__version__, K.status())" 2>&1 | tee -a "$OUT/summary.txt"

smoke() {  # the Hopper kernel against the portable kernel at three shapes (one persistent); exit 1 on a mismatch
  timeout 90 $PY - <<'PYEOF'
import sys, torch
import sage_patch.kernels as K
from sage_patch.accuracy import compare
ok = True
for b, h, n, d, causal in [(1, 2, 200, 128, False), (1, 2, 300, 64, True), (4, 32, 2048, 128, True)]:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=g, dtype=torch.float16) for _ in range(3))
    o, l = K.attention(q, k, v, is_causal=causal, pv="wgmma")
    p, lp = K.attention(q, k, v, is_causal=causal, pv="fp8-f16")
    m = compare(o, p)
    print(f"smoke b{b} h{h} n{n} d{d} causal={causal}: vs portable cos {m['cos']:.6f} rel_l1 {m['rel_l1']:.5f}, "
          f"lse maxdiff {float((l - lp).abs().max()):.3g}, finite {bool(torch.isfinite(o).all())}")
    ok &= m["cos"] > 0.999
sys.exit(0 if ok else 1)
PYEOF
}

if [ $SASS = 1 ] && command -v cuobjdump >/dev/null; then
  log "sass"; $PY tools/sass_summary.py 2>&1 | tee -a "$OUT/summary.txt"
fi
if [ $SMOKE = 1 ]; then
  log "smoke"; smoke 2>&1 | tail -4 | tee -a "$OUT/summary.txt"
fi
if [ -n "$TESTS" ]; then
  log "pytest -m gpu $TESTS"
  SAGE_TEST_RESULTS=$OUT/accuracy.jsonl timeout ${PYTEST_TIMEOUT:-420} $PY -m pytest -m gpu $TESTS -q \
      -p no:cacheprovider -rfEs ${PYTEST_ARGS:-} > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$?" | tee -a "$OUT/summary.txt"
  grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3 | tee -a "$OUT/summary.txt"
  grep -E "^(FAILED|ERROR)|^E " "$OUT/pytest.log" | head -30
fi
if [ $SANITIZE = 1 ]; then
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
  if $PY -c "import triton" 2>/dev/null; then  # the SageBwd Triton kernels
    for tool in memcheck racecheck; do
      timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 $PY tools/sagebwd_sanitize.py > /tmp/san.log 2>&1
      echo "compute-sanitizer $tool (SageBwd) rc=$? : $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' /tmp/san.log \
        | tr '\n' ' ')" | tee -a "$OUT/summary.txt"
      { echo "=== $tool SageBwd"; head -c 20000 /tmp/san.log; } >> "$OUT/sanitizer.log"
    done
  fi
fi
if [ "$BENCH" != none ]; then
  log "bench ($BENCH)"
  ARGS="--out $OUT/bench"
  [ "$BENCH" = quick ] && ARGS="$ARGS --quick"
  [ "$BENCH" = full ] && ARGS="$ARGS --profile ${PROFILE_N:-4096}"
  [ "$BENCH" != full ] && [ -n "$PROFILE_N" ] && ARGS="$ARGS --profile $PROFILE_N"
  timeout 400 $PY benchmarks/bench_kernel.py $ARGS $BENCH_ARGS > "$OUT/bench.log" 2>&1
  echo "bench rc=$?" | tee -a "$OUT/summary.txt"
  tail -40 "$OUT/bench.log"
fi
if [ -n "$VARIANTS" ]; then
  first=1
  for v in $VARIANTS; do
    log "variant $v"
    case " ${NO_SMOKE:-} " in  # timing-only builds (wrong results by design) skip the check
      *" $v "*) ;;
      *) SAGE_PATCH_KERNELS_LIB=$(lib_of $v) smoke 2>&1 | tail -4 | tee -a "$OUT/summary.txt" || { echo "smoke failed"; continue; } ;;
    esac
    impls=sage8b; [ $first = 1 ] && impls=${PEERS:-sage8b,cudnn}
    SAGE_PATCH_KERNELS_LIB=$(lib_of $v) timeout ${BENCH_TIMEOUT:-150} $PY benchmarks/bench_kernel.py \
      --out "$OUT/bench_$v" --ns ${BENCH_NS:-1024,4096,16384} --impls $impls --no-accuracy $BENCH_ARGS \
      > "$OUT/bench_$v.log" 2>&1
    grep "^|" "$OUT/bench_$v/bench.md" | tee -a "$OUT/summary.txt"
    first=0
  done
fi
if [ -n "$FINGERPRINT" ]; then
  set -- $FINGERPRINT
  for v in "$@"; do
    SAGE_PATCH_KERNELS_LIB=$(lib_of $v) timeout 300 $PY tools/kernel_fingerprint.py --save "$OUT/fp_$v.pt" 2>&1 | tail -1
  done
  log "fingerprint $1 vs $2"
  $PY tools/kernel_fingerprint.py --compare "$OUT/fp_$1.pt" "$OUT/fp_$2.pt" > "$OUT/fingerprint.log" 2>&1
  echo "fingerprint rc=$? ($(grep -c identical "$OUT/fingerprint.log") identical, $(grep -c DIFFERENT "$OUT/fingerprint.log") different)" \
    | tee -a "$OUT/summary.txt"
  grep -E "DIFFERENT|MISSING" "$OUT/fingerprint.log" | head -20
fi
for v in $NCU; do
  log "ncu $v ($NCU_SHAPE)"
  SAGE_PATCH_KERNELS_LIB=$(lib_of $v) timeout ${NCU_TIMEOUT:-150} ncu --clock-control none --set full \
    --import-source yes -k regex:attn_kernel --launch-skip 1 --launch-count 1 -f -o "$OUT/ncu_$v" \
    $PY tools/profile_once.py $NCU_SHAPE > "$OUT/ncu_$v.log" 2>&1; echo "ncu $v rc=$?"
  ncu -i "$OUT/ncu_$v.ncu-rep" --page details --csv > "$OUT/ncu_${v}_details.csv" 2>&1
  ncu -i "$OUT/ncu_$v.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_${v}_source.csv" 2>&1
  grep -E "Duration|Issue Slots Busy|Compute \(SM\) Throughput|Executed Ipc Active|Registers Per" \
    "$OUT/ncu_${v}_details.csv" | head -8 | tee -a "$OUT/summary.txt"
  $PY tools/ncu_summary.py "$OUT/ncu_${v}_source.csv" 30 > "$OUT/ncu_${v}_summary.txt" 2>&1
  rm -f "$OUT/ncu_$v.ncu-rep"
done
if [ $INTEG = 1 ]; then
  log "integrations"
  $PY -c "import sage_patch; print(sage_patch.integrations.STATUS)" 2>&1 | tail -1 | tee -a "$OUT/summary.txt"
  timeout ${TF_TIMEOUT:-240} $PY benchmarks/bench_transformers.py --seqs ${TF_SEQS:-8192 32768} --out "$OUT/tf" \
    > "$OUT/tf.log" 2>&1
  echo "bench_transformers rc=$?" | tee -a "$OUT/summary.txt"; tail -8 "$OUT/tf.log"
  timeout ${DIFF_TIMEOUT:-220} $PY benchmarks/bench_diffusers.py --cases ${DIFF_CASES:-flux-1024 flux-2048 sd35-1024} \
    --json "$OUT/diffusers.json" --md "$OUT/diffusers.md" > "$OUT/diffusers.log" 2>&1
  echo "bench_diffusers rc=$?" | tee -a "$OUT/summary.txt"; tail -8 "$OUT/diffusers.log"
  timeout 60 $PY benchmarks/guard_cost.py --n 4096 --heads 24 --dim 128 --calls 200 > "$OUT/guard.log" 2>&1
  cat "$OUT/guard.log"
fi
if [ $MGPU = 1 ]; then
  NGPU=$(nvidia-smi -L | wc -l)
  log "multi-gpu ($NGPU GPUs)"
  timeout ${PYTEST_TIMEOUT:-420} $PY -m pytest -m gpu ${MGPU_TESTS:-tests/gpu/test_multigpu_gpu.py tests/gpu/test_tensor_parallel_gpu.py} \
      -q -p no:cacheprovider -rfEs > "$OUT/pytest_mgpu.log" 2>&1
  echo "pytest (multi-gpu) rc=$?" | tee -a "$OUT/summary.txt"
  grep -E "passed|failed|error" "$OUT/pytest_mgpu.log" | tail -3 | tee -a "$OUT/summary.txt"
  grep -E "^(FAILED|ERROR)|^E " "$OUT/pytest_mgpu.log" | head -30
  timeout ${MGPU_TIMEOUT:-420} torchrun --nproc-per-node "$NGPU" benchmarks/bench_multigpu.py --out "$OUT/mgpu" \
      ${MGPU_ARGS:-} > "$OUT/mgpu.log" 2>&1
  echo "bench_multigpu rc=$?" | tee -a "$OUT/summary.txt"
  grep "^|" "$OUT/mgpu/bench_multigpu.md" 2>/dev/null | tee -a "$OUT/summary.txt"
  grep -E "Error|error" "$OUT/mgpu.log" | head -10
fi
[ $TAR = 1 ] && tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
cat "$OUT/summary.txt"
