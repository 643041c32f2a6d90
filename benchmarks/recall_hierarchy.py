"""Recall of hierarchical top-k against the flat top-k (issue 31 item 4 (a) and (b)): one JSON file.

Three sources, each run through ``dsakit.recall.hierarchy`` (flat ``index_topk`` and ``hierarchical_topk`` side
by side on the same keys and queries, at 0.5x / 1x / 2x the default m and in the exact mode):

* the recall lab's synthetic haystacks (``dsakit recall``'s keys, stored through the store op with page
  summaries; the lab's needles and queries): ``--contexts`` at ``--depths`` x ``--topk``, then ``--long-contexts``
  at ``--long-depths`` x ``--long-topk`` (fewer queries where the reference is slow);
* random keys (standard normal keys, queries and head weights): ``--random-entries`` x ``--random-formats``;
* captured indexer tensors of a trained model (``--probe-model``): models/tools/probe.py runs the model on a
  passkey document of each ``--probe-lengths`` and captures both CSA layers' q / k / weights, which then run at
  ``--captured-topk`` with m = 0.5x / 1x / 2x default plus ``--captured-pages``.

    python benchmarks/recall_hierarchy.py --out benchmarks/results/hierarchy/recall_lab_<commit>.json \
        --captured-out benchmarks/results/hierarchy/captured_tiny_<commit>.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dsakit.recall import RecallSettings, load_captured, report  # noqa: E402
from dsakit.recall.hierarchy import (compare_hierarchy, compare_hierarchy_captured, compare_hierarchy_random,  # noqa: E402
                                     summarize_comparison)
from dsakit.recall.settings import DEFAULT_FORMATS, op_backends  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _progress(rec: dict) -> None:
    if rec["mode"] == "exact" or rec["pages"] == rec["default_pages"]:
        print(f"{rec['source']:9s} {rec['format']:12s} ctx={rec['context_tokens']:8d} k={rec['index_topk']:5d} "
              f"{rec['mode']:11s} m={rec['pages']:4d} iou={rec['iou_mean']:.3f} found={rec['needle_found_flat']}/"
              f"{rec['needle_found']} scored={rec['pages_scored']:.3f} equal={rec['equal_flat']}", flush=True)


def _meta(args, started: float) -> dict:
    return {"command": "python " + " ".join([sys.argv[0]] + sys.argv[1:]), "commit": report.git_commit(),
            "versions": report.versions(), "ops_backend": op_backends(args.backend),
            "seconds": round(time.time() - started, 1), "args": {k: str(v) for k, v in vars(args).items()}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default=",".join(DEFAULT_FORMATS))
    parser.add_argument("--contexts", default="4096,16384,65536,262144", help="tokens (ratio 4: entries = tokens / 4)")
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument("--topk", default="512,2048")
    parser.add_argument("--long-contexts", default="1048576")
    parser.add_argument("--long-depths", default="0.5")
    parser.add_argument("--long-topk", default="512")
    parser.add_argument("--page-factors", default="0.5,1,2", help="m as multiples of the default m")
    parser.add_argument("--random-entries", default="1024,4096,16384,65536")
    parser.add_argument("--random-formats", default="bf16,fp8")
    parser.add_argument("--random-topk", default="512")
    parser.add_argument("--probe-model", default="", help="a model folder (models/dsakit-v4-tiny); empty: skip")
    parser.add_argument("--probe-lengths", default="1024,2048,4096")
    parser.add_argument("--captured-topk", default="16,64")
    parser.add_argument("--captured-pages", default="2,4", help="extra m values of the captured runs")
    parser.add_argument("--backend", default="reference")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="JSON of the synthetic and random runs")
    parser.add_argument("--captured-out", type=Path, default=None, help="JSON of the captured runs")
    args = parser.parse_args(argv)
    formats = _names(args.formats)
    factors = _floats(args.page_factors)
    started = time.time()

    records = []
    for contexts, depths, topks in ((args.contexts, args.depths, args.topk),
                                    (args.long_contexts, args.long_depths, args.long_topk)):
        if not _ints(contexts):
            continue
        settings = RecallSettings(formats=tuple(formats), topks=tuple(_ints(topks)), contexts=tuple(_ints(contexts)),
                                  depths=tuple(_floats(depths)), horizon=False, faults=(), seed=args.seed,
                                  backend=args.backend)
        records += compare_hierarchy(settings, factors, on_record=_progress)
    if _ints(args.random_entries):
        records += compare_hierarchy_random(_names(args.random_formats), _ints(args.random_entries),
                                            _ints(args.random_topk), seed=args.seed, page_factors=factors,
                                            backend=args.backend, on_record=_progress)
    result = {"meta": _meta(args, started), "summary": summarize_comparison(records), "records": records}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report.json_safe(result), indent=1) + "\n")
    print(f"wrote {args.out} ({time.time() - started:.0f} s)")

    if args.probe_model and args.captured_out is not None:
        started = time.time()
        sys.path.insert(0, str(REPO / "models" / "tools"))
        import probe  # models/tools/probe.py: the model on a passkey document, both CSA layers captured

        captured_records, probes = [], None
        with tempfile.TemporaryDirectory() as tmp:
            probe.main(["--model", args.probe_model, "--out", tmp, "--lengths", args.probe_lengths,
                        "--seed", str(args.seed)])
            probes = json.loads((Path(tmp) / "probe.json").read_text())
            for run in probes["runs"]:
                captured = load_captured(Path(tmp) / run["captured"])
                captured_records += compare_hierarchy_captured(
                    captured, formats, _ints(args.captured_topk), page_factors=factors,
                    extra_pages=_ints(args.captured_pages), backend=args.backend,
                    source=f"captured:{run['captured']}", on_record=_progress)
        result = {"meta": dict(_meta(args, started), probe=probes),
                  "summary": summarize_comparison(captured_records), "records": captured_records}
        args.captured_out.parent.mkdir(parents=True, exist_ok=True)
        args.captured_out.write_text(json.dumps(report.json_safe(result), indent=1) + "\n")
        print(f"wrote {args.captured_out} ({time.time() - started:.0f} s)")
    return result


if __name__ == "__main__":
    main()
