#!/usr/bin/env bash
# Builds FlashMLA (sm_90a kernels only) on the GPU machine from the tarball made by pack_flashmla.sh, then
# exports what `import flash_mla` needs. Source it (it sets PYTHONPATH for the benchmarks that follow):
#
#   source benchmarks/anchors/build_flashmla.sh .anchors/flashmla-9241ae3.tgz
#   python benchmarks/bench_attention_vs_flashmla.py ...
#
# FLASH_MLA_DISABLE_SM100=1 drops the sm_100f code generation and FLASH_MLA_DISABLE_FP16=1 the fp16 dense
# decode (both are FlashMLA's own setup.py switches); nothing is downloaded (build_ext --inplace, no pip).
# CUDA 13 keeps libcu++ (cuda/std/...) under include/cccl, which nvcc adds by itself but the host compiler
# does not: the binding (csrc/api/api.cpp, built by g++) includes cutlass headers that need it, so the
# folder goes on CPLUS_INCLUDE_PATH (the first H200 build at 312c102 failed there).
# A second call on the same machine reuses the build in $DSAKIT_ANCHOR_DIR/flashmla (default
# /tmp/dsakit-anchors). Returns non-zero (and prints the build log's tail) on failure, so callers can report
# FlashMLA as missing instead of stopping.
_fm_tgz=${1:-}
if [ -z "$_fm_tgz" ] || [ ! -f "$_fm_tgz" ]; then
  echo "usage: source build_flashmla.sh PATH/TO/flashmla-9241ae3.tgz (not found: '${_fm_tgz}')" >&2
  return 2 2>/dev/null || exit 2
fi
_fm_root=${DSAKIT_ANCHOR_DIR:-/tmp/dsakit-anchors}
_fm_install=$_fm_root/flashmla
_fm_log=$_fm_root/flashmla_build.log
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
# the built tree is the install: flash_mla/ with its extension flash_mla/cuda*.so next to the Python files
if ! ls "$_fm_install"/flash_mla/cuda*.so >/dev/null 2>&1; then
  mkdir -p "$_fm_root" && rm -rf "$_fm_install" "$_fm_root/flashmla-src" && mkdir -p "$_fm_root/flashmla-src"
  if ! ( echo "ninja: $(command -v ninja || echo 'absent (BuildExtension then compiles the sources one by one)')" \
         && tar -xzf "$_fm_tgz" -C "$_fm_root/flashmla-src" \
         && cd "$_fm_root/flashmla-src/FlashMLA" \
         && if [ -d "$CUDA_HOME/include/cccl" ]; then export CPLUS_INCLUDE_PATH=$CUDA_HOME/include/cccl${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}; fi \
         && FLASH_MLA_DISABLE_SM100=1 FLASH_MLA_DISABLE_FP16=1 NVCC_THREADS=${NVCC_THREADS:-2} \
            MAX_JOBS=${MAX_JOBS:-$(nproc)} python3 setup.py build_ext --inplace \
         && ls flash_mla/cuda*.so \
         && mkdir -p "$_fm_install" && cp -r flash_mla ANCHOR_SOURCES LICENSE "$_fm_install/" ) > "$_fm_log" 2>&1; then
    echo "FlashMLA build failed (log: $_fm_log):" >&2; tail -20 "$_fm_log" >&2
    rm -rf "$_fm_install"
    return 1 2>/dev/null || exit 1
  fi
fi
# an extension built against the system libstdc++ crashes when the interpreter loaded an older one first
# (seen with DeepGEMM on the same machine); preloading the system one avoids the mismatch.
if [ -f /usr/lib/x86_64-linux-gnu/libstdc++.so.6 ] && [[ ":${LD_PRELOAD:-}:" != *":/usr/lib/x86_64-linux-gnu/libstdc++.so.6:"* ]]; then
  export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6${LD_PRELOAD:+:$LD_PRELOAD}
fi
if ! PYTHONPATH=$_fm_install${PYTHONPATH:+:$PYTHONPATH} python3 -c "import flash_mla" >> "$_fm_log" 2>&1; then
  echo "FlashMLA built but does not import (log: $_fm_log):" >&2; tail -20 "$_fm_log" >&2
  return 1 2>/dev/null || exit 1
fi
export PYTHONPATH=$_fm_install${PYTHONPATH:+:$PYTHONPATH}
unset _fm_tgz _fm_root _fm_install _fm_log
