"""dsakit beside every peer present on the machine, timed the same way on the same inputs in one process.

Peers (each built or unpacked by a script of benchmarks/anchors/ from the ignored folder .anchors/; a peer
that is not importable is reported as missing with the reason, never timed from elsewhere):

  DeepGEMM     ``deep_gemm``: fp8 MQA logits (prefill), paged fp8 MQA logits (decode); + torch.topk
               (source benchmarks/anchors/build_deepgemm.sh .anchors/deepgemm-54e2261.tgz)
  StreamIndex  ``flash_sparse``: Triton V4 indexer, bf16 q and keys, chunked scores + torch.topk merge
               (source benchmarks/anchors/build_streamindex.sh .anchors/streamindex-06e9216.tgz)
  FlashMLA     ``flash_mla``: sparse attention prefill (bf16 KV) and decode (fp8 KV), sections attention-*
               (source benchmarks/anchors/build_flashmla.sh .anchors/flashmla-9241ae3.tgz)
  FlashInfer   ``flashinfer.top_k`` (sorted, deterministic, ties to the lower index), when importable
  DeepSelect   ``deep_select.topk`` (fp32 input, sorted), when importable
  torch.topk   always

Timing rule (issue 26): prefill calls are timed eager on both sides (triton.testing.do_bench); decode calls
are timed as CUDA-graph replays on both sides (do_bench_cudagraph), the peer's whole step (logits + top-k)
captured in one graph like dsakit's plan. Sections:

  select   the exact top-k alone on the same fp32 rows: 8192 x 65536 (eager) and 64 x 131072 (graph), K 2048,
           rows randn / relu (half exact zeros) / relu_zeros (~99 % zeros: the k-th value is a tied zero) /
           shift100 (randn + 100); dsakit's streaming select vs torch.topk and each select peer; exactness
           (selected values equal torch.topk's), index sets equal to dsakit's, two calls bitwise equal
  prefill  indexer top-k end to end, T 8192 x N 8192 / 32768 / 65536 / 262144, H 64, K 2048, every query sees
           every entry: dsakit fp8 keys vs DeepGEMM fp8 logits + torch.topk (one eager call: logits then
           top-k); dsakit bf16 keys vs StreamIndex (bf16, chunk_s 2048, chunk_t 8192); peak extra memory
  decode   B 64 x N 65536 / 131072, next_n 1 / 2 / 4 (rows B * next_n), graph on both sides: dsakit fp8 and
           fp4 keys (fp8 q + q_scale) vs DeepGEMM paged fp8 logits + torch.topk; at next_n 1 also dsakit bf16
           vs StreamIndex; times per call and per query row; the fp8 step's select alone on the scores that
           step wrote (``dsakit_fp8_select_of_step_ms``, graph: the step's split between scores and select)

Ratios are dsakit / peer from the same run (< 1: dsakit faster). Results: DIR/peers_<commit>.json (written
after every case) with GPU, versions, commit and each peer's version and source commit.

Usage (GPU machine):
    source benchmarks/anchors/build_deepgemm.sh .anchors/deepgemm-54e2261.tgz
    source benchmarks/anchors/build_streamindex.sh .anchors/streamindex-06e9216.tgz
    PYTHONPATH=$PWD:$PYTHONPATH python3 benchmarks/bench_peers.py --out DIR [--sections select,prefill,decode]
    source benchmarks/anchors/build_flashmla.sh .anchors/flashmla-9241ae3.tgz
    PYTHONPATH=$PWD:$PYTHONPATH python3 benchmarks/bench_peers.py --out DIR --sections attention-prefill,attention-decode
(``--device cpu --smoke`` under TRITON_INTERPRET=1: toy sizes, dsakit and torch only, no timing claims)

attention (sections ``attention-prefill``, ``attention-decode``): dsakit's sparse attention beside FlashMLA's.

Both sides read the same bytes: dsakit's pools are FlashMLA's layouts, viewed, never copied.

* bf16 KV: a dsakit page (64 x 512 bf16, 65536 B) is 64 rows of FlashMLA's prefill ``kv [s_kv, 1, 512]``;
  the global slot ``page * 64 + offset`` is the row index FlashMLA takes.
* fp8 KV (584 B/token): dsakit's ``fp8-rope-bf16`` page is FlashMLA's MODEL1 fp8 block with block size 64:
  64 x (448 e4m3 + 64 bf16 rope = 576 B), then 64 x (7 ue8m0 scales + 1 pad byte), padded to 37440 B
  (a multiple of 576). FlashMLA's ``k_cache`` is the view ``pool[:, :64 * 584].view(P, 64, 1, 584)``
  (stride 584 between tokens, 37440 between blocks), indices ``[B, next_n, K]`` are the same global slots.
* sink: fp32 [Hq] on both sides, same meaning (absorbs softmax mass, contributes no value, leaves lse alone).

Which side has what (FlashMLA 9241ae3, sm_90): sparse prefill ``flash_mla_sparse_fwd`` takes bf16 KV only;
sparse decode ``flash_mla_with_kvcache(indices=...)`` takes fp8 KV only. Rows where FlashMLA has no kernel
time dsakit alone and say so (``flashmla: {"unsupported": ...}``); a FlashMLA that is not importable is
reported as missing with the reason, never substituted.

Sections ``attention-prefill`` / ``attention-decode`` (Hq 64 and 128, head dim 512 (d_qk = d_v = 512), sink on, every index valid and distinct):
  prefill  T 4096 queries over a pool of 8192 tokens, K 512 / 1024 / 2048 random slots; bf16 and fp8 KV;
           timed eager on both sides (triton.testing.do_bench).
  decode   B 64 / 128 sequences of 8192 tokens, next_n 1 / 2 (T = B * next_n), K 512 / 2048 slots of each
           query's own sequence; fp8 and bf16 KV; timed eager and as CUDA-graph replays, both sides alike.
FLOPs = 2 * T * K * Hq * (d_qk + d_v); ratios are dsakit ms / FlashMLA ms of the same run (< 1: dsakit faster).

Agreement (the flash-attention rule): on a subset of queries each kernel's max |error| against an fp32
PyTorch implementation on the same dequantized entries must be at most twice the error of the same
computation done with every op in bf16, plus the rounding of the fp32 answer to the output dtype; for out
and lse alike. The two outputs agree when both pass; their direct max difference is reported too.
Results: DIR/attention_vs_flashmla_<commit>.json, written after every row.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch
from _common import (DIM, bench_parser, environment, make_queries, median_ms, peak_extra_bytes, same_selection,
                     timing_pool, write_json)
from bench_attention import FORMATS, random_pool, torch_attention
from bench_attention import flops as attention_flops
from bench_indexer import make_scores

from dsakit import PagedBatch
from dsakit.formats import KeyFormat
from dsakit.ops.attention import sparse_attention
from dsakit.ops.indexer.triton import index_topk_decode
from dsakit.ops.indexer.plans import plan_decode_topk
from dsakit.ops.indexer.select import SelectBuffers, launch_select, select_topk_stream
from dsakit.ops.indexer.triton import index_topk_triton, release_workspaces

HEADS = 64
K = 2048
SELECT_KINDS = ("randn", "relu", "relu_zeros", "shift100")
SECTIONS = ("select", "prefill", "decode", "attention-prefill", "attention-decode")
ATTENTION_DIM = 512  # d_qk = d_v = 512 (V4: 448 no-rope + 64 rope dims, shared K = V)
ATTENTION_HEADS = (64, 128)
FLASHMLA_PREFILL_KV = "bf16"  # the only KV cache FlashMLA's sparse prefill takes
FLASHMLA_DECODE_KV = "fp8-rope-bf16"  # the only KV cache FlashMLA's sparse decode takes (MODEL1, 584 B)
FLOP_FORMULA = "2 * T * K * Hq * (d_qk + d_v), d_qk = d_v = 512"


# ----------------------------------------------------------------------------------------------- peers
def _anchor_sources(module) -> "str | None":
    """The ANCHOR_SOURCES record the pack script put beside the package (source commits), if any."""
    for parent in Path(module.__file__).resolve().parents[:3]:
        record = parent / "ANCHOR_SOURCES"
        if record.is_file():
            return record.read_text().strip()
    return None


def load_peers(device: str) -> tuple[dict, dict]:
    """-> (modules of the peers present, {peer: {"present", "version", "sources" | "reason"}})."""
    modules, info = {}, {}
    wanted = {"deep_gemm": "deep_gemm", "streamindex": "flash_sparse.triton.chunked_indexer",
              "flashinfer": "flashinfer", "deep_select": "deep_select"}
    for peer, name in wanted.items():
        if device != "cuda":
            info[peer] = {"present": False, "reason": "CUDA only (CPU smoke run)"}
            continue
        try:
            module = __import__(name, fromlist=["_"])
        except Exception as error:  # noqa: BLE001 - any import failure means: this peer is missing here
            info[peer] = {"present": False, "reason": f"{type(error).__name__}: {str(error)[:200]}"}
            print(f"peer {peer} missing: {info[peer]['reason']}", flush=True)
            continue
        top = sys.modules[name.split(".")[0]]
        modules[peer] = module
        info[peer] = {"present": True, "version": getattr(top, "__version__", None),
                      "sources": _anchor_sources(top)}
    return modules, info


def _try(row: dict, key: str, fn):
    """Run fn() and return its result; on failure record ``<key>_error`` in the row and return None."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 - a peer failing on a case is a result, not a crash
        row[f"{key}_error"] = f"{type(error).__name__}: {str(error)[:200]}"
        print(f"  {key} failed: {row[f'{key}_error']}", flush=True)
        return None


