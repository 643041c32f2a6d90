"""Train the tiny DSA model: transformers' ``DeepseekV4ForCausalLM`` on :mod:`dsakit.models.data` documents
with the DSA recipe (DeepSeek-V3.2's), in three stages:

1. ``dense``: every parameter on the language-model loss, with the top-k above the number of compressed
   entries (the CSA layers attend to every entry: a dense model to start from; the indexer gets no gradient);
2. ``indexer``: everything frozen except the lightning indexers, trained with the KL divergence from the main
   attention's distribution over the compressed entries (summed over heads, renormalised) to the indexer's
   softmax over its scores;
3. ``sparse``: top-k = the model's ``index_topk``; the main model on the LM loss, the indexers on the KL
   restricted to the selected entries, with their inputs detached (the KL trains the indexer only).

Loss of stages 1 and 3: ``lm_weight`` x mean token cross-entropy over the document + ``answer_weight`` x mean
cross-entropy over the answer tokens (a code is ~8 of ~1000 tokens; the answer term keeps retrieval from
drowning in filler). Documents repeat some filler lines (``--repeat-rate``, see :mod:`dsakit.models.data`) so
that copying pays off everywhere, and the first ``--short-steps`` steps use short documents only.

Usage (see models/dsakit-v4-tiny/README.md for the command that made the shipped checkpoint)::

    python -m dsakit.models.train --out DIR [--budget-seconds 420 | --steps 1500,200,600] [--device cuda]

Writes into DIR: config.json, generation_config.json, model.safetensors, tokenizer files, train_log.json
(every logged step, the stage boundaries, the final evaluation), loss_curves.png and resume.pt (optimizer
moments in bf16, the stage and step; ``--resume DIR`` continues from it). Seeded: data is a pure function of
(seed, step), the initial weights of the seed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from .data import DocumentBatches, corpus_texts
from .tokenizer import build_tokenizer, corpus_words, load_tokenizer, save_tokenizer

STAGES = ("dense", "indexer", "sparse")
LAYER_TYPES = ["heavily_compressed_attention", "sliding_attention", "compressed_sparse_attention",
               "compressed_sparse_attention"]
V4_YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
           "beta_fast": 32, "beta_slow": 1}
DENSE_TOPK = 1 << 20  # above any number of compressed entries: the CSA layers are dense
MODEL_MAX_LENGTH = 16384  # what the tokenizer config advertises


def model_config(vocab_size: int, topk: int, *, hidden_size: int = 128, max_positions: int = 65536,
                 sliding_window: int = 128):
    """The tiny DeepseekV4Config: 4 layers (hca, window, csa, csa), hidden 128, 2 heads of 512, q_lora 64,
    indexer 4 heads x 128, 2 routed experts (top-1) + a shared one of width 128, 2 hyper-connection streams."""
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=len(LAYER_TYPES),
        layer_types=list(LAYER_TYPES), mlp_layer_types=["moe"] * len(LAYER_TYPES), num_attention_heads=2,
        head_dim=512, q_lora_rank=64, o_groups=2, o_lora_rank=64, index_n_heads=4, index_head_dim=128,
        index_topk=topk, n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1, moe_intermediate_size=128,
        hc_mult=2, hc_sinkhorn_iters=8, sliding_window=sliding_window, max_position_embeddings=max_positions,
        rope_parameters=dict(V4_YARN), bos_token_id=2, eos_token_id=3, pad_token_id=0, tie_word_embeddings=False,
        num_nextn_predict_layers=0)


KEY_NORMS = ("self_attn.kv_norm.weight", "self_attn.compressor.kv_norm.weight")


def soften_attention_(model, gain: float) -> None:
    """Start the attention's key norms (raw KV and compressed entries; K = V in V4) at ``gain`` and scale the
    output projection ``o_a_proj`` by 1 / gain, so values reach the residual at the usual size.

    Why: V4 normalises every query head to a fixed norm (an RMSNorm without weight), so a logit is
    sqrt(512) x cos(q, k) x the key norm's weight, and with transformers' init (weight 1) the attention starts
    sharp and random. The tiny model then never learnt to copy: on a toy task (a random 24-token sequence
    repeated, loss on the repeat, batch 16) it did not move in 900 steps, where a Llama of the same size
    copies after ~200 steps. With the key norms at 0.15 (soft attention at init, like an unnormalised query
    of small norm) and trained 10x faster than the rest (``KEY_NORM_LR_MULT``: the temperature can rise as
    soon as matching pays), it copies after ~220 steps. Only the initial values and learning rates change:
    the architecture is transformers' DeepseekV4."""
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.kv_norm.weight.fill_(gain)
            if attn.compressor is not None:
                attn.compressor.kv_norm.weight.fill_(gain)
            attn.o_a_proj.weight.mul_(1.0 / gain)


