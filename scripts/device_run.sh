#!/usr/bin/env bash
# One device call (issue 4 kernel work): variants' speed, GPU tests on one variant, ncu profiles, SASS. Everything
# lands in $OUT/r.tgz (the device returns at most 8 files). Env: VARIANTS, NO_SMOKE, TEST_VARIANT, TESTS, NCU (list of
# variants to profile), NCU_SHAPE ("B H N D causal"), SASS (variants to disassemble).
set -u
R=/tmp/r; mkdir -p $R
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PWD:/tmp/site
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $R/gpu.txt 2>&1
fn='hopper_attn_kernelILi128E6__half'
for v in ${SASS:-}; do
  cuobjdump -sass out/device/$v/libsage_kernels.so 2>/dev/null | awk -v f="$fn" '/Function :/{on = index($0, f) > 0} on' > $R/sass_$v.txt
  echo "sass $v: $(wc -l < $R/sass_$v.txt) lines"
done
if [ -n "${VARIANTS:-}" ]; then
  OUT=$R VARIANTS="$VARIANTS" bash scripts/hopper_variants.sh 2>&1 | tail -100
fi
for v in ${NCU:-}; do
  export SAGE_PATCH_KERNELS_LIB=$PWD/out/device/$v/libsage_kernels.so
  timeout ${NCU_TIMEOUT:-150} ncu --clock-control none --set full --import-source yes -k regex:hopper_attn_kernel \
    --launch-skip 1 --launch-count 1 -f -o $R/ncu_$v python3 scripts/profile_once.py ${NCU_SHAPE:-1 32 8192 128 0} \
    > $R/ncu_$v.log 2>&1; echo "ncu $v rc=$?"; tail -3 $R/ncu_$v.log
  ncu -i $R/ncu_$v.ncu-rep --page details --csv > $R/ncu_${v}_details.csv 2>&1
  ncu -i $R/ncu_$v.ncu-rep --page source --csv --print-source sass > $R/ncu_${v}_source.csv 2>&1 || \
    ncu -i $R/ncu_$v.ncu-rep --page source --csv > $R/ncu_${v}_source.csv 2>&1
  grep -E "Duration|Issue Slots Busy|Compute \(SM\) Throughput|Executed Ipc Active|Registers Per" $R/ncu_${v}_details.csv | head -8
  rm -f $R/ncu_$v.ncu-rep
done
if [ -n "${TRACE:-}" ]; then  # phase clocks per tile (a -DSAGE_HOP_TRACE=1 build in out/device/$TRACE)
  SAGE_PATCH_KERNELS_LIB=$PWD/out/device/$TRACE/libsage_kernels.so timeout 120 python3 scripts/hop_trace.py \
    ${TRACE_SHAPES:-} > $R/trace.txt 2>&1; echo "trace rc=$?"; cat $R/trace.txt
fi
tar czf $OUT/r.tgz -C /tmp r
ls -la $OUT
