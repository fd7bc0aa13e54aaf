#!/usr/bin/env bash
# Times a command with the kernels as they are ("now") and with some kernel files replaced by
# older ones ("before"), interleaved now / before / now / before in one session of the GPU, on a
# machine where the package is not installed (the import paths are shims, as in gpu_round.sh).
#   mkdir -p before_kernels && git show COMMIT:kernels/moe_gemm.py > before_kernels/moe_gemm.py
#   BEFORE_DIR=before_kernels bash bench/ab_kernels.sh python3 bench/bench_moe_prefill.py --ts 1024,4096
# ROUNDS (default 2) pairs of runs; the output of each run is prefixed with its label.
set -u
BEFORE_DIR=${BEFORE_DIR:?a directory of kernel files from before}
mkdir -p /tmp/shim/localchat /tmp/shimb/localchat
for d in kernels engine app; do ln -sfn "$PWD/$d" /tmp/shim/localchat/$d; done
rm -rf /tmp/kb && cp -r kernels /tmp/kb && cp "$BEFORE_DIR"/*.py /tmp/kb/
ln -sfn /tmp/kb /tmp/shimb/localchat/kernels
for d in engine app; do ln -sfn "$PWD/$d" /tmp/shimb/localchat/$d; done
export PYTHONUNBUFFERED=1
for round in $(seq "${ROUNDS:-2}"); do
  for side in now before; do
    shim=/tmp/shim; [ "$side" = before ] && shim=/tmp/shimb
    PYTHONPATH=$shim "$@" 2>&1 | grep -v Warn | sed "s/^/[$side $round] /"
  done
done
