#!/usr/bin/env bash
# Makes StreamIndex (`import flash_sparse`) importable on the GPU machine from the tarball made by
# pack_streamindex.sh. Pure Triton: nothing is compiled here (its kernels compile on first use).
#
#   source benchmarks/anchors/build_streamindex.sh .anchors/streamindex-06e9216.tgz
#
# Unpacks into $DSAKIT_ANCHOR_DIR/streamindex (default /tmp/dsakit-anchors) and prepends it to PYTHONPATH;
# returns non-zero if the tarball is missing or the package does not import, so a benchmark can report the
# peer as missing.
_si_tgz=${1:-}
if [ -z "$_si_tgz" ] || [ ! -f "$_si_tgz" ]; then
  echo "usage: source build_streamindex.sh PATH/TO/streamindex-<commit>.tgz (not found: '${_si_tgz}')" >&2
  return 2 2>/dev/null || exit 2
fi
_si_dir=${DSAKIT_ANCHOR_DIR:-/tmp/dsakit-anchors}/streamindex
rm -rf "$_si_dir" && mkdir -p "$_si_dir" && tar -xzf "$_si_tgz" -C "$_si_dir" --strip-components=1
if ! PYTHONPATH=$_si_dir${PYTHONPATH:+:$PYTHONPATH} python3 -c "import flash_sparse.triton.chunked_indexer" 2>&1; then
  echo "StreamIndex does not import from $_si_dir" >&2
  return 1 2>/dev/null || exit 1
fi
export PYTHONPATH=$_si_dir${PYTHONPATH:+:$PYTHONPATH}
unset _si_tgz _si_dir
