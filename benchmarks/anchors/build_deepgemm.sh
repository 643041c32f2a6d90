#!/usr/bin/env bash
# Builds and installs DeepGEMM on the GPU machine from the tarball made by pack_deepgemm.sh, then exports
# what `import deep_gemm` needs. Source it (it sets PYTHONPATH and friends for the benchmarks that follow):
#
#   source benchmarks/anchors/build_deepgemm.sh .anchors/deepgemm-54e2261.tgz
#   python benchmarks/bench_vs_deepgemm.py ...
#
# The extension build takes about 100 s on 16 cores; a second call on the same machine reuses the install in
# $DSAKIT_ANCHOR_DIR/deepgemm (default /tmp/dsakit-anchors). DeepGEMM JIT-compiles each kernel on first use
# (seconds each) into $DG_JIT_CACHE_DIR. Returns non-zero (and prints the build log's tail) on failure, so
# callers can report DeepGEMM as missing instead of stopping.
_dg_tgz=${1:-}
if [ -z "$_dg_tgz" ] || [ ! -f "$_dg_tgz" ]; then
  echo "usage: source build_deepgemm.sh PATH/TO/deepgemm-54e2261.tgz (not found: '${_dg_tgz}')" >&2
  return 2 2>/dev/null || exit 2
fi
_dg_root=${DSAKIT_ANCHOR_DIR:-/tmp/dsakit-anchors}
_dg_install=$_dg_root/deepgemm
_dg_log=$_dg_root/deepgemm_build.log
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
if [ ! -d "$_dg_install/deep_gemm" ]; then
  mkdir -p "$_dg_root" && rm -rf "$_dg_root/deepgemm-src" && mkdir -p "$_dg_root/deepgemm-src"
  if ! ( tar -xzf "$_dg_tgz" -C "$_dg_root/deepgemm-src" \
         && cd "$_dg_root/deepgemm-src/DeepGEMM" \
         && MAX_JOBS=${MAX_JOBS:-$(nproc)} python3 setup.py -q bdist_wheel \
         && python3 -m pip install -q --no-deps --no-index --target "$_dg_install" dist/*.whl \
         && cp ANCHOR_SOURCES "$_dg_install/" ) > "$_dg_log" 2>&1; then
    echo "DeepGEMM build failed (log: $_dg_log):" >&2; tail -20 "$_dg_log" >&2
    rm -rf "$_dg_install"
    return 1 2>/dev/null || exit 1
  fi
fi
export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-$_dg_root/deepgemm-jit}
export PYTHONPATH=$_dg_install${PYTHONPATH:+:$PYTHONPATH}
# deep_gemm's extension crashes on its first iostream use when the interpreter loaded an older libstdc++
# first; preloading the system one avoids the mismatch.
if [ -f /usr/lib/x86_64-linux-gnu/libstdc++.so.6 ]; then
  export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6${LD_PRELOAD:+:$LD_PRELOAD}
fi
unset _dg_tgz _dg_root _dg_install _dg_log