def set_window(model, window: int) -> None:
    """Give every attention layer (and the config, which builds the mask and is saved) a sliding window of
    ``window`` tokens; the weights do not depend on it."""
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    model.config.sliding_window = window
    for layer in model.model.layers:
        layer.self_attn.sliding_window = window


def indexer_modules(model) -> list:
    return [layer.self_attn.compressor.indexer for layer in model.model.layers
            if getattr(layer.self_attn, "compressor", None) is not None
            and hasattr(layer.self_attn.compressor, "indexer")]


def csa_attentions(model) -> list:
    return [layer.self_attn for layer in model.model.layers
            if layer.self_attn.layer_type == "compressed_sparse_attention"]


def set_topk(model, topk: int) -> None:
    for indexer in indexer_modules(model):
        indexer.index_topk = topk


@contextmanager
def indexer_capture(model, detach_inputs: bool):
    """Record, per CSA layer, the indexer's scores [B, S, N] and the main attention's probabilities
    [B, H, S, S + N] (raw tokens first, then the N compressed entries). ``detach_inputs`` cuts the indexer's
    inputs from the graph, so a loss on its scores trains the indexer alone."""
    records = [dict() for _ in csa_attentions(model)]
    handles = []
    for rec, attn in zip(records, csa_attentions(model)):
        indexer = attn.compressor.indexer

        def pre(module, args, rec=rec):
            if detach_inputs:
                return (args[0].detach(), args[1].detach(), *args[2:])
            return None

        def scores(module, args, output, rec=rec):
            rec["scores"] = output

        def probs(module, args, output, rec=rec):
            rec["probs"] = output[1]

        handles += [indexer.register_forward_pre_hook(pre), indexer.scorer.register_forward_hook(scores),
                    attn.register_forward_hook(probs)]
    try:
        yield records
    finally:
        for h in handles:
            h.remove()


