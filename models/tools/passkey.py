"""Passkey retrieval of a trained tiny DSA model through dsakit's blocks (greedy, CPU or GPU).

Builds seeded passkey documents (``dsakit.models.data``, completion form: haystack, the niah question,
``Answer:``) of about ``--length`` tokens, runs each through :class:`dsakit.serve.ModelRunner` (the checkpoint
patched onto dsakit's attention blocks, index keys in ``--format`` at ``--topk``) and counts the cases whose
greedy continuation contains the passkey. The CPU test in tests/test_trained_model.py runs the same check.

    python models/tools/passkey.py --model models/dsakit-v4-tiny --length 1024 --cases 10
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def passkey_prompts(tokenizer_dir: str, length: int, cases: int, seed: int) -> list[tuple[list[int], str]]:
    """[(prompt token ids, passkey)] of ``cases`` seeded single-needle documents of about ``length`` tokens."""
    from dsakit.models.data import DocumentBatches
    from dsakit.models.tokenizer import load_tokenizer

    data = DocumentBatches(load_tokenizer(tokenizer_dir), [length], length, seed,
                           kind_weights={"passkey": 1.0}, prefix="passkey-eval")
    out = []
    row = 0
    while len(out) < cases:
        ids, start, _, doc = data.document(0, row, length)
        row += 1
        if doc.prompt.endswith("Answer:"):  # the completion form (half the documents are chat prompts)
            out.append((ids[:start], doc.answer.strip()))
    return out


def found_passkeys(model_dir: str, length: int, cases: int, seed: int, index_key_format: str = "bf16",
                   topk: int | None = None, device: str = "cpu") -> list[dict]:
    from dsakit.serve.model import ModelRunner, load_model_dir

    model, tokenizer = load_model_dir(model_dir, device=device)
    runner = ModelRunner(model, tokenizer, index_key_format=index_key_format, topk=topk, max_new_tokens=16)
    rows = []
    for prompt, passkey in passkey_prompts(model_dir, length, cases, seed):
        text, _, _ = runner.generate(prompt, 12)
        rows.append({"tokens": len(prompt), "passkey": passkey, "output": text, "found": passkey in text})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--cases", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--format", default="bf16")
    ap.add_argument("--topk", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    started = time.time()
    rows = found_passkeys(args.model, args.length, args.cases, args.seed, args.format, args.topk, args.device)
    for row in rows:
        print(json.dumps(row))
    print(f"found {sum(r['found'] for r in rows)} / {len(rows)} at ~{args.length} tokens, {args.format} keys, "
          f"{time.time() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