def _ratio(row: dict, mine: str, peer: str) -> None:
    if mine in row and peer in row:
        row[f"{mine[:-3]}_vs_{peer[:-3]}"] = row[mine] / row[peer]


def _dsakit_set_equal(got: torch.Tensor, ours: torch.Tensor, k: int) -> bool:
    """Whether a peer's index set equals dsakit's on every row (order ignored)."""
    a = torch.sort(got[:, :k].long(), dim=1).values
    b = torch.sort(ours[:, :k].long(), dim=1).values
    return bool(torch.equal(a, b))


def _time_prefill_peer(row: dict, name: str, prefix: str, step, mine: torch.Tensor, ours_key: str, bench,
                       dev) -> None:
    """Run a peer's prefill step once (its recall of dsakit's indices), then its peak extra memory and time
    under ``<prefix>_peak_gib`` / ``<prefix>_ms`` and the ratio to ``ours_key``; a failing peer leaves
    ``<name>_error`` in the row instead."""
    got = _try(row, name, step)
    if got is None:
        return
    row[f"{name}_recall_of_dsakit"] = _recall(got, mine)
    del got
    row[f"{prefix}_peak_gib"] = peak_extra_bytes(step, dev) / 2**30
    row[f"{prefix}_ms"] = bench(step)
    _ratio(row, ours_key, f"{prefix}_ms")


