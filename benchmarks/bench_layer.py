"""One DeepSeek-V4 attention layer (dsakit.layers.V4Attention) on the GPU: prefill stages and the decode step.

    PYTHONPATH=. python3 benchmarks/bench_layer.py --out DIR --commit $(git rev-parse --short HEAD)
    PYTHONPATH=. python3 benchmarks/bench_layer.py --out DIR --device cpu --small   # CPU smoke run

Sections (JSON written after each, so a timeout keeps what finished):

* ``prefill``: a CSA layer of V4-Flash geometry (hidden 4096, 64 heads x 512, q_lora 1024, 64 index heads,
  top-512, bf16 weights) prefilling T = 8K, 32K, 128K tokens of one sequence. The prefill runs stage by
  stage with the layer's own calls and query chunks; each stage is timed in place with CUDA events (median
  of ``--reps`` runs after a warm-up) and its peak extra memory recorded (max over its chunks): compress
  (both compressors' projections and pooling), store (KV projection; raw KV, compressed entries and index
  keys into the paged pools), project (attention and index queries), top-k, attention, output projection.
  The whole layer call is timed with do_bench. ``peak / (T x N x 4 B)`` shows that no stage holds a [T, N]
  fp32 tensor (N = T / 4 entries).
* ``decode``: the same layer after a prefill of ``--decode-context`` tokens; one decode step (one token
  through the layer, cache append included) against the sum of its stages run alone. The step's Python
  bookkeeping (page allocation, block tables) is what the ratio measures beyond the kernels.
* ``patched_model`` (needs transformers with DeepSeek-V4; recorded as skipped otherwise): a two-layer
  DeepseekV4ForCausalLM (csa + hca, this geometry, small MoE) patched with ``patch_deepseek_v4``; one
  ``model(token, cache=...)`` decode step after the same context against its stages alone: each attention
  block's stages plus the rest of the model timed with the attention blocks stubbed out.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, timed, write_json  # noqa: E402

from dsakit.layers import V4Attention  # noqa: E402

FLASH = dict(hidden=4096, q_lora=1024, heads=64, o_groups=8, o_lora=1024, index_heads=64, topk=512)
SMALL = dict(hidden=64, q_lora=32, heads=2, o_groups=2, o_lora=16, index_heads=4, topk=16)


def build_layer(geo: dict, device: str, key_format: str) -> V4Attention:
    with torch.device(device):
        layer = V4Attention("csa", geo["hidden"], geo["q_lora"], num_heads=geo["heads"], o_groups=geo["o_groups"],
                            o_lora_rank=geo["o_lora"], index_heads=geo["index_heads"], index_topk=geo["topk"],
                            index_key_format=key_format, kv_format="bf16")
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("position_bias"):
                p.normal_(0, 0.5, generator=gen)
            elif name.endswith("norm.weight"):
                p.normal_(1, 0.1, generator=gen)
            elif name == "sinks":
                p.normal_(0, 1, generator=gen)
            else:
                p.normal_(0, p.shape[-1] ** -0.5, generator=gen)
    if device == "cuda":  # linear weights in bf16 as a served checkpoint; norms, biases and sinks stay fp32
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear):
                module.to(torch.bfloat16)
    return layer.eval()


def chunks(t: int, size: int):
    return [(lo, min(t, lo + size)) for lo in range(0, t, size)]


class StageClock:
    """Per-stage time (CUDA events; wall clock on the CPU) and peak extra memory of a pipeline run in place:
    each stage is timed where it runs, holding only its own chunk's tensors."""

    def __init__(self, device: str):
        self.device = device
        self.spans: dict[str, list] = {}
        self.peaks: dict[str, int] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        cuda = self.device == "cuda"
        if cuda:
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        yield
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.spans.setdefault(name, []).append((start, end))
            self.peaks[name] = max(self.peaks.get(name, 0), torch.cuda.max_memory_allocated() - base)
        else:
            self.spans.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)
            self.peaks.setdefault(name, 0)

    def totals_ms(self) -> dict[str, float]:
        if self.device == "cuda":
            torch.cuda.synchronize()
            return {k: sum(a.elapsed_time(b) for a, b in v) for k, v in self.spans.items()}
        return {k: sum(v) for k, v in self.spans.items()}


