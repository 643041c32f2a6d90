#!/usr/bin/env bash
# Packs StreamIndex (package `flash_sparse`: a pure-Triton DeepSeek-V4 lightning indexer with a chunked
# partition-merge top-k) into a tarball for the GPU machine, where build_streamindex.sh makes it importable.
# A peer we time against (benchmarks/bench_peers.py), never a dependency of dsakit.
#
#   usage: benchmarks/anchors/pack_streamindex.sh STREAMINDEX_GIT [COMMIT] [OUT.tgz]
#     STREAMINDEX_GIT  git directory (a bare clone is fine) of github.com/tsukimia-hoshi/StreamIndex
#     COMMIT           default 06e9216 (see below)
#     OUT.tgz          default .anchors/streamindex-<COMMIT>.tgz (an ignored folder, carried when asked)
#
# Which source: the original repository (RightNow-AI/StreamIndex, last commit d9c1b67) does not parse as
# published (its Python files lost their indentation, e.g. flash_sparse/reference.py line 74), so its
# `chunked_indexer_topk` cannot run. The fork tsukimia-hoshi/StreamIndex restored the indentation and the
# missing call parentheses in the merge 06e9216; its later head (4346e18) reverted that again. 06e9216 is
# therefore the newest public StreamIndex whose indexer runs. Only the package and its licence are packed
# (about 60 KB): the kernels are Triton, compiled on first use, so nothing is built.
set -euo pipefail
si_git=${1:?usage: pack_streamindex.sh STREAMINDEX_GIT [COMMIT] [OUT.tgz]}
commit=${2:-06e9216}
out=${3:-.anchors/streamindex-${commit}.tgz}
staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
mkdir -p "$staging/StreamIndex"
git --git-dir="$si_git" archive "$commit" flash_sparse LICENSE pyproject.toml | tar -x -C "$staging/StreamIndex"
# the package must at least parse: a tarball of unparsable sources would only fail later, on the GPU
python3 -m py_compile $(find "$staging/StreamIndex/flash_sparse" -name '*.py')
find "$staging" -name __pycache__ -prune -exec rm -rf {} +
printf 'StreamIndex %s\n' "$(git --git-dir="$si_git" rev-parse "$commit")" > "$staging/StreamIndex/ANCHOR_SOURCES"
mkdir -p "$(dirname "$out")"
tar -czf "$out" -C "$staging" StreamIndex
echo "wrote $out ($(du -h "$out" | cut -f1)): StreamIndex $commit"
