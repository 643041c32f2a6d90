#!/usr/bin/env bash
# The H200 calls of session 8: every run the open speed issues (21, 25, 26) wait for, in three warm calls.
#
#   COMMIT=$(git rev-parse --short HEAD) bash benchmarks/tools/gpu_round8.sh PHASE OUTDIR      (carry .anchors)
#
#   1  FlashMLA build started in its own process session (it outlives the call; phase 2 waits for it), the
#      DeepGEMM build beside the gpu-marked Gluon tests, then bench_centred --runs 2 and the select
#      filters (bench_indexer select --filters).
#   2  (the Gluon bf16 prefill scores step that stood here timed a variant since removed),
#      FlashMLA beside dsakit's attention twice (bench_peers --sections attention-*), the Gluon fp8-KV rows
#      (bench_attention --sections gluon).
#   3  every peer beside dsakit twice (bench_peers), then Nsight Compute on the kernels behind missed targets.
#   4  (after the select defaults changed and FlashMLA's build was fixed) the select filters again with the
#      register sort on both filters, the centred store twice, Nsight Compute on the store and on the centred
#      decode's select, every peer twice, FlashMLA beside dsakit's attention twice.
#   5  (next session) the centred decode step kernel by kernel in CUDA graphs (no name filter), the centred
#      store twice, Nsight Compute on the 8192 x 8192 prefill and on fp4 decode; the gpu-marked suite is a
#      separate call (carry .whl: python3 -m pytest -m gpu tests).
#
# Builds are reused on a warm machine (/tmp/dsakit-anchors); a cold machine rebuilds what a phase needs.
# Every step has its own time limit so a call ends inside the device tool's 10 minutes; results go to
# OUTDIR/phaseN.tgz (one log per step, the JSON each benchmark writes) and OUTDIR/summary_phaseN.txt.
set -u
phase=${1:?PHASE}; out=${2:?OUTDIR}
commit=${COMMIT:-unknown}
res=/tmp/dsakit-r8/phase$phase; mkdir -p "$res"
anchors=/tmp/dsakit-anchors; mkdir -p "$anchors"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv > "$res/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" >> "$res/gpu.txt" 2>&1
echo "commit $commit" >> "$res/gpu.txt"

step() {  # step NAME LIMIT_S COMMAND...: one logged, time-limited step
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$res/$name.log" 2>&1
  echo "step $name rc=$? $((SECONDS - start))s (at ${SECONDS}s)" | tee -a "$res/summary.txt"
}

deepgemm() {  # source the DeepGEMM build (reused when built); 0 when importable
  MAX_JOBS=${1:-16} source benchmarks/anchors/build_deepgemm.sh .anchors/deepgemm-54e2261.tgz >> "$res/deepgemm_build.log" 2>&1
}

flashmla_start() {  # the FlashMLA build in its own process session, on 8 cores, unless built or under way
  [ -f "$anchors/flashmla.started" ] && return 0
  touch "$anchors/flashmla.started"
  setsid nohup bash -c 'MAX_JOBS=8 NVCC_THREADS=1 source benchmarks/anchors/build_flashmla.sh .anchors/flashmla-9241ae3.tgz
                        echo $? > /tmp/dsakit-anchors/flashmla.rc' > "$anchors/flashmla_build.out" 2>&1 < /dev/null &
}

flashmla_wait() {  # wait up to $1 s for the background build, then source it (reused build: no compile)
  local waited=0
  flashmla_start
  while [ ! -f "$anchors/flashmla.rc" ] && [ "$waited" -lt "$1" ]; do sleep 5; waited=$((waited + 5)); done
  echo "flashmla build rc=$(cat "$anchors/flashmla.rc" 2>/dev/null || echo 'not done') after waiting ${waited}s" | tee -a "$res/summary.txt"
  cp "$anchors/flashmla_build.log" "$anchors/flashmla_build.out" "$res/" 2>/dev/null
  [ -f "$anchors/flashmla.rc" ] && source benchmarks/anchors/build_flashmla.sh .anchors/flashmla-9241ae3.tgz >> "$res/flashmla_source.log" 2>&1
}

