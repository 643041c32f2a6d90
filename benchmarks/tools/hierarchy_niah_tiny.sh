#!/usr/bin/env bash
# Issue 31 item 4 (c): `dsakit niah` against `dsakit serve` on the shipped tiny model with hierarchical selection
# off (flat top-k) and on, per index-key format, at the model card's grid (models/tools/niah.sh: 1K and 2K tokens,
# top-k 8 and 16, depths 0.1..0.9), CPU. One server per selection rule (the hierarchy is a server setting);
# formats and top-k per request, as in niah.sh. Results: benchmarks/results/hierarchy/niah_tiny_<commit>/<rule>/.
#
#   benchmarks/tools/hierarchy_niah_tiny.sh          # the committed run (about 20 minutes on 2 busy CPU cores)
#
# Rules and grids (TRIALS, DEPTHS, LENGTHS per rule below; the model card's grid has 3 trials at 5 depths: this
# one is smaller to stay near 20 minutes of CPU):
# * flat: no --hierarchy; 1K and 2K, depths 0.1 0.3 0.5 0.7 0.9, 2 trials.
# * hierarchy_default: --hierarchy (m = 16 pages; at 1K-2K tokens with ratio 4 a sequence has 4-8 index pages
#   of 64 entries, so every page is kept and the selection is the flat one by construction); 1 trial, depths
#   0.1 0.5 0.9 (a check of the plumbing).
# * hierarchy_m1: --hierarchy-pages 1 (best page + first page + 2 recent pages = at most 4 pages: all of a 1K
#   context's 4, so 2K only, where it keeps 4 of 8); 2 trials, depths 0.1 0.5 0.9.
# * hierarchy_m1_f0_r1: --hierarchy-pages 1 --hierarchy-first-pages 0 --hierarchy-recent-pages 1 (at most 2
#   pages: 2 of 4 at 1K, 2 of 8 at 2K); 1K and 2K, 2 trials, depths 0.1 0.5 0.9.
# RULES picks some (default: all four).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
COMMIT=${COMMIT:-$(git rev-parse --short HEAD)}
ROOT=${ROOT:-benchmarks/results/hierarchy/niah_tiny_$COMMIT}
export PY=${PY:-python3}
RULES=${RULES:-"flat hierarchy_default hierarchy_m1 hierarchy_m1_f0_r1"}
declare -A ARGS=(
  [flat]=""
  [hierarchy_default]="--hierarchy"
  [hierarchy_m1]="--hierarchy --hierarchy-pages 1"
  [hierarchy_m1_f0_r1]="--hierarchy --hierarchy-pages 1 --hierarchy-first-pages 0 --hierarchy-recent-pages 1"
)
declare -A GRID=(  # TRIALS DEPTHS LENGTHS
  [flat]="2 0.1,0.3,0.5,0.7,0.9 1K,2K"
  [hierarchy_default]="1 0.1,0.5,0.9 1K,2K"
  [hierarchy_m1]="2 0.1,0.5,0.9 2K"
  [hierarchy_m1_f0_r1]="2 0.1,0.5,0.9 1K,2K"
)
mkdir -p "$ROOT"
for rule in $RULES; do
  read -r trials depths lengths <<< "${GRID[$rule]}"
  start=$(date +%s)
  echo "== $rule: dsakit serve ${ARGS[$rule]} (trials $trials, depths $depths, lengths $lengths)"
  OUT="$ROOT/$rule" SERVE_ARGS="${ARGS[$rule]}" TRIALS=$trials DEPTHS=$depths LENGTHS=$lengths models/tools/niah.sh
  echo "$rule: $(( $(date +%s) - start )) s" | tee -a "$ROOT/timing.txt"
done
