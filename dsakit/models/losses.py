"""The training losses: the language-model losses of the dense and sparse stages (:func:`lm_losses`) and the
indexer's KL to the main attention (:func:`indexer_kl`, on what :func:`indexer_capture` records)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from .config import csa_attentions


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
    over the copyable tokens of repeated lines (nan without any)).

    ``logits`` [B, L, vocab]; ``batch``: :class:`dsakit.models.data.DocumentBatches`'s layout."""
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