def _recall(got: torch.Tensor, ours: torch.Tensor) -> float:
    """Mean fraction of dsakit's valid indices (>= 0) that the peer selected too (row by row)."""
    ours = ours.long()
    theirs = torch.sort(got.long(), dim=1).values.contiguous()
    pos = torch.searchsorted(theirs, ours.contiguous()).clamp(max=theirs.shape[1] - 1)
    hit = (theirs.gather(1, pos) == ours) & (ours >= 0)
    return float(hit.sum()) / max(int((ours >= 0).sum()), 1)


# ---------------------------------------------------------------------------------------------- select
def select_case(row: dict, scores: torch.Tensor, k: int, graph: bool, peers: dict, bench) -> None:
    rows, width = scores.shape
    buffers = SelectBuffers.allocate(rows, width, k, scores.device)

    def ours():
        return select_topk_stream(scores, k, buffers=buffers)

    mine = ours().clone()
    row["dsakit_check"] = same_selection(mine, scores, k)
    row["dsakit_deterministic"] = bool(torch.equal(mine, ours()))
    row["dsakit_paths"] = buffers.path_counts(rows)
    row["dsakit_ms"] = bench(ours, graph)
    row["torch_topk_ms"] = bench(lambda: torch.topk(scores, k, dim=1), graph)
    _ratio(row, "dsakit_ms", "torch_topk_ms")
    row["dsakit_speedup_vs_torch_topk"] = row["torch_topk_ms"] / row["dsakit_ms"]
    callers = {}
    if "flashinfer" in peers:
        fi = peers["flashinfer"]
        callers["flashinfer"] = lambda: fi.top_k(scores, k, sorted=True, deterministic=True, tie_break=1,
                                                 dsa_graph_safe=graph)[1]
    if "deep_select" in peers:
        ds = peers["deep_select"]
        callers["deep_select"] = lambda: ds.topk(scores, k, sorted=True, return_value=False)[1]
    for name, call in callers.items():
        got = _try(row, name, call)
        if got is None:
            continue
        got = got.clone()
        row[f"{name}_check"] = same_selection(got, scores, k)
        row[f"{name}_same_set_as_dsakit"] = _dsakit_set_equal(got, mine, k)
        row[f"{name}_deterministic"] = bool(torch.equal(got, call()))
        timed = _try(row, f"{name}_time", lambda call=call: bench(call, graph))
        if timed is not None:
            row[f"{name}_ms"] = timed
            _ratio(row, "dsakit_ms", f"{name}_ms")


# --------------------------------------------------------------------------------------------- helpers
def ordered_pool(fmt: KeyFormat, n: int, device: str, seed: int):
    """One sequence of n entries whose pages are in table order (page i = logical page i), so the peers'
    contiguous key tensors are views of the same bytes dsakit reads."""
    pool, table, counts = timing_pool(fmt, [n], device, seed)
    pool = pool[table[0].long()].contiguous()
    table = torch.arange(pool.shape[0], device=device, dtype=torch.int32).unsqueeze(0)
    return pool, table, counts


