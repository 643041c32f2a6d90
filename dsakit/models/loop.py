"""The training loop of the tiny DSA model: build or load the model (:func:`build_or_load`), run the three
stages (:func:`train`: dense, indexer KL, sparse; see dsakit/models/train.py), save resumably
(:func:`save`), and evaluate at the end (:func:`evaluate`).

The run never ends with a checkpoint nobody can use: a non-finite loss stops it at that step
(:class:`NonFiniteTraining`, the last periodic save kept), weights are checked finite before every save, and the
checkpoint is written before the final evaluation (which then rewrites only the log).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import torch

from .config import (DEFAULT_WINDOW, DENSE_TOPK, KEY_NORMS, MODEL_MAX_LENGTH, indexer_modules, model_config,
                     set_topk, set_window, soften_attention_)
from .data import DocumentBatches, corpus_texts
from .losses import indexer_capture, indexer_kl, lm_losses
from .settings import TrainSettings, as_log, refuse
from .tokenizer import build_tokenizer, corpus_words, load_tokenizer, save_tokenizer

STAGES = ("dense", "indexer", "sparse")
STAGE_SETTINGS = {  # peak lr, warm-up fraction, final lr fraction
    "dense": (2e-3, 0.05, 0.1),
    "indexer": (2e-3, 0.05, 0.1),
    "sparse": (5e-4, 0.05, 0.0),
}


class NonFiniteTraining(RuntimeError):
    """The loss or the weights became NaN or Inf: the run stops (nothing more is saved over the last save)."""


def lr_at(progress: float, peak: float, warmup: float, floor: float) -> float:
    """Linear warm-up over the first ``warmup`` fraction, then cosine down to ``floor`` x peak."""
    if progress < warmup:
        return peak * max(progress / warmup, 0.02)
    p = min(1.0, (progress - warmup) / max(1e-9, 1 - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))


def build_or_load(s: TrainSettings, device: torch.device):
    """-> (model on ``device`` in train mode, tokenizer, resume state or None). Writes nothing: a built
    tokenizer is saved with the first checkpoint. ``--resume`` and ``--init-from`` checkpoints load strictly
    (:func:`dsakit.models.checkpoint.load_causal_lm_strict`: a missing, unexpected, mis-shaped or non-finite
    tensor is a ValueError naming it)."""
    from transformers import DeepseekV4ForCausalLM

    from .checkpoint import load_causal_lm_strict

    state = None
    if s.resume:
        model = load_causal_lm_strict(s.resume)
        tokenizer = load_tokenizer(s.tokenizer or s.resume)
        try:
            state = torch.load(Path(s.resume) / "resume.pt", map_location="cpu", weights_only=False)
        except Exception as exc:  # noqa: BLE001 - torch.load raises many types on a damaged file
            refuse(f"--resume {s.resume!r}: cannot read resume.pt: {type(exc).__name__}: {exc}")
    else:
        tokenizer = load_tokenizer(s.tokenizer) if s.tokenizer else build_tokenizer(corpus_words(corpus_texts()))
        torch.manual_seed(s.seed)
        if s.init_from:  # warm start: the weights of an earlier run, fresh stages and optimizer
            model = load_causal_lm_strict(s.init_from)
            model.config.index_topk = s.topk
            if s.window is not None:  # a narrower window pushes retrieval into the compressed entries
                set_window(model, s.window)
        else:
            config = model_config(tokenizer.get_vocab_size(), s.topk,
                                  sliding_window=DEFAULT_WINDOW if s.window is None else s.window)
            config._attn_implementation = "eager"
            model = DeepseekV4ForCausalLM(config)
            if s.key_norm_init != 1.0:
                soften_attention_(model, s.key_norm_init)
    if tokenizer.get_vocab_size() > model.config.vocab_size:
        refuse(f"the tokenizer has {tokenizer.get_vocab_size()} tokens, the model's vocabulary only "
               f"{model.config.vocab_size}")
    longest = max([*s.lengths, *s.eval_lengths])
    if longest > model.config.max_position_embeddings:
        refuse(f"length {longest} is beyond the model's max_position_embeddings {model.config.max_position_embeddings}")
    model.config._attn_implementation = "eager"
    return model.to(device).train(), tokenizer, state


def check_finite_weights(model) -> None:
    """NonFiniteTraining naming the first parameter with a NaN or Inf."""
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            raise NonFiniteTraining(f"parameter {name!r} is not finite (NaN or Inf); nothing saved over the last "
                                    "checkpoint: lower the learning rate or set --clip-norm")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_tokenizer(tokenizer, source: "str | None", out: Path) -> None:
    """Put the run's tokenizer into ``out`` (a checkpoint ``dsakit serve`` can load on its own): the files of
    the ``source`` directory it came from, else the built one."""
    if source is None:
        save_tokenizer(tokenizer, out, model_max_length=MODEL_MAX_LENGTH)
        return
    for name in TOKENIZER_FILES:
        src = Path(source) / name
        if src.is_file() and src.resolve() != (out / name).resolve():
            shutil.copyfile(src, out / name)


def save(model, opt, state: dict, log: dict, out: Path, tokenizer=None, tokenizer_source: "str | None" = None) -> None:
    """Write the checkpoint (weights and config), resume.pt (optimizer moments in bf16, the stage and step),
    train_log.json and loss_curves.png into ``out``; with ``tokenizer`` its files as well (the first save).
    Refuses (NonFiniteTraining) weights with a NaN or Inf before writing anything."""
    check_finite_weights(model)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:
        write_tokenizer(tokenizer, tokenizer_source, out)
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
    write_log(log, out)


def write_log(log: dict, out: Path) -> None:
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


def stage_loss(model, batch: dict, stage: str, s: TrainSettings, ratio: int) -> tuple[torch.Tensor, dict]:
    """-> (the loss the stage trains on, the logged values: lm, answer, exact, copy and kl tensors)."""
    with indexer_capture(model, detach_inputs=True) as records:
        logits = model(input_ids=batch["input_ids"], use_cache=False).logits
        if stage == "indexer":
            kl = indexer_kl(records, batch["valid"], ratio, None)
            with torch.no_grad():
                lm, ans, exact, copy = lm_losses(logits.detach(), batch)
            return kl, {"lm": lm, "answer": ans, "exact": exact, "copy": copy, "kl": kl}
        lm, ans, exact, copy = lm_losses(logits, batch)
        loss = s.lm_weight * lm + s.answer_weight * ans
        values = {"lm": lm, "answer": ans, "exact": exact, "copy": copy}
        if stage == "sparse":
            values["kl"] = indexer_kl(records, batch["valid"], ratio, s.topk)
            loss = loss + values["kl"]
        return loss, values


def log_row(step: int, stage: str, length: int, values: dict, lr: float, seconds: float) -> dict:
    copy = float(values["copy"])
    row = {"step": step, "stage": stage, "length": length, "lm": float(values["lm"].detach()),
           "answer": float(values["answer"].detach()), "exact": float(values["exact"]),
           "copy": None if math.isnan(copy) else round(copy, 4), "lr": lr, "seconds": round(seconds, 2)}
    if "kl" in values:
        row["kl"] = float(values["kl"].detach())
    return row


def new_log(s: TrainSettings, model, device) -> dict:
    import transformers

    return {"args": as_log(s), "parameters": sum(p.numel() for p in model.parameters()),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__, "steps": [],
            "stage_starts": [], "stage_steps": {}, "stage_seconds": {}, "eval": [], "finished": False}


def train(s: TrainSettings) -> dict:
    """Run (or continue) the training ``s`` describes (checked: :func:`dsakit.models.settings.check_settings`)
    and return its log. Saves into ``s.out`` every ``save_every_seconds``, at ``stop_at_step`` and at the end
    (before the final evaluation)."""
    import transformers

    device = torch.device(s.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    random.seed(s.seed)
    out = Path(s.out)
    model, tokenizer, resumed = build_or_load(s, device)
    tokenizer_source = s.tokenizer or s.resume
    print(f"dsakit-v4-tiny: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, vocab "
          f"{tokenizer.get_vocab_size()}, device {device}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}", flush=True)
    if resumed:
        log, state = resumed["state"]["log"], resumed["state"]
    else:
        log = new_log(s, model, device)
        state = {"stage": 0, "stage_step": 0, "stage_elapsed": 0.0, "global_step": 0}
    data = DocumentBatches(tokenizer, s.lengths, s.tokens_per_batch, s.seed, kind_weights=s.kinds,
                           repeat_rate=s.repeat_rate, short_steps=s.short_steps, short_length=s.short_length,
                           copy_steps=s.copy_steps, copy_gapped_share=s.copy_gapped_share,
                           copy_min_gap=s.copy_min_gap)
    ratio = model.config.compress_rates["compressed_sparse_attention"]
    last_save = time.time()
    opt = None
    pending_tokenizer = [tokenizer]  # written with the first save only

    def save_now():
        state["log"] = log
        save(model, opt, state, log, out, pending_tokenizer.pop() if pending_tokenizer else None, tokenizer_source)

    for stage_index in range(state["stage"], len(STAGES)):
        stage = STAGES[stage_index]
        peak, warmup, floor = STAGE_SETTINGS[stage]
        if stage == "dense" and s.dense_lr:
            peak = s.dense_lr
        opt = make_optimizer(model, stage, s.key_norm_lr_mult, peak)
        if resumed and stage_index == resumed["state"]["stage"]:
            restore_moments(opt, resumed["moments"])
        else:
            state.update(stage=stage_index, stage_step=0, stage_elapsed=0.0)
            log["stage_starts"].append({"stage": stage, "step": state["global_step"]})
        set_topk(model, s.topk if stage == "sparse" else DENSE_TOPK)
        budget = None if s.steps else s.budget_seconds * s.fractions[stage_index]
        total_steps = s.steps[stage_index] if s.steps else None
        loader = torch.utils.data.DataLoader(
            data, batch_size=None, sampler=range(state["global_step"], 1 << 40), num_workers=s.workers,
            prefetch_factor=4 if s.workers else None, persistent_workers=False, pin_memory=device.type == "cuda")
        print(f"stage {stage}: {'%d steps' % total_steps if total_steps else '%.0f s' % budget}, top-k "
              f"{s.topk if stage == 'sparse' else 'dense'}", flush=True)
        started = time.time() - state["stage_elapsed"]
        for batch in loader:
            elapsed = time.time() - started
            progress = state["stage_step"] / total_steps if total_steps else elapsed / budget
            if progress >= 1.0:
                break
            for group in opt.param_groups:
                group["lr"] = lr_at(progress, peak, warmup, floor) * group["lr_mult"]
            batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
            loss, values = stage_loss(model, batch, stage, s, ratio)
            if not bool(torch.isfinite(loss.detach())):
                raise NonFiniteTraining(f"the {stage} loss is {float(loss)} at step {state['global_step'] + 1}; "
                                        f"stopped, the last checkpoint in {out} (if any) is kept")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if s.clip_norm > 0:
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], s.clip_norm)
            opt.step()
            state["stage_step"] += 1
            state["global_step"] += 1
            if state["global_step"] % s.log_every == 0 or state["stage_step"] == 1:
                row = log_row(state["global_step"], stage, int(batch["input_ids"].shape[1]), values,
                              opt.param_groups[0]["lr"], time.time() - started)
                log["steps"].append(row)
                print(json.dumps(row), flush=True)
            state["stage_elapsed"] = time.time() - started
            log["stage_steps"][stage] = state["stage_step"]
            log["stage_seconds"][stage] = round(state["stage_elapsed"], 1)
            if s.stop_at_step and state["global_step"] >= s.stop_at_step:
                break
            if time.time() - last_save > s.save_every_seconds:
                save_now()
                last_save = time.time()
        state["stage_elapsed"] = time.time() - started
        resumed = None
        if s.stop_at_step and state["global_step"] >= s.stop_at_step:
            log["finished"] = True
            save_now()
            print(f"stopped at step {state['global_step']} (--stop-at-step), saved to {out}", flush=True)
            return log
    state.update(stage=len(STAGES), stage_step=0)
    set_topk(model, s.topk)
    model.config.index_topk = s.topk
    log["finished"] = True
    save_now()  # the checkpoint first: an evaluation that fails cannot lose the run
    print(f"saved to {out}: stage steps {log['stage_steps']}", flush=True)
    if s.eval_docs:
        log["eval"] = evaluate(model, tokenizer, s.eval_lengths, s.topk, s.seed + 1, s.eval_docs, device)
        set_topk(model, s.topk)
        write_log(log, out)
    return log