def prefill_pipeline(layer: V4Attention, hidden: torch.Tensor, clock: StageClock) -> None:
    """The layer's prefill of one sequence stage by stage (the same calls V4Attention.forward makes)."""
    device = hidden.device
    t = hidden.shape[0]
    comp, ix = layer.compressor, layer.compressor.indexer
    cache = layer.new_cache(max_tokens=t, device=device)
    seq = cache.add_sequence()
    table = layer.rope_table(t, device)
    positions = torch.arange(t, device=device)
    entries, keys = [], []
    with clock("compress"):
        s1, s2 = cache.state(seq, "compressor"), cache.state(seq, "indexer")
        for lo, hi in chunks(t, layer.query_chunk):
            entries.append(comp.step(hidden[lo:hi], s1)[0])
            keys.append(ix.step(hidden[lo:hi], s2)[0])
        entries, keys = torch.cat(entries), torch.cat(keys)
    with clock("store"):  # the layer's own store calls (V4Attention.store minus the compressor steps)
        layer.store_kv(hidden, cache, seq, 0, table, positions=positions)
        layer.store_entries(entries, 0, cache, seq, table)
        layer.store_index_keys(keys, 0, cache, seq, table)
    del entries, keys
    for lo, hi in chunks(t, layer.query_chunk):
        h, pos = hidden[lo:hi], positions[lo:hi]
        with clock("project"):
            q, q_res = layer.queries(h, pos, table)
            qi, w = layer.index_queries(h, q_res, pos, table)
        with clock("topk"):
            extra = layer.select(qi, w, cache, seq, pos)
        del qi, w, q_res
        with clock("attention"):
            out = layer.attend(q, cache, seq, pos, extra, start=lo)
        del q, extra
        with clock("output"):
            layer.output(out, pos, table)
        del out


