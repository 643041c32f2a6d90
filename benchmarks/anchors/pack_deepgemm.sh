#!/usr/bin/env bash
# Packs the sources needed to build DeepGEMM (deepseek-ai/DeepGEMM @ 54e2261) into one tarball that can be
# carried to the GPU machine, where build_deepgemm.sh builds it. DeepGEMM is a peer we time against
# (benchmarks/bench_vs_deepgemm.py, bench_peers.py), never a dependency of dsakit.
#
#   usage: benchmarks/anchors/pack_deepgemm.sh DEEPGEMM_GIT CUTLASS_GIT FMT_GIT [OUT.tgz]
#     *_GIT   git directories (bare clones are fine) of github.com/deepseek-ai/DeepGEMM,
#             github.com/NVIDIA/cutlass and github.com/fmtlib/fmt; each must hold the commit used below
#     OUT.tgz default .anchors/deepgemm-54e2261.tgz (an ignored folder, so it travels only when carried)
#
# The cutlass and fmt commits are not hard-coded: they are read from DeepGEMM's own submodule entries, so
# the headers are exactly the ones DeepGEMM was released against. Only what the build reads is packed
# (DeepGEMM's tree, cutlass/include, fmt/include, and their licences): about 3 MB.
set -euo pipefail
deepgemm_git=${1:?usage: pack_deepgemm.sh DEEPGEMM_GIT CUTLASS_GIT FMT_GIT [OUT.tgz]}
cutlass_git=${2:?CUTLASS_GIT missing}
fmt_git=${3:?FMT_GIT missing}
out=${4:-.anchors/deepgemm-54e2261.tgz}
deepgemm_commit=54e2261

submodule_commit() {  # the commit DeepGEMM pins for third-party/$1
  git --git-dir="$deepgemm_git" ls-tree "$deepgemm_commit" "third-party/$1" | awk '$2 == "commit" {print $3}'
}
cutlass_commit=$(submodule_commit cutlass)
fmt_commit=$(submodule_commit fmt)
[ -n "$cutlass_commit" ] && [ -n "$fmt_commit" ] || { echo "no submodule pins found in DeepGEMM $deepgemm_commit" >&2; exit 1; }

staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
root=$staging/DeepGEMM
mkdir -p "$root/third-party/cutlass" "$root/third-party/fmt"
git --git-dir="$deepgemm_git" archive "$deepgemm_commit" | tar -x -C "$root"
git --git-dir="$cutlass_git" archive "$cutlass_commit" include LICENSE.txt | tar -x -C "$root/third-party/cutlass"
git --git-dir="$fmt_git" archive "$fmt_commit" include LICENSE | tar -x -C "$root/third-party/fmt"
# Record what went in, so a benchmark can report the peer's exact sources.
printf 'DeepGEMM %s\ncutlass %s\nfmt %s\n' \
  "$(git --git-dir="$deepgemm_git" rev-parse "$deepgemm_commit")" "$cutlass_commit" "$fmt_commit" > "$root/ANCHOR_SOURCES"

mkdir -p "$(dirname "$out")"
tar -czf "$out" -C "$staging" DeepGEMM
echo "wrote $out ($(du -h "$out" | cut -f1)): DeepGEMM $deepgemm_commit, cutlass ${cutlass_commit:0:12}, fmt ${fmt_commit:0:12}"
