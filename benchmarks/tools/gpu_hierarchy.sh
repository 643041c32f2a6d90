#!/usr/bin/env bash
# One GPU call of the hierarchical top-k measurements (issue 31): the GPU tests of the hierarchy and the page
# summaries beside the DeepGEMM build, then bench_hierarchy.py's sections. Results under OUT.
#   usage (GPU machine, repository root): bash benchmarks/tools/gpu_hierarchy.sh OUT COMMIT TAG [tests]
set -o pipefail
out=${1:?OUT}; commit=${2:?COMMIT}; tag=${3:?TAG}; tests=${4:-}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
( bash -c 'source benchmarks/anchors/build_deepgemm.sh .anchors/deepgemm-54e2261.tgz' > "$out/dg_build_$tag.log" 2>&1 & )
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu_$tag.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.version.cuda)" >> "$out/gpu_$tag.txt"
if [ -n "$tests" ]; then
  timeout 200 python3 -m pytest -q tests/test_hierarchy.py tests/test_page_summaries.py 2>&1 \
    | tee "$out/gpu_tests_$commit.log" | tail -3
fi
for _ in $(seq 80); do [ -d /tmp/dsakit-anchors/deepgemm/deep_gemm ] && break; sleep 3; done
source benchmarks/anchors/build_deepgemm.sh .anchors/deepgemm-54e2261.tgz || echo "DeepGEMM build failed"
timeout 420 python3 benchmarks/bench_hierarchy.py --commit "$commit" --out "$out" --tag "_$tag" \
  --sections prefill,decode,check 2>&1 | grep -v "^peer" | cut -c1-400