def prefill_row(layer: V4Attention, t: int, device: str, rep_ms: int, reps: int) -> dict:
    """Stage-by-stage times and peaks of a T-token prefill of one sequence, and the whole layer call."""
    gen = torch.Generator(device=device).manual_seed(t)
    hidden = torch.randn(t, layer.hidden_size, generator=gen, device=device).to(layer.q_a_proj.weight.dtype)
    n = t // 4
    txn = t * n * 4 / 2**30
    row = {"tokens": t, "entries": n, "txn_fp32_gib": txn, "reps": reps}
    with torch.no_grad():
        prefill_pipeline(layer, hidden, StageClock(device))  # warm-up (kernel compiles)
        runs, peaks = [], {}
        for _ in range(reps):
            clock = StageClock(device)
            prefill_pipeline(layer, hidden, clock)
            runs.append(clock.totals_ms())
            for k, v in clock.peaks.items():
                peaks[k] = max(peaks.get(k, 0), v)
        stages = {}
        for name in runs[0]:
            ms = sorted(r[name] for r in runs)[len(runs) // 2]
            peak = peaks[name] / 2**30
            stages[name] = {"ms": ms, "peak_extra_gib": peak, "peak_over_txn": peak / txn if txn else 0.0}
        row["stages"] = stages
        row["sum_of_stages_ms"] = sum(v["ms"] for v in stages.values() if "ms" in v)

        def whole_layer():
            c = layer.new_cache(max_tokens=t, device=device)
            layer(hidden, c, c.add_sequence())

        ms, peak = timed(whole_layer, device, rep_ms)
        row["layer"] = {"ms": ms, "peak_extra_gib": peak, "peak_over_txn": peak / txn if txn else 0.0}
    return row


def decode_stages(layer: V4Attention, cache, seq: int, token: torch.Tensor, device: str, rep_ms: int) -> dict:
    """Each stage of one decode step of ``layer`` run alone at the sequence's current position. Reserves one
    spare slot per pool (the store stage rewrites it): run after the step itself was timed."""
    pos = cache.length(seq)
    table = layer.rope_table(pos + 1, device)
    positions = torch.full((1,), pos, dtype=torch.long, device=device)
    comp = layer.compressor
    kv_row = torch.nn.functional.linear(token.to(layer.kv_proj.weight.dtype), layer.kv_proj.weight)
    stages = {}
    with torch.no_grad():
        fns = {}
        if comp is not None:
            parts = [(comp, cache.state(seq, "compressor"))]
            if layer.layer_type == "csa":
                parts.append((comp.indexer, cache.state(seq, "indexer")))

            def compress_one():  # the same token again: it rewrites its own ring row; the count is put back
                for module, state in parts:
                    length = state.length
                    module.step(token, state)
                    state.length = length

            fns["compress"] = compress_one
        slot = cache.reserve("kv", seq, 1)
        entry = torch.zeros(1, 512, device=device)
        key = torch.zeros(1, 128, device=device)
        ent_slot = cache.reserve("extra", seq, 1) if comp is not None else None
        key_slot = cache.reserve("index", seq, 1) if layer.layer_type == "csa" else None
        epos = positions // layer.ratio * layer.ratio if layer.ratio else positions

        def store_one():  # 1 in ratio steps completes a block and stores an entry: time that case
            # the layer's writers (the same launches as its store, on the slots reserved above)
            layer.write_attention_kv(kv_row, positions, slot, cache.kv.pool, table, layer.kv_norm)
            if ent_slot is not None:
                layer.write_attention_kv(entry, epos, ent_slot, cache.extra.pool, table, comp.kv_norm)
            if key_slot is not None:
                layer.write_index_keys(key, epos, key_slot, cache.index.pool, table)

        fns["store"] = store_one
        q, q_res = layer.queries(token, positions, table)
        if layer.layer_type == "csa":
            qi, w = layer.index_queries(token, q_res, positions, table)
            fns["project"] = lambda: layer.index_queries(token, layer.queries(token, positions, table)[1],
                                                         positions, table)
            extra = layer.select(qi, w, cache, seq, positions)
            fns["topk"] = lambda: layer.select(qi, w, cache, seq, positions)
        else:
            fns["project"] = lambda: layer.queries(token, positions, table)
            extra = layer.hca_slots(cache, seq, positions, start=pos) if layer.layer_type == "hca" else None
            if extra is not None:  # hca: every visible entry instead of a top-k
                fns["entries"] = lambda: layer.hca_slots(cache, seq, positions, start=pos)
        out = layer.attend(q, cache, seq, positions, extra, start=pos)
        fns["attention"] = lambda: layer.attend(q, cache, seq, positions, extra, start=pos)
        fns["output"] = lambda: layer.output(out, positions, table)
        for name, fn in fns.items():
            ms, peak = timed(fn, device, rep_ms)
            stages[name] = {"ms": ms, "peak_extra_gib": peak}
    return stages


def decode_row(layer: V4Attention, context: int, device: str, rep_ms: int) -> dict:
    """One decode step after a prefill of ``context`` tokens, against its stages alone."""
    gen = torch.Generator(device=device).manual_seed(1)
    dtype = layer.q_a_proj.weight.dtype
    prompt = torch.randn(context, layer.hidden_size, generator=gen, device=device).to(dtype)
    token = torch.randn(1, layer.hidden_size, generator=gen, device=device).to(dtype)
    cache = layer.new_cache(max_tokens=context + 8192, device=device)
    seq = cache.add_sequence()
    with torch.no_grad():
        layer(prompt, cache, seq)
        step_ms, step_peak = timed(lambda: layer(token, cache, seq), device, rep_ms)
    stages = decode_stages(layer, cache, seq, token, device, rep_ms)
    total = sum(v["ms"] for v in stages.values())
    return {"context": context, "step_ms": step_ms, "step_peak_extra_gib": step_peak, "stages": stages,
            "sum_of_stages_ms": total, "step_over_stages": step_ms / total if total else math.nan,
            "target_step_over_stages": 1.5}


class _NoAttention(torch.nn.Module):
    """Stands in for an attention block to time the rest of the model alone."""

    def forward(self, hidden_states, *args, **kwargs):
        return torch.zeros_like(hidden_states), None


def patched_model_row(geo: dict, context: int, device: str, rep_ms: int, key_format: str) -> dict:
    """A transformers DeepseekV4ForCausalLM with two layers of this geometry (csa, hca; small MoE) patched
    with dsakit: one decode step of the model against its stages alone (each attention block's stages, plus
    the rest of the model timed with the attention blocks stubbed out)."""
    try:
        from transformers.models.deepseek_v4 import configuration_deepseek_v4, modeling_deepseek_v4

        from dsakit.integrations.transformers import patch_deepseek_v4
    except ImportError as err:
        return {"skipped": f"transformers with DeepSeek-V4 is not installed ({err})"}
    small = geo is SMALL
    config = configuration_deepseek_v4.DeepseekV4Config(
        vocab_size=1024, hidden_size=geo["hidden"], num_hidden_layers=2, num_attention_heads=geo["heads"],
        head_dim=512, q_lora_rank=geo["q_lora"], index_n_heads=geo["index_heads"], index_head_dim=128,
        index_topk=geo["topk"], n_routed_experts=2, num_experts_per_tok=2, moe_intermediate_size=64 if small else 512,
        o_groups=geo["o_groups"], o_lora_rank=geo["o_lora"], sliding_window=128,
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"], mlp_layer_types=["moe", "moe"],
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1})
    with torch.device(device):
        model = modeling_deepseek_v4.DeepseekV4ForCausalLM(config)
    if device == "cuda":
        model = model.to(torch.bfloat16)
    model.eval()
    patch_deepseek_v4(model, index_key_format=key_format, max_tokens=context + 8192)
    gen = torch.Generator(device=device).manual_seed(2)
    ids = torch.randint(0, config.vocab_size, (1, context + 1), generator=gen, device=device)
    with torch.no_grad():
        out = model(ids[:, :context], use_cache=True)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        step = ids[:, context:]
        step_ms, step_peak = timed(lambda: model(step, cache=cache, use_cache=True), device, rep_ms)
        layers = model.model.layers
        blocks = [layer.self_attn for layer in layers]
        try:
            for layer in layers:
                layer.self_attn = _NoAttention()
            rest_ms, _ = timed(lambda: model(step, cache=cache, use_cache=True), device, rep_ms)
        finally:
            for layer, block in zip(layers, blocks):
                layer.self_attn = block
    per_layer = []
    token = torch.randn(1, config.hidden_size, generator=gen, device=device).to(model.dtype)
    for block in blocks:
        state = getattr(cache.layers[block.layer_idx], "_dsakit_layer_state")
        stages = decode_stages(block, state.cache, state.seqs[0], token, device, rep_ms)
        per_layer.append({"layer_type": block.layer_type, "stages": stages,
                          "sum_ms": sum(v["ms"] for v in stages.values())})
    total = rest_ms + sum(r["sum_ms"] for r in per_layer)
    return {"context": context, "layers": per_layer, "model_step_ms": step_ms, "model_step_peak_extra_gib": step_peak,
            "rest_of_model_ms": rest_ms, "sum_of_stages_ms": total,
            "step_over_stages": step_ms / total if total else math.nan, "target_step_over_stages": 1.5}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default=None, help="commit id to record (default: git rev-parse, else 'unknown')")
    parser.add_argument("--device", default="cuda", help="cpu: smoke run of the code paths (no timing claims)")
    parser.add_argument("--small", action="store_true", help="tiny geometry and lengths (CPU smoke)")
    parser.add_argument("--tokens", default=None, help="comma list of prefill lengths (default 8192,32768,131072)")
    parser.add_argument("--decode-context", type=int, default=None, help="context of the decode section (32768)")
    parser.add_argument("--key-format", default="fp8", help="index-key format of the layer")
    parser.add_argument("--rep-ms", type=int, default=100)
    parser.add_argument("--reps", type=int, default=3, help="recorded pipeline runs per prefill length (median)")
    parser.add_argument("--skip", default="", help="comma list of sections to skip: prefill,decode,patched_model")
    args = parser.parse_args(argv)
    if args.commit is None:
        try:
            args.commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                         cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip() or "unknown"
        except (OSError, subprocess.SubprocessError):
            args.commit = "unknown"
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available (use --device cpu --small for a smoke run)")
    geo = SMALL if args.small else FLASH
    tokens = [int(x) for x in (args.tokens or ("256,512" if args.small else "8192,32768,131072")).split(",")]
    context = args.decode_context or (300 if args.small else 32768)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bench_layer.json"
    report = {**environment(device, args.commit), "geometry": geo, "key_format": args.key_format,
              "kv_format": "bf16", "prefill": [], "decode": None, "patched_model": None,
              "errors": []}
    layer = build_layer(geo, device, args.key_format)
    report["query_chunk"] = layer.query_chunk
    skip = set(filter(None, args.skip.split(",")))
    if "prefill" not in skip:
        for t in tokens:
            try:
                report["prefill"].append(prefill_row(layer, t, device, args.rep_ms, args.reps))
            except Exception as err:  # keep going: a failed length is recorded, not fatal
                report["errors"].append({"section": f"prefill {t}", "error": repr(err),
                                         "trace": traceback.format_exc(limit=4)})
            if device == "cuda":
                torch.cuda.empty_cache()
            write_json(path, report)
    if "decode" not in skip:
        try:
            report["decode"] = decode_row(layer, context, device, args.rep_ms)
        except Exception as err:
            report["errors"].append({"section": "decode", "error": repr(err), "trace": traceback.format_exc(limit=4)})
        write_json(path, report)
    if "patched_model" not in skip:
        del layer
        if device == "cuda":
            torch.cuda.empty_cache()
        try:
            report["patched_model"] = patched_model_row(geo, context, device, args.rep_ms, args.key_format)
        except Exception as err:
            report["errors"].append({"section": "patched_model", "error": repr(err),
                                     "trace": traceback.format_exc(limit=4)})
        write_json(path, report)
    print(path.read_text() if args.small else f"wrote {path}")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
