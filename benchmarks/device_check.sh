#!/usr/bin/env bash
# The checks that need an accelerator, as one script for a GPU machine; what it found the first
# time is in benchmarks/results/device-check-h200-20261126.md. Each step has its own time limit,
# so one that hangs does not take the others; logs and results JSON go to $OUT (default
# benchmarks/results/device-check). The unit step uses pytest-xdist and pytest-timeout.
# The steps' limits add up to 25 minutes, more than a session's 15 minutes of device time: they
# run in the order of the issues' GPU parts (52's `tidal bench gpu`, then 51's plan-check); pass the
# step names to run as arguments (e.g. `bench_gpu bench_offload`) to run those alone.
set -u -o pipefail
OUT=${OUT:-benchmarks/results/device-check}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
wanted=" $* "
step() {  # step NAME SECONDS CMD...: run CMD with a limit, log to $OUT/NAME.log, record rc
  local name=$1 limit=$2; shift 2
  [ "$wanted" = "  " ] || [[ "$wanted" == *" $name "* ]] || return 0
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/steps.txt"
  tail -n 4 "$OUT/$name.log"
}
nvidia-smi -L | tee "$OUT/steps.txt"
$py -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" | tee -a "$OUT/steps.txt"
step bench_gpu 480 $py -m tidal bench gpu --results-dir "$OUT"
step plan_check 240 $py -m tidal bench plan-check --results-dir "$OUT"
step gpu_tests 90 $py -m pytest -q -rf -p no:cacheprovider tests/gpu
step bench_savers 300 $py -m tidal bench savers --results-dir "$OUT"
step unit_tests 150 env OMP_NUM_THREADS=2 $py -m pytest -q -rf -p no:cacheprovider -n 12 --timeout 100 -m "not slow" \
  tests/unit
step train_demo 60 $py -m tidal train --recipe demo --set training.device=cuda --no-plots \
  --set memory.device_budget=160MiB --set training.steps=60 --set run_dir=/tmp/runs/demo
step train_gpt2 60 $py -m tidal train --recipe gpt2-small --set engine=chunk \
  --set memory.device_budget=3GiB --set training.steps=20 --set training.batch_size=2 --set training.val_every=0 \
  --no-plots --set run_dir=/tmp/runs/gpt2
step bench_offload 120 $py -m tidal bench offload --section overhead --section traffic \
  --steps 12 --repeats 2 --results-dir "$OUT"
