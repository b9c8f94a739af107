#!/usr/bin/env bash
# One device call for the Hopper kernel: per prebuilt variant in out/device/<name>/libsage_kernels.so, a smoke check
# against the portable kernel and a quick benchmark; then the GPU tests with the first variant. Usage (repo root):
#   VARIANTS="pp1s3 pp0s3" BENCH_NS=1024,4096,16384 bash scripts/hopper_variants.sh
set -u
OUT=${OUT:-out/hopper}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
first=1
for v in ${VARIANTS:-pp1s3}; do
  export SAGE_PATCH_KERNELS_LIB=$PWD/out/device/$v/libsage_kernels.so
  echo "=== variant $v" | tee -a "$OUT/summary.txt"
  case " ${NO_SMOKE:-} " in  # timing-only variants (wrong results by design) skip the check
    *" $v "*) ;;
    *) timeout 90 python3 scripts/hopper_smoke.py 2>&1 | tail -4 | tee -a "$OUT/summary.txt" || { echo "smoke failed"; continue; } ;;
  esac
  impls=sage8b
  [ $first = 1 ] && impls=${PEERS:-sage8b,cudnn}
  timeout ${BENCH_TIMEOUT:-150} python3 scripts/bench_kernel.py --out "$OUT/bench_$v" --ns ${BENCH_NS:-1024,4096,16384} \
     --impls $impls --no-accuracy ${BENCH_EXTRA:-} > "$OUT/bench_$v.log" 2>&1
  grep "^|" "$OUT/bench_$v/bench.md" | tee -a "$OUT/summary.txt"
  grep -A12 "Device time" "$OUT/bench_$v/bench.md" | tee -a "$OUT/summary.txt"
  first=0
done
if [ -n "${TESTS:-}" ]; then
  export SAGE_PATCH_KERNELS_LIB=$PWD/out/device/${TEST_VARIANT:-pp1s3}/libsage_kernels.so
  SAGE_TEST_RESULTS=$OUT/accuracy.jsonl timeout ${PYTEST_TIMEOUT:-200} python3 -m pytest -m gpu $TESTS -q \
      -p no:cacheprovider -rfEs > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$?" | tee -a "$OUT/summary.txt"
  grep -E "passed|failed" "$OUT/pytest.log" | tail -2 | tee -a "$OUT/summary.txt"
  grep -E "^(FAILED|ERROR)|^E " "$OUT/pytest.log" | head -20 | tee -a "$OUT/summary.txt"
fi
