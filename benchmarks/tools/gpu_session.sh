#!/usr/bin/env bash
# One call on the GPU machine: build the DeepGEMM anchor, run the GPU tests and the benchmarks, pack results.
#
#   COMMIT=$(git rev-parse --short HEAD) bash benchmarks/tools/gpu_session.sh OUTDIR SECTION...
#
# Sections: tests scores-tests host select selectq deepgemm* peers attention centred layer store sweep decode-sweep prefill-sweep ncu
# ncu-gaps distributed (see the case below);
# a deepgemm section builds the DeepGEMM anchor first (~100 s, once per machine) inside its own chain.
# Sections named "x@N" run pinned to GPU N (CUDA_VISIBLE_DEVICES=N); sections joined with "+" in one argument
# run one after the other, separate arguments run concurrently (one per GPU on a multi-GPU machine).
# Each benchmark writes JSON under /tmp/dsakit-res/<section>; everything is packed into OUTDIR/results.tgz
# with one log per section (the device tool returns at most 8 files).
set -u
out=${1:?OUTDIR}; shift
commit=${COMMIT:-unknown}
res=/tmp/dsakit-res; mkdir -p "$res"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$res/gpu.txt" 2>&1

deepgemm_ready() {
  # DeepGEMM is an anchor to time against, never a dependency; build once per machine (~100 s).
  # The tarball comes from benchmarks/anchors/pack_deepgemm.sh, carried in the ignored .anchors/ folder.
  if [ -f .anchors/deepgemm-54e2261.tgz ]; then
    # shellcheck disable=SC1091
    source benchmarks/anchors/build_deepgemm.sh .anchors/deepgemm-54e2261.tgz >> "$res/deepgemm_build.log" 2>&1 || return 1
  fi
}

streamindex_ready() {
  # StreamIndex: pure Triton, only unpacked (benchmarks/anchors/pack_streamindex.sh made the tarball)
  local tgz
  for tgz in .anchors/streamindex-*.tgz; do
    [ -f "$tgz" ] || continue
    # shellcheck disable=SC1090
    source benchmarks/anchors/build_streamindex.sh "$tgz" >> "$res/streamindex_build.log" 2>&1 || return 1
    return 0
  done
  return 1
}

run_section() {
  local name=$1 gpu=${2:-} limit=${3:-540}
  local dir="$res/$name"; mkdir -p "$dir"
  local env_gpu=()
  [ -n "$gpu" ] && env_gpu=(env CUDA_VISIBLE_DEVICES="$gpu")
  local start=$SECONDS
  case "$name" in
    tests)       "${env_gpu[@]}" timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider tests ;;
    host)        "${env_gpu[@]}" timeout "$limit" python3 benchmarks/bench_indexer.py decode --sections host --out "$dir" --commit "$commit" ;;
    select)      "${env_gpu[@]}" timeout "$limit" python3 benchmarks/bench_indexer.py select --out "$dir" --commit "$commit" ;;
    deepgemm*)   deepgemm_ready || echo "DeepGEMM build failed: timing dsakit alone"
                 "${env_gpu[@]}" timeout "$limit" python3 benchmarks/bench_peers.py --sections select,prefill,decode --out "$dir" --commit "$commit" ;;
    peers)       deepgemm_ready || echo "DeepGEMM build failed: reported as missing"
                 streamindex_ready || echo "StreamIndex not unpacked: reported as missing"
                 "${env_gpu[@]}" timeout "$limit" python3 benchmarks/bench_peers.py --out "$dir" --commit "$commit" ;;
    selectq)     "${env_gpu[@]}" timeout "$limit" python3 benchmarks/bench_indexer.py select --out "$dir" --commit "$commit" --quick ;;
    attention)   "${env_gpu[@]}" timeout "$limit" python3 benchmarks/bench_attention.py --out "$dir" --commit "$commit" ;;
    centred)     "${env_gpu[@]}" timeout "$limit" python3 benchmarks/bench_centred.py --out "$dir" --commit "$commit" ;;
    layer)       "${env_gpu[@]}" timeout "$limit" python3 benchmarks/bench_layer.py --out "$dir" --commit "$commit" ;;
    store)       "${env_gpu[@]}" timeout "$limit" python3 benchmarks/bench_store.py --out "$dir" --commit "$commit" --skip memory ;;
    sweep)       "${env_gpu[@]}" timeout "$limit" python3 benchmarks/tools/sweep_topk.py --out "$dir" --commit "$commit" ;;
    decode-sweep) "${env_gpu[@]}" timeout "$limit" python3 benchmarks/tools/sweep_topk.py --out "$dir" --commit "$commit" \
                   --sections decode --decode-formats fp8,fp4 --next-n 1,2,4 --rep 30 ;;
    prefill-sweep) "${env_gpu[@]}" timeout "$limit" python3 benchmarks/tools/sweep_topk.py --out "$dir" --commit "$commit" \
                   --sections prefill --rep 20 ;;
    scores-tests) "${env_gpu[@]}" timeout "$limit" python3 -m pytest -q -p no:cacheprovider tests/test_scores_triton.py ;;
    ncu)         "${env_gpu[@]}" timeout 240 ncu --clock-control none -k regex:"_index_scores_group|_filter|_final|_order" \
                   -c 8 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
                   --section Occupancy --section LaunchStats python3 benchmarks/tools/profile_topk.py ;;
    ncu-gaps)    # the kernels behind the open gaps: bf16 prefill scores, fp4 decode scores
                 for spec in "prefill bf16 _index_scores_tile" "decode fp4 _index_scores_group"; do
                   read -r mode fmt kernel <<< "$spec"
                   "${env_gpu[@]}" timeout 200 ncu --clock-control none -k regex:"$kernel" -c 2 --section SpeedOfLight \
                     --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
                     --section Occupancy --section LaunchStats --section SourceCounters \
                     python3 benchmarks/tools/profile_topk.py --mode "$mode" --format "$fmt" --n 65536
                 done ;;
    distributed) timeout "$limit" python3 benchmarks/bench_distributed.py --out "$dir" --gpus 2 --commit "$commit" ;;
    *) echo "unknown section $name"; return 2 ;;
  esac > "$res/$name.log" 2>&1
  local rc=$?
  echo "section $name gpu=${gpu:-all} rc=$rc ${SECONDS}s total, $((SECONDS - start))s" | tee -a "$res/summary.txt"
}

run_chain() {
  # "a@0+b@0": one after the other
  local item
  IFS='+' read -ra items <<< "$1"
  for item in "${items[@]}"; do
    local name=${item%@*} gpu=""
    [[ "$item" == *@* ]] && gpu=${item#*@}
    run_section "$name" "$gpu"
  done
}

pids=()
for chain in "$@"; do run_chain "$chain" & pids+=($!); done
wait "${pids[@]}"
tar -czf "$out/results.tgz" -C "$res" .
cp "$res/summary.txt" "$out/" 2>/dev/null
tail -n 5 "$res"/*.log