case "$phase" in
  1)
    flashmla_start
    ( deepgemm 8; echo "deepgemm build rc=$? ${SECONDS}s" >> "$res/summary.txt" ) &
    step gluon_gpu_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_scores_gluon.py tests/test_attention_gluon.py
    wait
    deepgemm || echo "DeepGEMM not importable: its rows are reported missing" | tee -a "$res/summary.txt"
    step centred_targets 230 python3 benchmarks/bench_centred.py --runs 2 --out "$res" --commit "$commit"
    step select_filters 150 python3 benchmarks/bench_indexer.py select --filters --rep 10 --out "$res" --commit "$commit"
    ;;
  2)
    deepgemm || echo "DeepGEMM not importable" | tee -a "$res/summary.txt"
    flashmla_wait 200
    mkdir -p "$res/run1" "$res/run2"
    step attention_vs_flashmla_run1 150 python3 benchmarks/bench_peers.py --sections attention-prefill,attention-decode --out "$res/run1" --commit "$commit"
    step attention_vs_flashmla_run2 150 python3 benchmarks/bench_peers.py --sections attention-prefill,attention-decode --out "$res/run2" --commit "$commit"
    step attention_gluon 120 python3 benchmarks/bench_attention.py --sections gluon --out "$res" --commit "$commit"
    ;;
  3)
    deepgemm || echo "DeepGEMM not importable" | tee -a "$res/summary.txt"
    source benchmarks/anchors/build_streamindex.sh .anchors/streamindex-06e9216.tgz >> "$res/streamindex_build.log" 2>&1 \
      || echo "StreamIndex not unpacked" | tee -a "$res/summary.txt"
    mkdir -p "$res/run1" "$res/run2"
    step peers_run1 200 python3 benchmarks/bench_peers.py --rep 40 --out "$res/run1" --commit "$commit"
    step peers_run2 200 python3 benchmarks/bench_peers.py --rep 40 --out "$res/run2" --commit "$commit"
    ncu_common=(ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis
                --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats)
    step ncu_attention 60 "${ncu_common[@]}" -k regex:"attention" -c 6 python3 benchmarks/tools/profile_attention.py
    step ncu_scores_gluon 50 "${ncu_common[@]}" -k regex:"index_scores" -c 2 python3 benchmarks/tools/profile_topk.py \
      --mode prefill --format bf16 --n 65536 --prefill-kernel gluon
    step ncu_select_thread 50 "${ncu_common[@]}" -k regex:"_filter|_final|_order" -c 6 python3 benchmarks/tools/profile_topk.py \
      --mode decode --format fp8 --n 131072 --stream-filter thread
    step ncu_centred 50 "${ncu_common[@]}" -k regex:"_page_term|_index_scores" -c 4 python3 benchmarks/tools/profile_centred.py
    ;;
  4)
    # FlashMLA (fixed build) and DeepGEMM build in the background while the GPU runs what needs neither
    flashmla_start
    ( deepgemm 6; echo "deepgemm build rc=$? ${SECONDS}s" >> "$res/summary.txt" ) &
    dg_pid=$!
    step select_filters 130 python3 benchmarks/bench_indexer.py select --filters --rep 10 --out "$res" --commit "$commit"
    mkdir -p "$res/store1" "$res/store2"
    step store_centred_run1 100 python3 benchmarks/bench_store.py --out "$res/store1" --commit "$commit" --skip check,bandwidth,memory --centred
    step store_centred_run2 100 python3 benchmarks/bench_store.py --out "$res/store2" --commit "$commit" --skip check,bandwidth,memory --centred
    ncu_common=(ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis
                --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats)
    step ncu_store 60 "${ncu_common[@]}" --nvtx --nvtx-include "profile/" python3 benchmarks/tools/profile_store.py
    step ncu_centred_select 60 "${ncu_common[@]}" -k regex:"_page_term|_index_scores|_filter|_final|_order" -c 6 \
      python3 benchmarks/tools/profile_centred.py
    wait "$dg_pid"
    deepgemm || echo "DeepGEMM not importable" | tee -a "$res/summary.txt"
    source benchmarks/anchors/build_streamindex.sh .anchors/streamindex-06e9216.tgz >> "$res/streamindex_build.log" 2>&1
    mkdir -p "$res/run1" "$res/run2"
    step peers_run1 120 python3 benchmarks/bench_peers.py --rep 40 --out "$res/run1" --commit "$commit"
    step peers_run2 120 python3 benchmarks/bench_peers.py --rep 40 --out "$res/run2" --commit "$commit"
    flashmla_wait 240
    mkdir -p "$res/fm1" "$res/fm2"
    step attention_vs_flashmla_run1 110 python3 benchmarks/bench_peers.py --sections attention-prefill,attention-decode --out "$res/fm1" --commit "$commit"
    step attention_vs_flashmla_run2 110 python3 benchmarks/bench_peers.py --sections attention-prefill,attention-decode --out "$res/fm2" --commit "$commit"
    ;;
  5)
    # the runs Round 8 left (benchmarks/NOTES.md): the centred decode step kernel by kernel, the centred store
    # twice, the short-context prefill and fp4 decode under Nsight Compute, then the gpu-marked suite
    ncu_common=(ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis
                --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats)
    step centred_decode_graph 90 "${ncu_common[@]}" --nvtx --nvtx-include "profile/" --graph-profiling node \
      python3 benchmarks/tools/profile_centred.py --decode-graph
    step centred_fp4_decode_graph 90 "${ncu_common[@]}" --nvtx --nvtx-include "profile/" --graph-profiling node \
      python3 benchmarks/tools/profile_centred.py --decode-graph --format fp4-centred
    mkdir -p "$res/store1" "$res/store2"
    step store_centred_run1 150 python3 benchmarks/bench_store.py --out "$res/store1" --commit "$commit" --skip check,bandwidth,memory --centred
    step store_centred_run2 100 python3 benchmarks/bench_store.py --out "$res/store2" --commit "$commit" --skip check,bandwidth,memory --centred
    step select_sample_groups 120 python3 benchmarks/bench_indexer.py select --sample-groups --rep 20 --out "$res" --commit "$commit"
    step ncu_prefill_8k 60 "${ncu_common[@]}" -k regex:"_index_scores|_filter|_final|_order" -c 8 \
      python3 benchmarks/tools/profile_topk.py --mode prefill --format fp8 --n 8192 --t 8192
    step ncu_select_prefill 60 "${ncu_common[@]}" -k regex:"_filter|_final|_order" -c 3 python3 benchmarks/tools/profile_topk.py \
      --mode prefill --format fp8 --n 65536
    step ncu_fp4_decode 60 "${ncu_common[@]}" -k regex:"_index_scores" -c 2 python3 benchmarks/tools/profile_topk.py \
      --mode decode --format fp4 --n 65536
    step peers_decode 120 python3 benchmarks/bench_peers.py --sections decode --next-n 1 --rep 40 --out "$res" \
      --commit "$commit"
    ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
tar -czf "$out/phase$phase.tgz" -C "$res" .
cp "$res/summary.txt" "$out/summary_phase$phase.txt" 2>/dev/null
cat "$res/summary.txt"
