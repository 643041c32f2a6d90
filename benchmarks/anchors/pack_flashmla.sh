#!/usr/bin/env bash
# Packs the sources needed to build FlashMLA (deepseek-ai/FlashMLA @ 9241ae3) for sm_90 into one tarball that
# can be carried to the GPU machine, where build_flashmla.sh builds it. FlashMLA is a peer we time against
# (benchmarks/bench_attention_vs_flashmla.py: its sparse prefill and sparse decode), never a dependency of dsakit.
#
#   usage: benchmarks/anchors/pack_flashmla.sh FLASHMLA_GIT CUTLASS_GIT [OUT.tgz]
#     *_GIT   git directories (bare clones are fine) of github.com/deepseek-ai/FlashMLA and
#             github.com/NVIDIA/cutlass; each must hold the commit used below
#     OUT.tgz default .anchors/flashmla-9241ae3.tgz (an ignored folder, so it travels only when carried)
#
# The cutlass commit is not hard-coded: it is read from FlashMLA's own submodule entry (csrc/cutlass), so the
# headers are exactly the ones FlashMLA was released against. Only what the build reads is packed: setup.py,
# the flash_mla package, csrc/ (the sm100 sources stay: setup.py compiles every source it lists and
# csrc/api/api.cpp links them all; FLASH_MLA_DISABLE_SM100=1 at build time only drops the sm_100f code
# generation), cutlass/include, cutlass/tools/util/include and the licences: about 4 MB compressed.
set -euo pipefail
flashmla_git=${1:?usage: pack_flashmla.sh FLASHMLA_GIT CUTLASS_GIT [OUT.tgz]}
cutlass_git=${2:?CUTLASS_GIT missing}
out=${3:-.anchors/flashmla-9241ae3.tgz}
flashmla_commit=9241ae3

cutlass_commit=$(git --git-dir="$flashmla_git" ls-tree "$flashmla_commit" csrc/cutlass | awk '$2 == "commit" {print $3}')
[ -n "$cutlass_commit" ] || { echo "no csrc/cutlass submodule pin found in FlashMLA $flashmla_commit" >&2; exit 1; }

staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
root=$staging/FlashMLA
mkdir -p "$root"
git --git-dir="$flashmla_git" archive "$flashmla_commit" setup.py flash_mla csrc LICENSE | tar -x -C "$root"
mkdir -p "$root/csrc/cutlass"  # git archive leaves the submodule as an empty folder (or none)
git --git-dir="$cutlass_git" archive "$cutlass_commit" include tools/util/include LICENSE.txt | tar -x -C "$root/csrc/cutlass"
# Record what went in, so a benchmark can report the peer's exact sources.
printf 'FlashMLA %s\ncutlass %s\n' \
  "$(git --git-dir="$flashmla_git" rev-parse "$flashmla_commit")" "$cutlass_commit" > "$root/ANCHOR_SOURCES"

mkdir -p "$(dirname "$out")"
tar -czf "$out" -C "$staging" FlashMLA
echo "wrote $out ($(du -h "$out" | cut -f1)): FlashMLA $flashmla_commit, cutlass ${cutlass_commit:0:12}"