def fp8_keys(pool: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ordered fp8 pool -> DeepGEMM's kv (fp8 [n, 128], fp32 scales [n]): the same bytes."""
    values = pool[:, : 64 * DIM].reshape(-1, DIM)[:n]
    scales = pool[:, 64 * DIM:].contiguous().view(torch.float32).reshape(-1)[:n]
    return values.contiguous().view(torch.float8_e4m3fn), scales.contiguous()


def bf16_keys(pool: torch.Tensor, entries_per_seq: int, seqs: int = 1) -> torch.Tensor:
    """Ordered bf16 pool (sequence s owns pages s * P .. s * P + P - 1) -> StreamIndex's k_idx [seqs, n, 128]."""
    values = pool[:, : 64 * 2 * DIM].contiguous().view(torch.bfloat16).reshape(seqs, -1, DIM)
    return values[:, :entries_per_seq].contiguous()


def bf16_keys_paged(pool: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """bf16 pool + block table [B, pages] (every sequence n entries) -> the same keys gathered into
    StreamIndex's contiguous k_idx [B, n, 128]."""
    pages = pool[table.long().clamp(min=0)]  # [B, pages, page_bytes]
    return pages.reshape(table.shape[0], -1).view(torch.bfloat16).reshape(table.shape[0], -1, DIM)[:, :n].contiguous()


def deepgemm_prefill_step(dg, pool: torch.Tensor, n: int, q: torch.Tensor, w: torch.Tensor, qs: torch.Tensor,
                          k: int):
    """DeepGEMM's prefill indexer step on an ordered fp8 pool of n entries (every query sees every entry):
    fp8 MQA logits, then torch.topk. DeepGEMM has no q scale: it is folded into the weights."""
    t = q.shape[0]
    kv = fp8_keys(pool, n)
    ks = torch.zeros(t, dtype=torch.int32, device=q.device)
    ke = torch.full((t,), n, dtype=torch.int32, device=q.device)
    wq = (w * qs).contiguous()

    def step():
        logits = dg.fp8_fp4_mqa_logits((q, None), kv, wq, ks, ke, clean_logits=False)
        return torch.topk(logits, k, dim=1)[1]

    return step


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(commit_default=None)
    ap.add_argument("--rep", type=int, default=60, help="do_bench rep (ms)")
    ap.add_argument("--sections", default="select,prefill,decode", help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--prefill-n", default="8192,32768,65536,262144")
    ap.add_argument("--decode-n", default="65536,131072")
    ap.add_argument("--next-n", default="1,2,4")
    ap.add_argument("--rows", type=int, default=16, help="attention: queries checked against fp32 torch per checked row")
    args = ap.parse_args(argv)
    sections = args.sections.split(",")
    unknown = [name for name in sections if name not in SECTIONS]
    if unknown:
        ap.error(f"unknown sections {unknown}: choose from {', '.join(SECTIONS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a CUDA GPU (use --device cpu --smoke for the plumbing)")
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                           cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    attention = [name.split("-", 1)[1] for name in sections if name.startswith("attention-")]
    indexer = [name for name in sections if not name.startswith("attention-")]
    failed = run_attention(args, commit, attention) if attention else 0
    return (run_indexer(args, commit, indexer) if indexer else 0) or failed


def run_indexer(args, commit: str, sections: list[str]) -> int:
    """The indexer sections (select, prefill, decode) beside DeepGEMM, StreamIndex and the select peers;
    writes DIR/peers_<commit>.json."""
    dev = args.device
    peers, peer_info = load_peers(dev)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"peers_{commit}.json"
    meta = environment(dev, commit)
    meta.update({"peers": peer_info, "H": 4 if args.smoke else HEADS, "D": DIM, "K": 16 if args.smoke else K,
                 "timing": "prefill eager both sides, decode "
                 "CUDA-graph replays both sides; ratios dsakit / peer of the same run"})
    report = {"meta": meta, "select": [], "prefill": [], "decode": []}
    smoke = args.smoke
    k = 16 if smoke else K
    heads = 4 if smoke else HEADS
    t_start = time.time()
    graph_ok = dev == "cuda"

    def bench(fn, graph=False):
        return median_ms(fn, dev, args.rep, graph=graph and graph_ok)

    def emit(section: str, row: dict) -> None:
        report[section].append(row)
        print({key: (round(v, 4) if isinstance(v, float) else v) for key, v in row.items()}, flush=True)
        write_json(path, report)

    def section_select() -> None:
        shapes = [(16, 600, False), (4, 2000, True)] if smoke else [(8192, 65536, False), (64, 131072, True)]
        for rows, n, graph in shapes:
            for kind in SELECT_KINDS:
                scores = make_scores("randn" if kind == "relu" else kind, rows, n, dev, seed=5)
                if kind == "relu":  # half the row exact zeros, the top k all positive
                    scores.relu_()
                row = {"case": "decode" if graph else "prefill", "rows": rows, "N": n, "K": k, "kind": kind,
                       "timing": "graph" if graph and graph_ok else "eager"}
                select_case(row, scores, k, graph, peers, bench)
                emit("select", row)
                del scores

    def section_prefill() -> None:
        t = 16 if smoke else 8192
        for n in ([300, 1200] if smoke else [int(x) for x in args.prefill_n.split(",")]):
            row = {"case": "prefill", "T": t, "N": n, "K": k, "H": heads, "timing": "eager"}
            fmt = KeyFormat.parse("fp8")
            pool, table, counts = ordered_pool(fmt, n, dev, seed=7)
            q, w, qs = make_queries("fp8", t, heads, dev, seed=8)
            batch = PagedBatch.build(pool, fmt, table, counts, torch.zeros(t, dtype=torch.int32, device=dev))

            def ours():
                return index_topk_triton(q, w, batch, k, q_scale=qs)

            mine = ours().clone()
            release_workspaces()  # the peak counts the workspaces a first call allocates
            row["dsakit_fp8_peak_gib"] = peak_extra_bytes(ours, dev) / 2**30
            row["dsakit_fp8_ms"] = bench(ours)
            if "deep_gemm" in peers:
                dg_step = deepgemm_prefill_step(peers["deep_gemm"], pool, n, q, w, qs, k)
                _time_prefill_peer(row, "deepgemm", "deepgemm_topk", dg_step, mine, "dsakit_fp8_ms", bench, dev)
            del pool, q, w, qs, batch, mine
            # bf16 keys: dsakit vs StreamIndex on the same bf16 bytes
            fmt = KeyFormat.parse("bf16")
            pool, table, counts = ordered_pool(fmt, n, dev, seed=9)
            q, w, _ = make_queries("bf16", t, heads, dev, seed=8)
            batch = PagedBatch.build(pool, fmt, table, counts, torch.zeros(t, dtype=torch.int32, device=dev))

            def ours_bf16():
                return index_topk_triton(q, w, batch, k)

            mine = ours_bf16().clone()
            release_workspaces()
            row["dsakit_bf16_peak_gib"] = peak_extra_bytes(ours_bf16, dev) / 2**30
            row["dsakit_bf16_ms"] = bench(ours_bf16)
            if "streamindex" in peers:
                si = peers["streamindex"]
                keys = bf16_keys(pool, n)
                q4, w3 = q.unsqueeze(0).contiguous(), w.unsqueeze(0).contiguous()

                def si_step():
                    return si.chunked_indexer_topk(q4, keys, w3, top_k=k, chunk_s=2048, chunk_t=8192)[0][0]

                _time_prefill_peer(row, "streamindex", "streamindex", si_step, mine, "dsakit_bf16_ms", bench, dev)
            del pool, q, w, batch, mine
            release_workspaces()
            if dev == "cuda":
                torch.cuda.empty_cache()
            emit("prefill", row)

    def section_decode() -> None:
        b = 2 if smoke else 64
        for n in ([300] if smoke else [int(x) for x in args.decode_n.split(",")]):
            pools = {name: timing_pool(KeyFormat.parse(name), [n] * b, dev, seed=11) for name in ("fp8", "fp4")}
            for next_n in [int(x) for x in args.next_n.split(",")]:
                rows = b * next_n
                row = {"case": "decode", "B": b, "next_n": next_n, "N": n, "K": k, "H": heads,
                       "timing": "graph" if graph_ok else "eager"}
                seq = torch.arange(b, device=dev, dtype=torch.int32).repeat_interleave(next_n)
                q, w, qs = make_queries("fp8", rows, heads, dev, seed=12)
                mine = None
                for name, (pool, table, counts) in pools.items():
                    fmt = KeyFormat.parse(name)
                    batch = PagedBatch.build(pool, fmt, table, counts, seq)
                    plan = plan_decode_topk(b, next_n, n, k, fmt, dev, num_heads=heads)

                    def ours(plan=plan, batch=batch):
                        return index_topk_decode(q, w, batch, k, plan=plan, q_scale=qs)

                    got = ours().clone()
                    if name == "fp8":
                        mine = got
                        row["dsakit_fp8_check"] = same_selection(got, plan.workspace[:, :n], k)
                        # the step's select alone, on the scores the step just wrote (its own buffers, graph):
                        # where the step's time goes between scores and select
                        select_only = lambda plan=plan: launch_select(  # noqa: E731
                            plan.workspace[:, :n], plan.visible, plan.indices, k, plan.sort, config=plan.select,
                            cand_vals=plan.cand_vals, cand_idx=plan.cand_idx, stream_buffers=plan.stream)
                        row["dsakit_fp8_select_of_step_ms"] = bench(select_only, graph=True)
                    row[f"dsakit_{name}_ms"] = bench(ours, graph=True)
                    row[f"dsakit_{name}_us_per_row"] = 1e3 * row[f"dsakit_{name}_ms"] / rows
                    del plan, batch
                row["fp4_vs_fp8"] = row["dsakit_fp4_ms"] / row["dsakit_fp8_ms"]
                if "deep_gemm" in peers:
                    dg = peers["deep_gemm"]
                    pool, table, counts = pools["fp8"]
                    kv_cache = pool.view(pool.shape[0], 64, 1, DIM + 4)
                    context = torch.full((b, next_n), n, dtype=torch.int32, device=dev)
                    q4 = q.reshape(b, next_n, heads, DIM)
                    wq = (w * qs).contiguous()
                    meta_dg = _try(row, "deepgemm", lambda: dg.get_paged_mqa_logits_metadata(context, 64,
                                                                                              dg.get_num_sms()))

                    def dg_step():  # the metadata is per batch, shared by every layer: computed once, outside
                        logits = dg.fp8_fp4_paged_mqa_logits((q4, None), kv_cache, wq, context, table, meta_dg, n,
                                                             clean_logits=False)
                        return torch.topk(logits, k, dim=1)[1]

                    got = None if meta_dg is None else _try(row, "deepgemm", dg_step)
                    if got is not None:
                        row["deepgemm_recall_of_dsakit"] = _recall(got, mine)
                        timed = _try(row, "deepgemm_graph", lambda: bench(dg_step, graph=True))
                        row["deepgemm_timing"] = "graph"
                        if timed is None:  # not capturable here: time it eager and say so (not the same rule)
                            timed = bench(dg_step)
                            row["deepgemm_timing"] = "eager (graph capture failed)"
                        if timed is not None:
                            row["deepgemm_topk_ms"] = timed
                            row["deepgemm_topk_us_per_row"] = 1e3 * timed / rows
                            _ratio(row, "dsakit_fp8_ms", "deepgemm_topk_ms")
                            _ratio(row, "dsakit_fp4_ms", "deepgemm_topk_ms")
                if next_n == 1:
                    # bf16 keys with bf16 q: dsakit's plan vs StreamIndex (one query per sequence)
                    fmt = KeyFormat.parse("bf16")
                    pool, table, counts = timing_pool(fmt, [n] * b, dev, seed=13)
                    qb, wb, _ = make_queries("bf16", rows, heads, dev, seed=12)
                    batch = PagedBatch.build(pool, fmt, table, counts, seq)
                    plan = plan_decode_topk(b, 1, n, k, fmt, dev, num_heads=heads)

                    def ours_bf16():
                        return index_topk_decode(qb, wb, batch, k, plan=plan)

                    mine_bf16 = ours_bf16().clone()
                    row["dsakit_bf16_ms"] = bench(ours_bf16, graph=True)
                    if "streamindex" in peers:
                        si = peers["streamindex"]
                        keys = bf16_keys_paged(pool, table, n)
                        q4, w3 = qb.reshape(b, 1, heads, DIM).contiguous(), wb.reshape(b, 1, heads).contiguous()

                        def si_step():
                            return si.chunked_indexer_topk(q4, keys, w3, top_k=k, chunk_s=2048, chunk_t=8192)[0]

                        got = _try(row, "streamindex", si_step)
                        if got is not None:
                            row["streamindex_recall_of_dsakit"] = _recall(got.reshape(rows, k), mine_bf16)
                            timed = _try(row, "streamindex_graph", lambda: bench(si_step, graph=True))
                            row["streamindex_timing"] = "graph"
                            if timed is None:  # its host code may not be capturable: time it eager, say so
                                timed = bench(si_step)
                                row["streamindex_timing"] = "eager (graph capture failed)"
                            row["streamindex_ms"] = timed
                            _ratio(row, "dsakit_bf16_ms", "streamindex_ms")
                        del keys
                    del pool, batch, plan
                emit("decode", row)
            del pools
            if dev == "cuda":
                torch.cuda.empty_cache()

    runs = {"select": section_select, "prefill": section_prefill, "decode": section_decode}
    for name in sections:  # in the order given, so the most wanted section runs first
        runs[name]()

    report["meta"]["total_s"] = time.time() - t_start
    write_json(path, report)
    summary(report)
    inexact = [r for r in report["select"] if not r["dsakit_check"]["values_equal"]]
    inexact += [r for r in report["decode"] if not r["dsakit_fp8_check"]["values_equal"]]
    print(f"done in {report['meta']['total_s']:.0f} s; {len(inexact)} cases where dsakit's select was inexact")
    return 1 if inexact else 0


# ------------------------------------------------------------------------------------ attention: FlashMLA
def flash_rule(got: torch.Tensor, want: torch.Tensor, low: torch.Tensor, out_dtype: torch.dtype) -> dict:
    """The flash-attention tolerance rule for one output.

    got: the kernel's result; want: an fp32 implementation's; low: the same implementation with every op in
    the kernel's precision (bf16); all the same shape. ok when every value of got is finite and
    max|got - want| <= 2 * max|low - want| + rounding, rounding = max|want cast to out_dtype - want| (the error
    of writing the exact answer in the kernel's output dtype; at least 1e-6)."""
    got, want, low = got.float(), want.float(), low.float()
    err = (got - want).abs().max().item() if got.numel() else 0.0
    low_err = (low - want).abs().max().item() if low.numel() else 0.0
    rounding = max((want.to(out_dtype).float() - want).abs().max().item() if want.numel() else 0.0, 1e-6)
    finite = bool(torch.isfinite(got).all())
    return {"err": err, "low_precision_err": low_err, "rounding": rounding,
            "ok": finite and err <= 2 * low_err + rounding}


def gathered_entries(pool: torch.Tensor, fmt, idx: torch.Tensor) -> torch.Tensor:
    """fp32 [R, K, 512] on pool's device: the entries of the (all valid) slots idx int [R, K], decoded by the
    format's own CPU codec (the spec) from only the pages idx touches."""
    slots = idx.long().cpu()
    pages, where = torch.unique(slots // 64, return_inverse=True)
    entries = fmt.dequantize_pages(pool[pages.to(pool.device)].cpu())  # [U * 64, 512]
    return entries[where * 64 + slots % 64].to(pool.device)


def agreement(q, pool, fmt, idx, sink, scale, results: dict, rows: int) -> dict:
    """The flash rule for each side's (out [T, H, 512], lse [T, H]) in results on `rows` evenly spaced queries,
    and the two sides' direct max difference."""
    sel = torch.linspace(0, q.shape[0] - 1, min(rows, q.shape[0])).long().to(q.device)
    kv = gathered_entries(pool, fmt, idx[sel])
    want_out, want_lse = torch_attention(q[sel].float(), kv, sink, scale, torch.float32)
    low_out, low_lse = torch_attention(q[sel].float(), kv, sink, scale, torch.bfloat16)
    report = {"rows_checked": int(sel.numel())}
    for side, (out, lse) in results.items():
        rule_out = flash_rule(out[sel], want_out, low_out, out.dtype)
        rule_lse = flash_rule(lse[sel], want_lse, low_lse, lse.dtype)
        report[side] = {"out": rule_out, "lse": rule_lse, "ok": rule_out["ok"] and rule_lse["ok"]}
    if len(results) == 2:
        (a_out, a_lse), (b_out, b_lse) = results.values()
        report["max_diff_out"] = (a_out.float() - b_out.float()).abs().max().item()
        report["max_diff_lse"] = (a_lse - b_lse).abs().max().item()
    report["agree"] = all(report[side]["ok"] for side in results)
    return report


# ------------------------------------------------------------------------------------------- inputs
def make_pool(fmt, tokens: int, device: str, gen: torch.Generator) -> torch.Tensor:
    """uint8 [tokens / 64, page_bytes] of random valid entries: on CUDA built there (bench_attention's
    random_pool), on the CPU through the format's reference codec."""
    if device == "cuda":
        return random_pool(fmt, tokens, gen)
    return fmt.quantize_pages(torch.randn(tokens, ATTENTION_DIM, generator=gen))


def make_inputs(fmt, hq: int, t: int, k: int, span: int, seqs: int, device: str, gen: torch.Generator):
    """q bf16 [T, Hq, 512], pool of seqs * span tokens, indices int32 [T, K] (query i draws K distinct slots
    of its own sequence i * seqs // T, i.e. slots [s * span, (s + 1) * span)), sink fp32 [Hq]."""
    pool = make_pool(fmt, seqs * span, device, gen)
    q = torch.randn(t, hq, ATTENTION_DIM, device=device, generator=gen).bfloat16()
    sink = torch.randn(hq, device=device, generator=gen)
    first = (torch.arange(t, device=device) * seqs // t) * span
    order = torch.rand(t, span, device=device, generator=gen).argsort(dim=1)[:, :k]
    return q, pool, (order + first.view(-1, 1)).to(torch.int32), sink


# ------------------------------------------------------------------------------------------- FlashMLA
def load_flashmla(device: str) -> tuple[object, dict]:
    """-> (the flash_mla module or None, {"present", "version", "sources" | "reason"})."""
    if device != "cuda":
        return None, {"present": False, "reason": "FlashMLA runs on CUDA only (CPU smoke run)"}
    try:
        import flash_mla
    except Exception as exc:  # not built, or built against another torch: reported, never faked
        return None, {"present": False, "reason": f"import flash_mla failed: {exc!r}"[:300]}
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return None, {"present": False, "reason": f"this build has sm_90a kernels only; GPU is sm_{major}{minor}"}
    return flash_mla, {"present": True, "version": getattr(flash_mla, "__version__", "?"),
                       "sources": _anchor_sources(flash_mla)}


def flashmla_prefill(flash_mla, q, pool, idx, sink, scale):
    """FlashMLA sparse prefill on dsakit's bf16 pool: kv [P * 64, 1, 512] is the pool's bytes.
    -> (out bf16 [T, H, 512], lse fp32 [T, H])."""
    kv = pool.view(torch.bfloat16).view(-1, 1, ATTENTION_DIM)
    out, _max_logits, lse = flash_mla.flash_mla_sparse_fwd(q, kv, idx.view(idx.shape[0], 1, -1), scale, ATTENTION_DIM, sink)
    return out, lse


def flashmla_decode_call(flash_mla, q, pool, idx, sink, scale, next_n: int):
    """A no-argument FlashMLA sparse decode on dsakit's fp8 pool (see ``attention`` in the module docstring), its
    scheduling metadata made on the first call and kept. The call -> (out [T, H, 512], lse fp32 [T, H])."""
    t, h, _ = q.shape
    b = t // next_n
    k_cache = pool[:, : 64 * 584].view(pool.shape[0], 64, 1, 584)
    q4, idx3 = q.view(b, next_n, h, ATTENTION_DIM), idx.view(b, next_n, -1)
    meta, _ = flash_mla.get_mla_metadata()

    def call():
        out, lse = flash_mla.flash_mla_with_kvcache(q4, k_cache, None, None, ATTENTION_DIM, meta, None, softmax_scale=scale,
                                                    is_fp8_kvcache=True, indices=idx3, attn_sink=sink)
        if lse.shape == (b, h, next_n):  # documented as [B, H, next_n]; accept [B, next_n, H] as well
            lse = lse.transpose(1, 2)
        return out.reshape(t, h, ATTENTION_DIM), lse.reshape(t, h)

    return call


def run_attention(args, commit: str, sections: list[str]) -> int:
    """The attention sections (``sections``: "prefill", "decode") beside FlashMLA; writes
    DIR/attention_vs_flashmla_<commit>.json."""
    dev, smoke = args.device, args.smoke
    flash_mla, fm_info = load_flashmla(dev)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"attention_vs_flashmla_{commit}.json"
    meta = environment(dev, commit)
    meta.update({"dsakit_commit": commit, "flashmla": fm_info, "head_dim": ATTENTION_DIM, "flop_formula": FLOP_FORMULA,
                 "timing": "prefill eager both sides; decode eager and CUDA-graph replays, both sides alike; "
                           "ratio = dsakit ms / FlashMLA ms", "timing_claims": dev == "cuda"})
    report = {"meta": meta, "prefill": [], "decode": []}
    gen = torch.Generator(device=dev).manual_seed(0)
    scale = ATTENTION_DIM ** -0.5
    t_start = time.time()

    def bench(fn, graph=False) -> dict:
        try:
            fn()  # compile / first-call scheduling outside the timing
            ms = median_ms(fn, dev, args.rep, graph=graph and dev == "cuda")
        except Exception as exc:  # e.g. a call that cannot be captured in a graph: reported per side
            return {"error": repr(exc)[:300]}
        return {"ms": ms}

    def timed_sides(row: dict, sides: dict, graph: bool, tag: str) -> None:
        t, k, hq = row["T"], row["K"], row["heads"]
        for side, fn in sides.items():
            if fn is None:
                continue
            res = bench(fn, graph)
            if "ms" in res:
                res["tflops"] = attention_flops(t, hq, k) / res["ms"] / 1e9  # 2 * T * K * Hq * (512 + 512)
            row[side][tag] = res
        both = [row[s].get(tag, {}).get("ms") for s in ("dsakit", "flashmla")]
        if None not in both:
            row[f"ratio_{tag}"] = both[0] / both[1]

    def emit(section: str, row: dict) -> None:
        row["elapsed_s"] = round(time.time() - t_start, 1)
        report[section].append(row)
        print(row, flush=True)
        write_json(path, report)

    def run_row(section, fmt_name, hq, t, k, span, seqs, next_n, check: bool) -> None:
        fmt = FORMATS[fmt_name]
        q, pool, idx, sink = make_inputs(fmt, hq, t, k, span, seqs, dev, gen)
        row = {"kv_format": fmt_name, "heads": hq, "T": t, "K": k, "dsakit": {}, "flashmla": {}}
        if section == "decode":
            row.update(B=seqs, next_n=next_n)

        def ours():
            return sparse_attention(q, pool, idx, kv_format=fmt, sink=sink, softmax_scale=scale)

        theirs = None
        supported = FLASHMLA_PREFILL_KV if section == "prefill" else FLASHMLA_DECODE_KV
        if flash_mla is None:
            row["flashmla"] = {"missing": fm_info["reason"]}
        elif fmt_name != supported:
            row["flashmla"] = {"unsupported": f"FlashMLA's sparse {section} takes {supported} KV only"}
        elif section == "prefill":
            def theirs():
                return flashmla_prefill(flash_mla, q, pool, idx, sink, scale)
        else:
            theirs = flashmla_decode_call(flash_mla, q, pool, idx, sink, scale, next_n)
        if check:
            results = {"dsakit": ours()}
            if theirs is not None:
                try:
                    results["flashmla"] = theirs()
                except Exception as exc:  # a FlashMLA that rejects the inputs is reported, not dropped
                    row["flashmla"] = {"error": repr(exc)[:300]}
                    theirs = None
            row["check"] = agreement(q, pool, fmt, idx, sink, scale, results, args.rows)
        sides = {"dsakit": ours, "flashmla": theirs}
        timed_sides(row, sides, graph=False, tag="eager")
        if section == "decode" and dev == "cuda":
            timed_sides(row, sides, graph=True, tag="graph")
        emit(section, row)

    heads = (64,) if smoke else ATTENTION_HEADS
    if "prefill" in sections:
        t, span, ks = (4, 128, (64,)) if smoke else (4096, 8192, (512, 1024, 2048))
        for fmt_name in ("bf16", "fp8-rope-bf16"):
            for hq in heads:
                for k in ks:
                    run_row("prefill", fmt_name, hq, t, k, span, 1, 1, check=smoke or k == 2048)
    if "decode" in sections:
        span, batches, ks = (128, (2,), (64,)) if smoke else (8192, (64, 128), (512, 2048))
        for fmt_name in ("fp8-rope-bf16", "bf16"):
            for hq in heads:
                for b in batches:
                    for next_n in (1, 2):
                        for k in ks:
                            run_row("decode", fmt_name, hq, b * next_n, k, span, b, next_n,
                                    check=smoke or (k == 2048 and b == 64))
    print("wrote", path)
    return 0


def summary(report: dict) -> None:
    def cell(row, key):
        return f" {row[key]:8.3f}" if key in row else "        -"

    print(f"\n{'select':34s} {'dsakit':>8s} {'torch':>8s} {'flashinf':>8s} {'deepsel':>8s}  (ms)")
    for r in report["select"]:
        print(f"{r['case']} {r['rows']}x{r['N']} {r['kind']:10s} {r['timing']:5s}"
              + "".join(cell(r, key) for key in ("dsakit_ms", "torch_topk_ms", "flashinfer_ms", "deep_select_ms")))
    print(f"\n{'prefill':24s} {'fp8':>8s} {'DG+topk':>8s} {'bf16':>8s} {'StreamIx':>8s}  (ms)")
    for r in report["prefill"]:
        print(f"{r['T']}x{r['N']:<17d}" + "".join(cell(r, key) for key in (
            "dsakit_fp8_ms", "deepgemm_topk_ms", "dsakit_bf16_ms", "streamindex_ms")))
    print(f"\n{'decode':24s} {'fp8':>8s} {'fp4':>8s} {'DG+topk':>8s} {'bf16':>8s} {'StreamIx':>8s}  (ms)")
    for r in report["decode"]:
        print(f"{r['B']}x{r['N']} next_n {r['next_n']:<8d}" + "".join(cell(r, key) for key in (
            "dsakit_fp8_ms", "dsakit_fp4_ms", "deepgemm_topk_ms", "dsakit_bf16_ms", "streamindex_ms")))


if __name__ == "__main__":
    sys.exit(main())
