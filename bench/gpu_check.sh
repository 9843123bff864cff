#!/usr/bin/env bash
# The whole GPU check in one command (for the accelerator machine): GPU tests, then the overlap
# benchmark. Logs go to $OUT (default ./gpu-out). Needs pytest importable (pip install pytest).
#   bash bench/gpu_check.sh [tests|quick|bench|all]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"; export OUT
export PYTHONPATH="$PWD/daemon:$PWD/client:${PYTHONPATH:-}"
what="${1:-all}"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
if [[ $what == tests || $what == all || $what == quick ]]; then
  python -m pytest -q -p no:cacheprovider tests/gpu/test_triton_kernels.py tests/gpu/test_gpu.py \
    tests/engine/test_overlap.py tests/gpu/test_flash_attention.py -k "not default_model" > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests: $(tail -1 "$OUT/gpu_tests.log")"
fi
if [[ $what == quick ]]; then
  python bench/overlap_gpu.py --layers 2 --new-tokens 64 --scaling "" --profile-steps 16 > "$OUT/bench_quick.log" 2>&1
  tail -8 "$OUT/bench_quick.log"
fi
if [[ $what == bench || $what == all ]]; then
  python bench/overlap_gpu.py "${@:2}" > "$OUT/bench.log" 2>&1
  tail -14 "$OUT/bench.log"
fi
