#!/usr/bin/env bash
# Scale-out on one multi-GPU host: the deterministic all-reduce against psum, and the
# training job on 1, 2, 4, ... of its GPUs and as 2 processes (each with half of them).
#
#   bash benchmarks/scaleout.sh allreduce   # benchmarks/allreduce.py + the ceiling probe
#   bash benchmarks/scaleout.sh train       # benchmarks/train.py on 1..N GPUs, 2 processes
#   bash benchmarks/scaleout.sh demo        # the demo's fingerprint on every layout
#   bash benchmarks/scaleout.sh bits        # the kernels' tests that need 2+ GPUs (a mesh
#                                           # of all of them keeps one GPU's bits)
#
# Records land in $OUT (the device machine) or benchmarks/results/. Every train.py run
# uses the same gradient groups (TRAIN_GROUPS, default: the GPU count), so every run must
# print the same fingerprint.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1
py=${PYTHON:-python3}
n=$($py -c 'import jax; print(jax.local_device_count())')
counts=()
for ((k = 1; k <= n; k *= 2)); do counts+=("$k"); done
visible() { seq -s, 0 $(($1 - 1)); }
status=0

for what in "$@"; do
  case "$what" in
    allreduce)
      $py benchmarks/allreduce.py || status=1
      $py benchmarks/archive/allreduce_ceiling.py || status=1
      ;;
    train)
      groups=${TRAIN_GROUPS:-$n}
      for k in "${counts[@]}"; do
        CUDA_VISIBLE_DEVICES=$(visible "$k") $py benchmarks/train.py --groups "$groups" \
          --batch "${BATCH:-16}" --json "train-x$k.json" || status=1
      done
      $py -m tessera_jax.launch --nproc 2 --devices-per-proc $((n / 2)) benchmarks/train.py \
        --groups "$groups" --batch "${BATCH:-16}" --json "train-x$n-p2.json" || status=1
      ;;
    demo)
      for k in "${counts[@]}"; do
        echo "demo on $k GPU(s):"
        $py -m tessera_jax demo --devices "$k" | grep fingerprint: || status=1
      done
      echo "demo on $n GPUs as dp=$((n / 2)),tp=2:"
      $py -m tessera_jax demo --mesh "dp=$((n / 2)),tp=2" | grep fingerprint: || status=1
      echo "demo as 2 processes x $((n / 2)) GPUs:"
      $py -m tessera_jax.launch --nproc 2 --devices-per-proc $((n / 2)) -m tessera_jax demo |
        grep fingerprint: || status=1
      ;;
    bits)
      XLA_PYTHON_CLIENT_PREALLOCATE=false $py -m pytest -m gpu -q -rf -p no:cacheprovider \
        -k "mesh_of_the_gpus or nvlink_all_reduce" tests/ || status=1
      ;;
    *)
      echo "scaleout.sh: unknown part $what (allreduce, train, demo, bits)" >&2
      exit 2
      ;;
  esac
done
exit $status
