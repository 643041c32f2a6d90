#!/usr/bin/env bash
# Issue 31 item 4 (c): `dsakit niah` against `dsakit serve` on the shipped tiny model with hierarchical selection
# off (flat top-k) and on, per index-key format, at the model card's grid (models/tools/niah.sh: 1K and 2K tokens,
# top-k 8 and 16, depths 0.1..0.9), CPU. One server per selection rule (the hierarchy is a server setting);
# formats and top-k per request, as in niah.sh. Results: benchmarks/results/hierarchy/niah_tiny_<commit>/<rule>/.
#
#   benchmarks/hierarchy_niah_tiny.sh                  # TRIALS=2 (the model card uses 3; 2 keeps it ~20 min)
#
# Rules: flat (no --hierarchy); hierarchy_default (m = 16 pages: at 1K-2K tokens, ratio 4, a sequence has
# 4-8 index pages of 64 entries, so every page is kept and the selection is the flat one); hierarchy_m1
# (--hierarchy-pages 1: best page + first page + 2 recent = at most 4 pages, fewer than the 8 of a 2K
# context); hierarchy_m1_f0_r1 (--hierarchy-pages 1 --hierarchy-first-pages 0 --hierarchy-recent-pages 1: at
# most 2 pages of the 4 (1K) or 8 (2K)).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
COMMIT=${COMMIT:-$(git rev-parse --short HEAD)}
ROOT=${ROOT:-benchmarks/results/hierarchy/niah_tiny_$COMMIT}
export TRIALS=${TRIALS:-2} PY=${PY:-python3}
RULES=${RULES:-"flat hierarchy_default hierarchy_m1 hierarchy_m1_f0_r1"}
declare -A ARGS=(
  [flat]=""
  [hierarchy_default]="--hierarchy"
  [hierarchy_m1]="--hierarchy --hierarchy-pages 1"
  [hierarchy_m1_f0_r1]="--hierarchy --hierarchy-pages 1 --hierarchy-first-pages 0 --hierarchy-recent-pages 1"
)
mkdir -p "$ROOT"
for rule in $RULES; do
  start=$(date +%s)
  echo "== $rule: dsakit serve ${ARGS[$rule]}"
  OUT="$ROOT/$rule" SERVE_ARGS="${ARGS[$rule]}" models/tools/niah.sh
  echo "$rule: $(( $(date +%s) - start )) s" | tee -a "$ROOT/timing.txt"
done
