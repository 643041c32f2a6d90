#!/usr/bin/env bash
# Train several variants of the tiny DSA model side by side on one GPU (the model is too small to fill it),
# then pack the best one (highest teacher-forced exact match at 1024 tokens, top-k) with its resume state.
# Usage: bash models/tools/variants.sh OUT BUDGET_SECONDS NAME="ARGS" [NAME="ARGS" ...]
# Each variant shares COMMON below and adds its ARGS; logs in OUT/NAME.log, checkpoints in OUT/NAME/.
# Returns (what the device tool can bring back): OUT/NAME.log per variant, OUT/logs.tgz (every train_log.json),
# OUT/best.tgz (config, weights, log, curves of the best variant), OUT/best_resume.pt, OUT/best.txt.
set -u
out=$1; budget=$2; shift 2
common="--tokenizer models/dsakit-v4-tiny --device cuda --seed 0 --topk 32 --eval-lengths 1024,2048,4096 \
  --eval-docs 4 --workers 3 --budget-seconds $budget --save-every-seconds 60"
names=()
for spec in "$@"; do
  name=${spec%%=*}; extra=${spec#*=}; names+=("$name")
  # shellcheck disable=SC2086
  PYTHONUNBUFFERED=1 python3 -m dsakit.models.train --out "$out/$name" $common $extra > "$out/$name.log" 2>&1 &
done
wait
python3 - "$out" "${names[@]}" <<'PY'
import json, sys, pathlib
out, names = pathlib.Path(sys.argv[1]), sys.argv[2:]
scores = []
for name in names:
    try:
        log = json.loads((out / name / "train_log.json").read_text())
    except (OSError, ValueError):
        continue
    rows = [r for r in log.get("eval", []) if r["length"] == 1024 and r["topk"] != "dense"]
    if rows:
        scores.append((rows[0]["exact"], -rows[0]["answer_loss"], name))
    print(name, log.get("stage_steps"), [(r["length"], r["topk"], round(r["exact"], 3), round(r["answer_loss"], 3))
                                         for r in log.get("eval", [])])
best = max(scores)[2] if scores else (names[0] if names else "")
(out / "best.txt").write_text(best + "\n")
print("best:", best)
PY
best=$(cat "$out/best.txt")
tar czf "$out/logs.tgz" -C "$out" $(cd "$out" && ls -d */train_log.json 2>/dev/null)
if [ -n "$best" ]; then
  mv "$out/$best/resume.pt" "$out/best_resume.pt"
  tar czf "$out/best.tgz" -C "$out/$best" .
fi
for name in "${names[@]}"; do rm -rf "${out:?}/$name"; done
ls -la "$out"
