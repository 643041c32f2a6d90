#!/usr/bin/env bash
# The needle experiment on the trained tiny DSA model (models/dsakit-v4-tiny): `dsakit niah` against
# `dsakit serve`, one sweep per (index-key format, top-k), each through the per-request override
#   {"dsakit": {"index_key_format": F, "topk": K}}
# of a single server. Resumable: rerunning skips the finished cells (niah --resume). Then the combined
# table and heatmaps (models/tools/niah_report.py).
#
#   models/tools/niah.sh                                # the committed grid: the defaults below are the
#                                                       # model card's table (CPU, about 8 minutes on 2 cores)
#   OUT=niah-bf16 FORMATS="bf16" TOPKS="16" models/tools/niah.sh   # one row
#
# The defaults write into $MODEL/eval/niah (the committed results); give OUT to keep them.
# Environment: MODEL (default models/dsakit-v4-tiny), OUT (default $MODEL/eval/niah), FORMATS, TOPKS,
# LENGTHS, DEPTHS, TRIALS, SEED, DEVICE (cpu), PY (python with dsakit importable), SERVE_ARGS (more
# `dsakit serve` flags, e.g. "--hierarchy --hierarchy-pages 1": hierarchical selection, docs/hierarchy.md).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
MODEL=${MODEL:-models/dsakit-v4-tiny}
OUT=${OUT:-$MODEL/eval/niah}
FORMATS=${FORMATS:-"bf16 fp8 fp4 fp8-centred fp4-centred"}
TOPKS=${TOPKS:-"8 16"}
LENGTHS=${LENGTHS:-"1K,2K"}
DEPTHS=${DEPTHS:-"0.1,0.3,0.5,0.7,0.9"}
TRIALS=${TRIALS:-3}
SEED=${SEED:-0}
DEVICE=${DEVICE:-cpu}
PY=${PY:-python3}
SERVE_ARGS=${SERVE_ARGS:-}
NAME=$(basename "$MODEL")
mkdir -p "$OUT"
port_file=$(mktemp)
"$PY" -m dsakit.cli serve --model "$MODEL" --index-key-format bf16 --device "$DEVICE" --port 0 \
  --port-file "$port_file" --max-context 8192 --max-new-tokens 16 $SERVE_ARGS > "$OUT/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -f "$port_file"' EXIT
for _ in $(seq 600); do [ -s "$port_file" ] && break; kill -0 $server || { cat "$OUT/server.log"; exit 1; }; sleep 0.5; done
url="http://127.0.0.1:$(cat "$port_file")/v1"
for fmt in $FORMATS; do
  for k in $TOPKS; do
    run="$OUT/${fmt}_k${k}"
    echo "== $fmt top-$k -> $run"
    resume=(); [ -f "$run/results.jsonl" ] && resume=(--resume)
    "$PY" -m dsakit.cli niah --base-url "$url" --model "$NAME" --endpoint completions --tokenizer "$MODEL" \
      --lengths "$LENGTHS" --depths "$DEPTHS" --trials "$TRIALS" --seed "$SEED" --max-tokens 12 \
      --concurrency 2 --no-progress --extra-body "{\"dsakit\": {\"index_key_format\": \"$fmt\", \"topk\": $k}}" \
      --title "$NAME, $fmt index keys, top-$k${SERVE_ARGS:+, serve $SERVE_ARGS}" --out "$run" "${resume[@]}" | tail -n 12
  done
done
"$PY" models/tools/niah_report.py --runs "$OUT" --out "$OUT"
