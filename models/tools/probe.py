"""Probe the trained tiny DSA model's lightning indexers: capture their tensors for ``dsakit recall --captured``
and measure the statistic the recall lab's generator is built on.

For each context length, one passkey prompt (the niah generator's needle at depth ``--depth`` of the filler,
completion format, the code appended as the answer) runs through transformers' eager model (fp32, unpatched).
``probe.json`` records where the needle landed (``needle_position``: its first token / the prompt's tokens,
a little below the depth since the intro comes before the filler and the question after it). Per CSA layer:

* ``captured_L{length}_layer{i}.safetensors``: q / k / weights of the indexer (``capture_deepseek_v4_indexer``)
  for the queries that must retrieve the code (the last prompt token, "Answer:", and every answer token but the
  last), with ``needle_entries`` = the compressed entries whose tokens hold the code (own block, plus the next
  entry, which pools the same block through the overlapping window);
* the shared-to-noise ratio of the indexer's pooled keys before their RMSNorm (what the lab calls
  ``shared_ratio`` = |mu| / RMS_j |k_j - mu| with mu the mean key), over all 128 dims and over the 64 no-rope
  dims, next to the lab's default (``dsakit recall --shared-ratio``, 100).

Writes ``probe.json`` (ratios, capture files, needle entries) into ``--out``; then run ``dsakit recall
--captured`` on each capture file (one file per call; see models/dsakit-v4-tiny/README.md).

    python models/tools/probe.py --model models/dsakit-v4-tiny --out models/dsakit-v4-tiny/eval/probe
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

from dsakit.models.checkpoint import load_causal_lm_strict
from dsakit.models.data import make_document
from dsakit.models.tokenizer import load_tokenizer
from dsakit.recall.captured import CapturedTensors, capture_deepseek_v4_indexer, save_captured
from dsakit.recall.synthetic import SyntheticConfig

NOPE_DIMS = 64  # index keys: 64 no-rope dims, then the 64 rope dims (V4)


def shared_ratio(keys: torch.Tensor) -> float:
    """|mean key| / RMS distance of the keys from it (keys [N, D])."""
    mu = keys.mean(0)
    spread = (keys - mu).pow(2).sum(-1).mean().sqrt()
    return float(mu.norm() / spread)


def passkey_ids(tokenizer, length: int, depth: float, seed: int) -> tuple[list[int], int, tuple[int, int]]:
    """-> (ids = BOS + prompt + answer, first answer token index, token span of the code in the prompt)."""
    per_line = 21
    lines = max(1, (length - 90) // per_line)
    while True:
        rng = random.Random(f"probe:{seed}:{length}")  # the same draws for every line count tried
        doc = make_document(rng, lines, "passkey", chat=False, seed_text=f"probe:{seed}:{length}",
                            needle_depth=depth)
        prompt = tokenizer.encode(doc.prompt)
        answer = tokenizer.encode(doc.answer, add_special_tokens=False).ids
        if len(prompt.ids) + len(answer) <= length or lines == 1:
            break
        lines -= 1
    code = doc.answer.strip()
    start = doc.prompt.index(code)  # the needle line holds the only copy of the code in the prompt
    tokens = [i for i, (a, b) in enumerate(prompt.offsets) if b > start and a < start + len(code) and b > a]
    return prompt.ids + answer, len(prompt.ids), (min(tokens), max(tokens) + 1)


def _depth(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def _lengths(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 256:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts >= 256, got {text!r}")
    return values


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", type=_lengths, default=[2048, 4096], help="context lengths in tokens (>= 256)")
    ap.add_argument("--depth", type=_depth, default=0.5, help="needle depth in the filler, 0..1")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        model = load_causal_lm_strict(args.model)
        tokenizer = load_tokenizer(args.model)
    except ValueError as exc:
        ap.error(str(exc))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    layers = [i for i, layer in enumerate(model.model.layers)
              if layer.self_attn.layer_type == "compressed_sparse_attention"]
    report = {"model": args.model, "depth": args.depth, "seed": args.seed,
              "lab_default_shared_ratio": SyntheticConfig().shared_ratio, "runs": []}
    for length in args.lengths:
        ids, answer_start, (code_a, code_b) = passkey_ids(tokenizer, length, args.depth, args.seed)
        pre_norm: dict[int, torch.Tensor] = {}
        hooks = []
        for i in layers:
            indexer = model.model.layers[i].self_attn.compressor.indexer
            hooks.append(indexer.kv_norm.register_forward_hook(
                lambda mod, inp, outp, i=i: pre_norm.__setitem__(i, inp[0][0].detach().float())))
        captures = {}
        try:
            with torch.no_grad():
                contexts = [capture_deepseek_v4_indexer(model.model.layers[i].self_attn.compressor.indexer)
                            for i in layers]
                caps = [c.__enter__() for c in contexts]
                try:
                    model(input_ids=torch.tensor([ids]), use_cache=False)
                finally:
                    for c in contexts:
                        c.__exit__(None, None, None)
                captures = dict(zip(layers, caps))
        finally:
            for h in hooks:
                h.remove()
        queries = torch.arange(answer_start - 1, len(ids) - 1)  # positions whose next token is an answer token
        ratio = model.config.compress_rates["compressed_sparse_attention"]
        for i in layers:
            cap = captures[i].last
            n = cap.k.shape[0]
            needle = sorted({j for j in range(code_a // ratio, (code_b - 1) // ratio + 2) if j < n})
            picked = CapturedTensors(q=cap.q[queries], k=cap.k, weights=cap.weights[queries],
                                     needle_entries=torch.tensor(needle), query_positions=queries,
                                     ratio=cap.ratio, rotated=cap.rotated)
            path = save_captured(out / f"captured_L{length}_layer{i}.safetensors", picked)
            keys = pre_norm[i]
            row = {"length": len(ids), "layer": i, "entries": n, "needle_entries": needle,
                   "needle_position": round(code_a / answer_start, 3),
                   "code_tokens": [code_a, code_b], "queries": [int(queries[0]), int(queries[-1])],
                   "shared_ratio_all_dims": round(shared_ratio(keys), 3),
                   "shared_ratio_nope_dims": round(shared_ratio(keys[:, :NOPE_DIMS]), 3),
                   "shared_ratio_stored_keys_nope": round(shared_ratio(cap.k[:, :NOPE_DIMS]), 3),
                   "captured": path.name}
            report["runs"].append(row)
            print(json.dumps(row), flush=True)
    (out / "probe.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