def indexer_kl(records: list, valid: torch.Tensor, ratio: int, topk: int | None) -> torch.Tensor:
    """Mean over CSA layers and over queries with a visible entry of KL(p_main || softmax(scores)).

    p_main[t, j]: the main attention's probability of compressed entry j at query t, summed over heads and
    renormalised over the entries (the target is detached). ``topk``: restrict both distributions to the
    indexer's top-k entries (stage 3), else every visible entry (stage 2)."""
    total = 0.0
    for rec in records:
        scores = rec["scores"].float()                       # [B, S, N]
        probs = rec["probs"].detach().float()                # [B, H, S, S + N]
        b, s, n = scores.shape
        target = probs[..., probs.shape[-1] - n:].sum(1)     # [B, S, N]
        positions = torch.arange(s, device=scores.device)
        visible = torch.arange(n, device=scores.device)[None, :] < ((positions + 1) // ratio)[:, None]
        mask = visible.unsqueeze(0).expand(b, s, n)
        if topk is not None and topk < n:
            chosen = scores.detach().masked_fill(~mask, float("-inf")).topk(topk, dim=-1).indices
            keep = torch.zeros_like(mask).scatter_(-1, chosen, True)
            mask = mask & keep
        rows = mask.any(-1) & valid                           # queries with at least one visible entry
        target = target.masked_fill(~mask, 0.0)
        target = target / target.sum(-1, keepdim=True).clamp_min(1e-12)
        log_q = scores.masked_fill(~mask, float("-inf")).log_softmax(-1)
        kl = (target * (target.clamp_min(1e-12).log() - log_q.masked_fill(~mask, 0.0))).sum(-1)
        total = total + (kl * rows).sum() / rows.sum().clamp_min(1)
    return total / max(1, len(records))


def lm_losses(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (mean CE over valid next tokens, mean CE over answer tokens, exact-match fraction of the answers
    under teacher forcing (every answer token the argmax; rows whose answer was cut off not counted), mean CE
    over the copyable tokens of repeated lines (nan without any))."""
    ids, answer, valid = batch["input_ids"], batch["answer_mask"], batch["valid"]
    pred = logits[:, :-1].float()
    target = ids[:, 1:]
    ce = F.cross_entropy(pred.reshape(-1, pred.shape[-1]), target.reshape(-1), reduction="none").view(target.shape)
    tok_mask = valid[:, 1:]
    ans_mask = answer[:, 1:]
    lm = (ce * tok_mask).sum() / tok_mask.sum().clamp_min(1)
    ans = (ce * ans_mask).sum() / ans_mask.sum().clamp_min(1)
    has_answer = ans_mask.any(-1)
    correct = ((pred.argmax(-1) == target) | ~ans_mask).all(-1)
    exact = (correct & has_answer).float().sum() / has_answer.float().sum().clamp_min(1)
    copy = batch.get("copy_mask")
    copy_ce = torch.tensor(float("nan"))
    if copy is not None and bool(copy[:, 1:].any()):
        copy_mask = copy[:, 1:]
        copy_ce = (ce.detach() * copy_mask).sum() / copy_mask.sum()
    return lm, ans, exact, copy_ce


def lr_at(progress: float, peak: float, warmup: float, floor: float) -> float:
    """Linear warm-up over the first ``warmup`` fraction, then cosine down to ``floor`` x peak."""
    if progress < warmup:
        return peak * max(progress / warmup, 0.02)
    p = min(1.0, (progress - warmup) / max(1e-9, 1 - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))


STAGE_SETTINGS = {  # peak lr, warm-up fraction, final lr fraction
    "dense": (2e-3, 0.05, 0.1),
    "indexer": (2e-3, 0.05, 0.1),
    "sparse": (5e-4, 0.05, 0.0),
}


def build_or_load(args, device):
    from transformers import DeepseekV4ForCausalLM

    out = Path(args.out)
    if args.resume:
        model = DeepseekV4ForCausalLM.from_pretrained(args.resume, dtype=torch.float32)
        tokenizer = load_tokenizer(args.tokenizer or args.resume)
        state = torch.load(Path(args.resume) / "resume.pt", map_location="cpu", weights_only=False)
    else:
        if args.tokenizer:  # a committed tokenizer (not copied into --out: the checkpoint's directory has it)
            tokenizer = load_tokenizer(args.tokenizer)
        else:
            save_tokenizer(build_tokenizer(corpus_words(corpus_texts())), out, model_max_length=MODEL_MAX_LENGTH)
            tokenizer = load_tokenizer(out)
        torch.manual_seed(args.seed)
        if args.init_from:  # warm start: the weights of an earlier run, fresh stages and optimizer
            model = DeepseekV4ForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
            model.config.index_topk = args.topk
            if args.window is not None:  # a narrower window pushes retrieval into the compressed entries
                set_window(model, args.window)
        else:
            config = model_config(tokenizer.get_vocab_size(), args.topk, sliding_window=args.window or 128)
            config._attn_implementation = "eager"
            model = DeepseekV4ForCausalLM(config)
            if args.key_norm_init != 1.0:
                soften_attention_(model, args.key_norm_init)
        state = None
    model.config._attn_implementation = "eager"
    return model.to(device), tokenizer, state


def save(model, opt, state: dict, log: dict, out: Path) -> None:
    model.save_pretrained(out, safe_serialization=True)
    moments = {}
    for i, group in enumerate(opt.param_groups if opt is not None else []):
        for j, p in enumerate(group["params"]):
            st = opt.state.get(p)
            if st:
                moments[f"{i}.{j}"] = {k: (v.to(torch.bfloat16).cpu() if torch.is_tensor(v) and v.dim() else v)
                                       for k, v in st.items()}
    tmp = out / "resume.pt.tmp"
    torch.save({"state": state, "moments": moments}, tmp)
    os.replace(tmp, out / "resume.pt")
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    plot_losses(log, out / "loss_curves.png")


def plot_losses(log: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = log["steps"]
    if not rows:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    x = [r["step"] for r in rows]
    axes[0].plot(x, [r.get("lm", float("nan")) for r in rows], label="LM loss (all tokens)")
    axes[0].plot(x, [r.get("answer", float("nan")) for r in rows], label="answer loss")
    axes[0].plot(x, [r.get("copy", float("nan")) for r in rows], label="repeated-line loss")
    axes[0].set_yscale("log")
    axes[1].plot(x, [r.get("exact", float("nan")) for r in rows], label="answer exact (teacher forced)")
    axes[1].set_ylim(-0.02, 1.02)
    axes[2].plot(x, [r.get("kl", float("nan")) for r in rows], label="indexer KL")
    for ax in axes:
        for b in log["stage_starts"]:
            ax.axvline(b["step"], color="grey", ls=":", lw=1)
            ax.text(b["step"], ax.get_ylim()[1], b["stage"], fontsize=7, va="top")
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    fig.suptitle(f"dsakit-v4-tiny training ({log.get('device', '?')})")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def restore_moments(opt, moments: dict) -> None:
    for i, group in enumerate(opt.param_groups):
        for j, p in enumerate(group["params"]):
            st = moments.get(f"{i}.{j}")
            if st:
                opt.state[p] = {k: (v.to(p.device, torch.float32) if torch.is_tensor(v) and v.dim() else v)
                                for k, v in st.items()}


def make_optimizer(model, stage: str, key_norm_lr_mult: float = 1.0, peak_lr: float | None = None):
    """AdamW over the parameters the stage trains; the attention key norms (:data:`KEY_NORMS`) in their own
    group at ``key_norm_lr_mult`` x the learning rate, without weight decay."""
    indexer_params = {id(p) for idx in indexer_modules(model) for p in idx.parameters()}
    for p in model.parameters():
        p.requires_grad_(stage != "indexer" or id(p) in indexer_params)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    key_norms = [p for n, p in named if n.endswith(KEY_NORMS)]
    rest = [p for n, p in named if not n.endswith(KEY_NORMS)]
    groups = [{"params": rest, "lr_mult": 1.0}]
    if key_norms:
        groups.append({"params": key_norms, "lr_mult": key_norm_lr_mult, "weight_decay": 0.0})
    return torch.optim.AdamW(groups, lr=peak_lr or STAGE_SETTINGS[stage][0], betas=(0.9, 0.95), weight_decay=0.01)


@torch.no_grad()
def evaluate(model, tokenizer, lengths: list[int], topk: int, seed: int, docs: int, device) -> list[dict]:
    """Teacher-forced exact match of single-needle (passkey) documents, per length, dense and at top-k."""
    data = DocumentBatches(tokenizer, lengths, max(lengths), seed, {"passkey": 1.0}, prefix="eval")
    model.eval()
    rows = []
    for length in lengths:
        for k in (DENSE_TOPK, topk):
            set_topk(model, k)
            exact, answer = [], []
            for step in range(docs):
                batch = data.batch(step, length)
                batch = {key: v.to(device) if torch.is_tensor(v) else v for key, v in batch.items()}
                logits = model(input_ids=batch["input_ids"], use_cache=False).logits
                _, ans, ex, _ = lm_losses(logits, batch)
                exact.append(float(ex))
                answer.append(float(ans))
            rows.append({"length": length, "topk": "dense" if k == DENSE_TOPK else k,
                         "exact": sum(exact) / len(exact), "answer_loss": sum(answer) / len(answer), "docs": docs})
            print(f"eval length {length} topk {rows[-1]['topk']}: exact {rows[-1]['exact']:.3f} "
                  f"answer loss {rows[-1]['answer_loss']:.3f}", flush=True)
    model.train()
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m dsakit.models.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory (checkpoint, log, curves)")
    ap.add_argument("--resume", default=None, help="directory of a checkpoint with resume.pt to continue")
    ap.add_argument("--init-from", default=None, help="checkpoint directory whose weights start the run")
    ap.add_argument("--tokenizer", default=None, help="directory with a tokenizer.json to reuse (default: build)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--topk", type=int, default=32, help="index_topk of the model (stage 3)")
    ap.add_argument("--lengths", default="256,512,1024,1536,2048", help="document lengths in tokens (one per step)")
    ap.add_argument("--tokens-per-batch", type=int, default=32768)
    ap.add_argument("--steps", default=None, help="steps per stage: dense,indexer,sparse (overrides budget)")
    ap.add_argument("--budget-seconds", type=float, default=420.0, help="total training time when no --steps")
    ap.add_argument("--fractions", default="0.62,0.1,0.28", help="time share of the stages with a budget")
    ap.add_argument("--lm-weight", type=float, default=0.5)
    ap.add_argument("--answer-weight", type=float, default=2.0)
    ap.add_argument("--key-norm-init", type=float, default=0.15,
                    help="initial weight of the attention key norms (see soften_attention_; 1 = transformers')")
    ap.add_argument("--key-norm-lr-mult", type=float, default=10.0, help="learning-rate factor of the key norms")
    ap.add_argument("--repeat-rate", type=float, default=0.3, help="share of filler lines copied from earlier")
    ap.add_argument("--kinds", default=None, help="document kind weights, e.g. passkey=1,codes=1 (default: data.py's)")
    ap.add_argument("--short-steps", type=int, default=0, help="first steps on lengths <= --short-length only")
    ap.add_argument("--short-length", type=int, default=512)
    ap.add_argument("--window", type=int, default=None,
                    help="sliding window of the model (new models: default 128; --init-from: the checkpoint's)")
    ap.add_argument("--copy-gapped-share", type=float, default=0.5,
                    help="share of the copy-toy rows with gapped repeats in the warm-up's second half")
    ap.add_argument("--copy-min-gap", type=int, default=32, help="shortest gap before a gapped repeat (tokens)")
    ap.add_argument("--stop-at-step", type=int, default=0,
                    help="save and stop after this global step (the schedule still spans --steps)")
    ap.add_argument("--dense-lr", type=float, default=None, help="peak learning rate of the dense stage")
    ap.add_argument("--clip-norm", type=float, default=1.0, help="gradient-norm clip (0: none)")
    ap.add_argument("--copy-steps", type=int, default=0,
                    help="first steps on the copy toy (a random sequence repeated; data.DocumentBatches.copy_row)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--save-every-seconds", type=float, default=90.0)
    ap.add_argument("--eval-lengths", default="1024,2048,4096")
    ap.add_argument("--eval-docs", type=int, default=8, help="eval batches per length (0: no final eval)")
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    args = ap.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.eval_lengths = [int(x) for x in args.eval_lengths.split(",") if x]
    args.steps = [int(x) for x in args.steps.split(",")] if args.steps else None
    args.fractions = [float(x) for x in args.fractions.split(",")]
    if args.kinds:
        args.kinds = {k: float(v) for k, v in (item.split("=") for item in args.kinds.split(","))}
    if args.steps is not None and len(args.steps) != 3 or len(args.fractions) != 3:
        ap.error("--steps and --fractions take three values (dense, indexer, sparse)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    random.seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer, resumed = build_or_load(args, device)
    n_params = sum(p.numel() for p in model.parameters())
    import transformers

    print(f"dsakit-v4-tiny: {n_params / 1e6:.2f}M parameters, vocab {tokenizer.get_vocab_size()}, device {device}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
    if resumed:
        log, state = resumed["state"]["log"], resumed["state"]
    else:
        log = {"args": {k: v for k, v in vars(args).items()}, "parameters": n_params,
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "transformers": transformers.__version__, "steps": [],
               "stage_starts": [], "stage_steps": {}, "stage_seconds": {}, "eval": []}
        state = {"stage": 0, "stage_step": 0, "stage_elapsed": 0.0, "global_step": 0}
    data = DocumentBatches(tokenizer, args.lengths, args.tokens_per_batch, args.seed, kind_weights=args.kinds,
                           repeat_rate=args.repeat_rate,
                           short_steps=args.short_steps, short_length=args.short_length,
                           copy_steps=args.copy_steps, copy_gapped_share=args.copy_gapped_share,
                           copy_min_gap=args.copy_min_gap)
    ratio = model.config.compress_rates["compressed_sparse_attention"]
    model.train()
    last_save = time.time()
    opt = None
    for stage_index in range(state["stage"], len(STAGES)):
        stage = STAGES[stage_index]
        peak, warmup, floor = STAGE_SETTINGS[stage]
        if stage == "dense" and args.dense_lr:
            peak = args.dense_lr
        opt = make_optimizer(model, stage, args.key_norm_lr_mult, peak)
        if resumed and stage_index == resumed["state"]["stage"]:
            restore_moments(opt, resumed["moments"])
        else:
            state.update(stage=stage_index, stage_step=0, stage_elapsed=0.0)
            log["stage_starts"].append({"stage": stage, "step": state["global_step"]})
        set_topk(model, args.topk if stage == "sparse" else DENSE_TOPK)
        budget = None if args.steps else args.budget_seconds * args.fractions[stage_index]
        total_steps = args.steps[stage_index] if args.steps else None
        loader = torch.utils.data.DataLoader(
            data, batch_size=None, sampler=range(state["global_step"], 1 << 40), num_workers=args.workers,
            prefetch_factor=4 if args.workers else None, persistent_workers=False, pin_memory=device.type == "cuda")
        print(f"stage {stage}: {'%d steps' % total_steps if total_steps else '%.0f s' % budget}, top-k "
              f"{args.topk if stage == 'sparse' else 'dense'}", flush=True)
        started = time.time() - state["stage_elapsed"]
        for batch in loader:
            elapsed = time.time() - started
            progress = state["stage_step"] / total_steps if total_steps else elapsed / budget
            if progress >= 1.0:
                break
            for group in opt.param_groups:
                group["lr"] = lr_at(progress, peak, warmup, floor) * group["lr_mult"]
            batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
            with indexer_capture(model, detach_inputs=True) as records:
                if stage == "indexer":
                    logits = model(input_ids=batch["input_ids"], use_cache=False).logits
                    kl = indexer_kl(records, batch["valid"], ratio, None)
                    loss = kl
                    with torch.no_grad():
                        lm, ans, exact, copy = lm_losses(logits.detach(), batch)
                else:
                    logits = model(input_ids=batch["input_ids"], use_cache=False).logits
                    lm, ans, exact, copy = lm_losses(logits, batch)
                    loss = args.lm_weight * lm + args.answer_weight * ans
                    kl = None
                    if stage == "sparse":
                        kl = indexer_kl(records, batch["valid"], ratio, args.topk)
                        loss = loss + kl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if args.clip_norm > 0:
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], args.clip_norm)
            opt.step()
            state["stage_step"] += 1
            state["global_step"] += 1
            if state["global_step"] % args.log_every == 0 or state["stage_step"] == 1:
                row = {"step": state["global_step"], "stage": stage, "length": int(batch["input_ids"].shape[1]),
                       "lm": float(lm.detach()), "answer": float(ans.detach()), "exact": float(exact),
                       "copy": None if math.isnan(float(copy)) else round(float(copy), 4),
                       "lr": opt.param_groups[0]["lr"], "seconds": round(time.time() - started, 2)}
                if kl is not None:
                    row["kl"] = float(kl)
                log["steps"].append(row)
                print(json.dumps(row), flush=True)
            state["stage_elapsed"] = time.time() - started
            log["stage_steps"][stage] = state["stage_step"]
            log["stage_seconds"][stage] = round(state["stage_elapsed"], 1)
            if args.stop_at_step and state["global_step"] >= args.stop_at_step:
                break
            if time.time() - last_save > args.save_every_seconds:
                state["log"] = log
                save(model, opt, state, log, out)
                last_save = time.time()
        state["stage_elapsed"] = time.time() - started
        resumed = None
        if args.stop_at_step and state["global_step"] >= args.stop_at_step:
            state["log"] = log
            save(model, opt, state, log, out)
            print(f"stopped at step {state['global_step']} (--stop-at-step), saved to {out}", flush=True)
            return 0
    state.update(stage=len(STAGES), stage_step=0)
    set_topk(model, args.topk)
    model.config.index_topk = args.topk
    if args.eval_docs:
        log["eval"] = evaluate(model, tokenizer, args.eval_lengths, args.topk, args.seed + 1, args.eval_docs, device)
        set_topk(model, args.topk)
    state["log"] = log
    save(model, opt, state, log, out)
    print(f"saved to {out}: stage steps {log['stage_steps']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
