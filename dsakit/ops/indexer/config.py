"""Tuning of the lightning indexer's Triton kernels, with per-GPU defaults: :class:`ScoresConfig` (the scores
kernels), :class:`SelectConfig` (which select runs and how it is launched),
:class:`StreamConfig` (one launch of the streaming select), :class:`TopkConfig` (the fused scores + select of
``index_topk``), with per-GPU defaults. Every launch setting of the top-k kernels is decided here; the
launchers only read it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..._memory import check_bool, check_choice, check_float, check_instance, check_int, check_power_of_two
from .._tuning import gpu_key

KERNELS = ("auto", "tile", "group")
DECODE_FP4 = ("blocks", "dequant")
DECODE_LOADS = ("gather", "tma")


@dataclass(frozen=True)
class FormatLaunch:
    """Measured launch defaults of the scores kernels for one key format (H200, see SCORES_DEFAULTS).

    decode_block_n: key tile of the decode gather kernel (fp4: for ``decode_fp4 = "dequant"``);
    blocks_block_n: its tile on the fp4 "blocks" path; decode_tiles / decode_stages: key tiles per program and
    pipeline stages of the decode gather kernel at <= 64 query-head columns per program (wider programs use 8
    and 3); prefill_stages: pipeline stages of the prefill tile kernel.
    """

    decode_block_n: int
    blocks_block_n: int = 64
    decode_tiles: int = 8
    decode_stages: int = 3
    prefill_stages: int = 3


@dataclass(frozen=True)
class Launch:
    """Resolved launch settings of one scores kernel launch (:meth:`ScoresConfig.tile_launch` and friends).

    block_n: key tile (entries); per_program: key tiles (pages for the page-copy kernel) per program of a
    decode kernel (1 for the tile kernel); warps, stages; maxnreg: register cap per thread (None: the
    compiler's choice); lookahead: how many key tiles ahead the page-copy kernel loads page terms (page-centred
    keys; 0 = in the tile's own iteration)."""

    block_n: int
    per_program: int
    warps: int
    stages: int
    maxnreg: int | None = None
    lookahead: int = 1


# decode tiles / stages chosen on the H200 at B = 64 x N = 64K / 128K, H 64 (launch sweep
# sweep_topk_h200_1ceb8eb): bf16 0.293 -> 0.284 ms at 64K, fp8 0.198 -> 0.168 ms (BLOCK_N 128), fp4
# "blocks" 0.332 -> 0.279 ms; fp8 confirmed beside DeepGEMM's logits (0.168 vs 0.149 ms,
# vs_deepgemm_h200_b8bb071_run{1,2})
# prefill stages: bf16 keys ran 0.4-2.3 % faster on 2 than 3 in each of three sweeps (sweep_topk_h200_5b7286f,
# _f6afd91_prefill, _c5a81f2_prefill: 18.35 / 18.78 / 18.33 ms against 18.43 / 19.22 / 18.70 at 8192 x 64K);
# fp8 keys 15.5 ms against 13.3 (3 stages kept)
H200_FORMATS: tuple[tuple[str, FormatLaunch], ...] = (
    ("bf16", FormatLaunch(decode_block_n=64, decode_tiles=16, decode_stages=5, prefill_stages=2)),
    ("fp8", FormatLaunch(decode_block_n=128, decode_tiles=16, decode_stages=5)),
    ("fp4", FormatLaunch(decode_block_n=128, decode_tiles=16, decode_stages=5)),
    # page-centred formats (by format name): the plain format's residual work, their page terms from a pass
    ("fp8-centred", FormatLaunch(decode_block_n=128, decode_tiles=16, decode_stages=5)),
    ("fp4-centred", FormatLaunch(decode_block_n=128, decode_tiles=16, decode_stages=5)),
)


@dataclass(frozen=True)
class ScoresConfig:
    """Tuning of :func:`dsakit.ops.indexer.scores.index_scores_triton` (all compile-time launch choices).

    kernel: "auto" (group kernel when each sequence has <= 4 queries and H is a power of two >= 16), "tile"
    (prefill) or "group" (decode). prefill_*: BLOCK_T x BLOCK_N tile, warps (None = 4, or 8 for tiles larger
    than 64 x 128) and pipeline stages of the tile kernel (None = the format's ``FormatLaunch.prefill_stages``:
    2 for bf16 keys, 3 otherwise).
    decode_*: BLOCK_N (None = the key format's ``FormatLaunch.decode_block_n`` / ``blocks_block_n``; 64 from 128
    query-head columns per program on), key tiles per program (None = min(the format's ``decode_tiles``, enough
    to cover W in four programs' worth)), warps and stages (None = the format's ``decode_stages``; 8 tiles and 3
    stages above 64 query-head columns per program) of the group kernel; decode_maxnreg / prefill_maxnreg: a
    register cap per thread for the group / tile kernel (None = the launch default: the compiler's choice,
    except, for keys read by page copies at <= 64 query-head columns per program, 128 for fp4, 168 for
    fp4-centred and 96 for fp8-centred; a lower cap lets more programs share an SM, at the risk of spills).
    decode_fp4: how the group kernel reads fp4 keys: "blocks" (one dot per 32-element scale block on the e2m1
    codes placed in e4m3 bits, each block's scale applied to its dot's result per entry; fp8 tensor cores when
    q is fp8 e4m3, bf16 otherwise) or "dequant" (the keys dequantized to a bf16 tile in registers, one bf16
    dot). Both are exact; the prefill kernel always dequantizes.
    decode_loads: how the group kernel reads fp8 keys with e4m3 queries and fp4 keys on the "blocks" path
    (plain or page-centred): "tma" (default: bulk tensor-memory-accelerator copies per 64-entry page on sm_90+;
    key tiles are then one page, decode_block_n is ignored and decode_tiles_per_program counts pages) or
    "gather" (per-entry addresses through the block table, asynchronous copies). Other formats, query dtypes
    and GPUs before sm_90 always gather.
    page_term_pages / page_term_warps: page columns per program and warps of the page-term pass of the
    page-centred formats (q . c once per query, head and page, before the scores kernel).
    formats: the per-format measured defaults (:class:`FormatLaunch`) that fields left at None fall back to.

    Every launch setting of the kernels comes from here: :meth:`tile_launch`, :meth:`group_launch`,
    :meth:`tma_launch` and :meth:`page_term_launch` resolve them for a launch; the launcher derives nothing.
    """

    kernel: str = "auto"
    prefill_block_t: int = 64
    prefill_block_n: int = 128
    prefill_warps: int | None = None
    prefill_stages: int | None = None
    decode_block_n: int | None = None
    decode_tiles_per_program: int | None = None
    decode_warps: int = 4
    decode_stages: int | None = None
    decode_fp4: str = "blocks"
    decode_maxnreg: int | None = None
    decode_loads: str = "tma"
    prefill_maxnreg: int | None = None
    page_term_pages: int = 64
    page_term_warps: int = 4
    formats: tuple[tuple[str, FormatLaunch], ...] = field(default=H200_FORMATS, repr=False)

    def __post_init__(self):
        check_choice("kernel", self.kernel, KERNELS)
        check_choice("decode_fp4", self.decode_fp4, DECODE_FP4)
        check_choice("decode_loads", self.decode_loads, DECODE_LOADS)
        bt = self.prefill_block_t
        check_power_of_two("block_t (prefill_block_t)", bt, 16)
        for name in ("prefill_block_n", "decode_block_n"):
            value = getattr(self, name)
            check_power_of_two(name, value, 16, allow_none=True)
        check_power_of_two("page_term_pages", self.page_term_pages, 16)
        if not isinstance(self.formats, tuple) or not all(
                isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], FormatLaunch)
                for item in self.formats):
            raise ValueError("formats must be a tuple of (format name, FormatLaunch) pairs")
        for name in ("prefill_warps", "decode_warps", "decode_tiles_per_program", "prefill_stages", "decode_stages",
                     "page_term_warps"):
            value = getattr(self, name)
            check_int(name, value, 1, message=f"{name} must be a positive int", allow_none=True)
        for name in ("decode_maxnreg", "prefill_maxnreg"):
            reg = getattr(self, name)
            if reg is not None and (isinstance(reg, bool) or not isinstance(reg, int) or not 24 <= reg <= 255
                                    or reg % 8):
                raise ValueError(f"{name} must be None or a multiple of 8 in 24..255, got {reg!r}")

    def format_launch(self, name: str) -> FormatLaunch:
        """The measured defaults of key format ``name`` (a ``KEY_CODECS`` name: "fp8", "fp8-centred", ...)."""
        for key, value in self.formats:
            if key == name:
                return value
        raise ValueError(f"ScoresConfig has no launch defaults for key format {name!r}")

    def tile_launch(self, name: str, block_t: int) -> Launch:
        """Prefill tile kernel for key format ``name`` and query tiles of ``block_t`` rows: BLOCK_N =
        prefill_block_n, warps (default 4, 8 for tiles larger than 64 x 128), stages (default: the format's)."""
        bn = self.prefill_block_n
        warps = self.prefill_warps or (4 if block_t * bn <= 64 * 128 else 8)
        return Launch(bn, 1, warps, self.prefill_stages or self.format_launch(name).prefill_stages,
                      self.prefill_maxnreg)

    def group_launch(self, name: str, columns: int, width: int, fp4_blocks: bool) -> Launch:
        """Decode gather kernel for key format ``name``, ``columns`` = queries x heads per program, ``width``
        score columns; ``fp4_blocks``: fp4 keys on the "blocks" path."""
        defaults = self.format_launch(name)
        bn = self.decode_block_n or (defaults.blocks_block_n if fp4_blocks else defaults.decode_block_n)
        if self.decode_block_n is None and bn > 64 and columns > 64:
            # a 128-entry tile's [128, GROUP * H] fp32 logits spill on sm_90 from 128 columns on (fp8 keys:
            # 255 registers, serialized wgmma at 4 x 64); 64 entries keep them in registers
            bn = 64
        # the format's measured tiles / stages hold for programs of <= 64 query-head columns; wider programs
        # (next_n >= 2 at 64 heads) ran faster on 8 tiles and 3 stages (vs_deepgemm_h200_165cbdd: scores at
        # next_n 2 took 0.35 ms with 16 / 5 against ~0.31 ms before)
        narrow = columns <= 64
        tiles_default, stages_default = (defaults.decode_tiles, defaults.decode_stages) if narrow else (8, 3)
        per_program = self.decode_tiles_per_program or max(1, min(tiles_default, -(-width // (bn * 4))))
        warps = self.decode_warps
        if fp4_blocks and columns >= 128:
            # a block's partial logits next to the running sum are two [BLOCK_N, GROUP * H] fp32 tiles: from 128
            # query heads per program on they spill at 4 warps on sm_90 (255 registers); 8 warps halve them
            warps = max(warps, 8)
        return Launch(bn, per_program, warps, self.decode_stages or stages_default, self.decode_maxnreg)

    def tma_launch(self, fp4: bool, columns: int, width: int, page_term: bool = False) -> Launch:
        """Decode page-copy kernel (one 64-entry page per key tile) for fp8 (``fp4`` False) or fp4 entry
        codes, ``columns`` = queries x heads per program, ``width`` score columns; ``page_term``: page-centred
        keys (the residuals of those codes plus each page's q . c)."""
        # fp8: 32 pages per program (the gather path's 16 x 128 entries) and 5 stages, at every next_n: 0.151 /
        # 0.299 ms at 64 x 64K / 128K against 0.167 / 0.325 gathering (3.7 TB/s of keys; sweep_topk_h200_b4b4485;
        # 16-64 pages and 3-6 stages within 2 %, 8 warps 20 % slower); next_n 2 / 4 at 64K: 0.215 / 0.353 ms
        # against 0.273 / 0.489 with 8 pages and 3 stages and 0.316 / 0.498 gathering (sweep_topk_h200_ac42a7e)
        per_program = self.decode_tiles_per_program or max(1, min(32, -(-width // (64 * 4))))
        warps, stages, maxnreg = self.decode_warps, self.decode_stages or 5, self.decode_maxnreg
        if fp4:
            # fp4 is bound by instruction issue, not bytes (ncu at 4a0a4ae: ALU the busiest pipe, 1.1 TB/s): at
            # <= 64 query-head columns a 128-register cap fits four programs per SM instead of three (0.227 /
            # 0.443 ms at 64 x 64K / 128K against 0.263 / 0.486; 104 registers spill: 0.378); from 128 columns
            # 8 warps (4 spill the block logits next to their sum), from 256 columns 3 stages (next_n 4: 1.00 ms
            # against 1.51 with 5; sweep_topk_h200_f6afd91)
            if columns >= 128:
                warps = max(warps, 8)
            if columns >= 256 and self.decode_stages is None:
                stages = 3
            if columns <= 64 and warps == 4 and maxnreg is None:
                # fp4-centred (its page terms loaded a page ahead: an fp4 page takes ~3 us per program, longer
                # than the load): 128 registers spill 180 bytes on sm_90a, 168 none (three programs per SM
                # either way from 144 on); before the terms were prefetched (b548897) a 144 cap ran 0.617 ms
                # against 0.680 at 128 (64 x 64K)
                maxnreg = 168 if page_term else 128
            return Launch(64, per_program, warps, stages, maxnreg, 1)
        if page_term and columns <= 64 and warps == 4 and maxnreg is None:
            # fp8-centred, page terms loaded in their page's iteration under a 96-register cap (no spill on
            # sm_90a, five programs per SM): 0.514 ms at 64 x 64K on the H200 (b548897) against 0.568 with the
            # terms two pages ahead at 112 registers (d405359); uncapped 0.509 (b548897)
            maxnreg = 96
        return Launch(64, per_program, warps, stages, maxnreg, 0 if page_term else 1)

    def page_term_launch(self, columns: int = 0) -> Launch:
        """The page-term pass (page-centred formats): block_n = page columns per program; ``columns`` = query-head
        columns of a group plan's program (0 for tile plans, whose pass takes one head at a time)."""
        warps = self.page_term_warps
        if columns >= 256:
            # the [64 pages, 256] fp32 terms of a 4 x 64-head group spill 486 bytes at 4 warps on sm_90a
            # (255 registers); 8 warps: 191 registers, no spill
            warps = max(warps, 8)
        return Launch(self.page_term_pages, 1, warps, 2)

    @staticmethod
    def for_device(device: "torch.device | str | None" = None) -> "ScoresConfig":
        """The measured defaults of the GPU of ``device`` (the H200 table for GPUs not measured yet)."""
        return SCORES_DEFAULTS[gpu_key(device, SCORES_DEFAULTS)]


# Measured on the H200 (benchmarks/results/scores_h200_c7d9b66.json, T = 8192 x N = 64K and B = 64 x N = 64K /
# 128K): prefill (BLOCK_T, BLOCK_N, warps, stages) = (64, 128, 4, 3) was fastest for every format (bf16 keys
# later measured 0.4-2.3 % faster on 2 stages, FormatLaunch.prefill_stages); decode per format: H200_FORMATS.
SCORES_DEFAULTS: dict[str, ScoresConfig] = {"H200": ScoresConfig(), "default": ScoresConfig()}

# Default fp32 score workspace of the chunked prefill path (bytes). 512 MiB keeps the peak extra memory at
# T = 8192, N = 262144, K = 2048 under 1 GiB while chunks stay large enough (>= 512 rows at N <= 256K) to
# fill the GPU.
DEFAULT_WORKSPACE_BYTES = 512 << 20
# Largest tile of the streaming passes: the collect pass packs two per-tile ranks into one int32 cumsum
# (above + 65536 * inside), exact only while 65536 * BLOCK < 2^31.
MAX_SELECT_BLOCK = 16384
#: Largest k of every top-k op, on every backend: the Triton select's final sort holds next_pow2(K) int64
#: keys in the registers of one program, and the reference refuses what the kernels cannot do.
MAX_K = 16384
#: Largest k of the streaming select (larger k use the multi-pass radix select).
STREAM_MAX_K = 4096
#: int32 counters the streaming select keeps per row and split (the STATS of its kernels)
STREAM_STATS = 8


def pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def _next_pow2(x: int) -> int:
    return 1 << (max(1, x) - 1).bit_length()


def rows_per_chunk(t: int, width: int, workspace_bytes: int) -> int:
    """Query rows scored at once so that the fp32 workspace [rows, width] fits ``workspace_bytes``."""
    if width <= 0:
        return max(1, t)
    return int(max(1, min(t, workspace_bytes // (4 * width))))


def _power_of_two(name: str, value, low: int, high: int | None = None) -> None:
    bound = f"{low}..{high}" if high is not None else f">= {low}"
    check_power_of_two(name, value, low, high, message=f"{name} must be a power of two in {bound}", allow_none=True)


@dataclass(frozen=True)
class StreamConfig:
    """One launch of the streaming select (powers of two). splits: programs per row; cap: candidate entries
    per row (all splits and lanes); lanes: buffer lanes per program (each lane owns v consecutive entries of
    every tile of lanes * v entries and cap // (splits * lanes) buffer entries); tie_cap: entries of each
    lane's list of the first indices equal to the threshold; sample: entries of the threshold sample (>= 32);
    num_warps / final_warps / order_warps: the three kernels; bins: histogram buckets of the narrowing;
    order_chunks: programs per row of the sort (1: one program sorts the row's k winners; C > 1: C programs
    each sort next_pow2(k) / C of them, then C programs place each entry at its rank by binary searches in the
    sorted chunks: two launches, but the latency of a few rows spread over C times more SMs); margin: the
    threshold sample's margin in standard deviations (None: 5 for split rows, 4 for whole rows, see
    :attr:`sample_margin`); filter: the streaming kernel, "warp" (``_filter_kernel``: a lane's v entries of a
    tile spread over a warp's threads, ranks by warp scans, order keys per entry) or "thread"
    (``_filter_thread_kernel``: v = 1, one lane per thread (lanes = 32 * num_warps), unroll tiles per step,
    in-register ranks, two float compares per entry; with splits > 1 a ``_threshold_kernel`` samples each
    row's threshold once for its split programs); unroll: tiles per step of the "thread" filter (1 for
    "warp"); register_sort: the one-program sort of the k winners (order_chunks 1) loads them as a tile whose
    low sequence strides are a thread's registers (``_order_blocked_kernel``: fewer shuffles and shared-memory
    stages in the bitonic network, 126 instead of 168 registers at k 2048 on sm_90); sample_group: consecutive
    entries per group of the threshold sample (one group per equal slice of the row, at an offset that walks
    through the slices; see ``_sample_threshold``). Built by :meth:`SelectConfig.stream_for`, or by hand
    (tests, sweeps)."""

    splits: int
    cap: int
    lanes: int
    v: int
    tie_cap: int
    sample: int
    num_warps: int
    final_warps: int
    order_warps: int
    bins: int
    order_chunks: int = 1
    margin: float | None = None
    filter: str = "warp"
    unroll: int = 1
    register_sort: bool = False
    sample_group: int = 8

    def __post_init__(self):
        self.validate()

    @property
    def lane_cap(self) -> int:
        return self.cap // (self.splits * self.lanes)

    @property
    def block(self) -> int:
        """Entries per step of one filter program (also the tile of the exact whole-row passes)."""
        return self.lanes * self.v * self.unroll

    @property
    def sample_margin(self) -> float:
        """Margin of the sampled threshold in standard deviations: split rows (decode) 5 (with 4, and 32
        entries per lane, one row of a 256-row launch took the exact passes on the H200); whole rows 4 (5 sent
        8 of 8192 rows, not 1, to the exact passes: more candidates fill more lanes)."""
        if self.margin is not None:
            return self.margin
        return 5.0 if self.splits > 1 else 4.0

    def reads_directly(self, width: int) -> bool:
        """Whether rows of ``width`` entries fit the candidate buffer whole: then no threshold (no filter
        kernel) is needed and the final kernel reads the scores directly."""
        return self.splits == 1 and width <= self.cap

    def sort_chunks(self, k: int) -> int:
        """Programs per row of the sort of k winners: order_chunks, cut so each chunk keeps >= 16 entries."""
        return min(self.order_chunks, max(1, _next_pow2(k) // 16))

    def bytes_per_row(self, k: int) -> int:
        """Scratch bytes per row of :class:`SelectBuffers` with this config and k."""
        parts = self.splits * self.lanes
        return 8 * self.cap + 4 * parts * (self.tie_cap + 2) + 4 * self.splits * STREAM_STATS + 8 * k + 4

    def validate(self) -> None:
        for name in ("splits", "cap", "lanes", "v", "tie_cap", "sample", "bins"):
            value = getattr(self, name)
            check_power_of_two(name, value, message=f"{name} must be a power of two")
        if self.sample < 32 or self.bins < 32 or self.lane_cap < 1 or self.cap > MAX_SELECT_BLOCK \
                or self.block < 16 or self.splits * self.lanes * self.tie_cap > MAX_SELECT_BLOCK:
            raise ValueError(f"config out of range (sample >= 32, bins >= 32, cap <= 16384 and >= splits * lanes, "
                             f"lanes * v >= 16, splits * lanes * tie_cap <= 16384): {self}")
        oc = self.order_chunks
        check_power_of_two("order_chunks", oc, 1, 64)
        for name in ("num_warps", "final_warps", "order_warps"):
            value = getattr(self, name)
            check_power_of_two(name, value, 1, 32)
        check_float("margin", self.margin, positive=True, allow_none=True,
                    message="margin must be a positive number or None")
        check_choice("filter", self.filter, ("warp", "thread"))
        check_bool("register_sort", self.register_sort)
        check_power_of_two("unroll", self.unroll, 1, 64)
        check_power_of_two("sample_group", self.sample_group, 1, 32)  # <= 32 <= sample
        if self.filter == "thread" and self.v != 1:
            raise ValueError(f"the thread filter owns one entry per lane and tile: v must be 1, got {self.v}")
        if self.filter == "warp" and self.unroll != 1:
            raise ValueError(f"unroll applies to the thread filter only: got {self.unroll} with filter='warp'")


@dataclass(frozen=True)
class SelectConfig:
    """Select launch. algorithm: which select runs (see the field). Multi-pass radix select: block (elements
    per tile of the streaming passes), num_warps, bins (buckets of the narrowing histograms), cap (candidate
    buffer entries per row). None = the row-count rule of :meth:`resolve` (many rows -> prefill setting,
    few long rows -> decode setting). Streaming select: the ``stream_*`` fields are the table behind
    :meth:`stream_for` (the :class:`StreamConfig` of a launch over rows x width, k), ``stream`` fixes one
    StreamConfig for every launch instead, ``cached_bytes`` bounds its cached buffers per launch.
    visible_block: rows per program of the visible-count kernel. Every launcher of the top-k reads these;
    none derives a setting of its own."""

    block: int | None = None
    num_warps: int | None = None
    bins: int | None = None
    cap: int = 2048
    # "auto": the streaming select (dsakit.ops.indexer.select: one pass over the scores in the common
    # case) for k <= 4096, the multi-pass radix select above; "stream" / "multipass" force one (the knobs
    # above tune the multi-pass kernel only)
    algorithm: str = "auto"
    # measured on the H200 (benchmarks/results/indexer_h200_*.json): (block, warps, bins) for >= 512 rows
    # (prefill) and for fewer, long rows (decode: one program per row)
    many_rows: tuple[int, int, int] = (2048, 8, 128)
    few_rows: tuple[int, int, int] = (8192, 16, 64)
    # rows per program of the visible-count kernel that feeds the select its per-row entry counts
    visible_block: int = 256
    # --- the streaming select's launch rule (:meth:`stream_for`); ``stream`` set: that config for every launch
    stream: StreamConfig | None = None
    # rows below which a row is split over several programs (decode): a few programs per SM of the H200
    stream_target_programs: int = 512
    # entries per split program: below this the per-program sample and setup dominate
    stream_min_split: int = 8192
    stream_max_splits: int = 4
    # candidate entries per lane: lane counts are ~Poisson and the fullest of the row's splits * lanes lanes
    # must fit, or the row takes the exact whole-row passes (~0.5 ms for a 128K row on one SM). 64 per lane:
    # with 32 per lane and 4 splits one row of a 256-row decode launch overflowed on the H200
    # (vs_deepgemm_h200_165cbdd: select 0.73 ms instead of ~0.2); 64 costs 3-6 % in the common case
    stream_lane_entries: int = 64
    # (filter, final) warps; histogram buckets of the narrowing
    stream_warps: tuple[int, int] = (8, 8)
    stream_bins: int = 64
    # the sort of k winners: warps for >= 512 rows / fewer; programs per row for >= 1024 rows / fewer. The sort
    # of a few rows (decode) is latency bound on one program per row: 4 chunk sorts + a rank merge per row ran
    # 0.078 -> 0.060 ms at 64 x 65536 and 0.104 -> 0.079 ms at 64 x 131072, K 2048 (sweep_topk_h200_b4b4485);
    # at 8192 rows every SM is busy and the chunks gain nothing
    stream_order_warps: tuple[int, int] = (2, 4)
    stream_order_chunks: tuple[int, int] = (1, 4)
    # bound of the cached buffers of one launch (bytes): more rows than fit are selected in consecutive
    # launches over row slices (still no sync), so the select adds at most this much to a chunked index_topk
    cached_bytes: int = 256 << 20
    # the streaming filter (StreamConfig.filter): "warp" (one lane per warp, integer compares) or "thread" (one
    # lane per thread, float compares: ~23 instead of ~57 SASS instructions per entry in the sm_90 loop); one
    # name for every launch, or (filter for >= 512 rows, filter for fewer). H200 at 312c102, two rounds
    # (select_filters_h200_312c102.json): decode 64 x 131072 sorted 0.079 -> 0.066 ms, 64 x 65536 0.060 ->
    # 0.053 with "thread"; 8192 x 65536 3.45 (warp) against 3.62 (thread: its faster filter, 1.33 vs 1.46 ms,
    # feeds a slower final step). With "thread" a launch keeps the same candidate buffer and lanes of
    # stream_lane_entries each, one lane per thread: num_warps = lanes / 32 per split program, and
    # stream_thread_unroll tiles per step for >= 512 rows / fewer
    stream_filter: "str | tuple[str, str]" = ("warp", "thread")
    stream_thread_unroll: tuple[int, int] = (8, 32)
    # consecutive entries per group of the threshold sample (StreamConfig.sample_group). Scores come in runs of
    # similar values (a centred page's entries share its centre, neighbouring tokens resemble each other), so a
    # group counts as about one sample entry and the sample's margin holds only with many groups. 8 = one
    # 32-byte sector, the bytes of the former groups of 32. Rows whose 64-entry pages carry offsets of 1 / 3
    # standard deviations of the rest (benchmarks/select_sample_groups.py, 1000 rows per case, checked row
    # for row against the kernels under the interpreter) take the exact whole-row passes: decode 64 x 65536
    # 0 % / 0.4 % of rows (groups of 32: 2.9 % / 16 %, i.e. most 64-row calls waited for an exact row),
    # whole rows 8192 x 65536 with the warp filter 6.2 % / 30 % (was 23 % / 55 %), with the thread filter
    # 0.7 % / 3.5 % (11 % / 30 %). An exact row costs several passes on one SM (~0.5 ms for a 128K row)
    stream_sample_group: int = 8

    def __post_init__(self):
        check_choice("algorithm", self.algorithm, ("auto", "stream", "multipass"))
        filters = self.stream_filter if isinstance(self.stream_filter, tuple) else (self.stream_filter,)
        if len(filters) not in (1, 2) or (isinstance(self.stream_filter, tuple) and len(filters) != 2):
            raise ValueError(f"stream_filter must be 'warp', 'thread' or a (many rows, few rows) pair of them, "
                             f"got {self.stream_filter!r}")
        for name in filters:
            check_choice("stream_filter", name, ("warp", "thread"))
        check_power_of_two("stream_sample_group", self.stream_sample_group, 1, 32)
        for value in self.stream_thread_unroll:
            check_power_of_two("stream_thread_unroll", value, 1, 64)
        _power_of_two("block", self.block, 16, MAX_SELECT_BLOCK)
        _power_of_two("bins", self.bins, 32, 1024)
        _power_of_two("cap", self.cap, 32)
        check_int("num_warps", self.num_warps, 1, message="num_warps must be a positive int", allow_none=True)
        if self.stream is not None:
            check_instance("stream", self.stream, StreamConfig, label="StreamConfig or None")
        for name in ("visible_block", "stream_target_programs", "stream_min_split", "stream_max_splits",
                     "stream_lane_entries", "cached_bytes"):
            value = getattr(self, name)
            check_int(name, value, 1, message=f"{name} must be a positive int")

    def resolve(self, rows: int) -> tuple[int, int, int]:
        """(block, num_warps, bins) of the multi-pass select for a launch over ``rows`` rows."""
        block, warps, bins = self.many_rows if rows >= 512 else self.few_rows
        return self.block or block, self.num_warps or warps, self.bins or bins

    def uses_stream(self, k: int) -> bool:
        """Whether a select of k runs the streaming select (else the multi-pass radix select)."""
        return self.algorithm == "stream" or (self.algorithm == "auto" and k <= STREAM_MAX_K)

    def stream_for(self, rows: int, width: int, k: int) -> StreamConfig:
        """The streaming select's launch for ``rows`` rows of ``width`` entries and k (``stream`` when set)."""
        if self.stream is not None:
            return self.stream
        splits = 1
        if rows < self.stream_target_programs:
            splits = max(1, min(self.stream_max_splits, pow2_floor(2 * self.stream_target_programs // max(rows, 1)),
                                pow2_floor(width // self.stream_min_split)))
        cap = min(MAX_SELECT_BLOCK, max(4096, 4 * _next_pow2(k)))
        # about 128 sample entries per cap-sized slice of the row: the sample rank then has a relative
        # spread of ~1/sqrt(rank) small enough that overflow / underflow (exact fallback) stay rare
        sample = _next_pow2(-(-128 * width // cap))
        if splits > 1:
            # more lanes share the cap: a sample of ~64 entries per k-th of the row keeps the expected
            # candidates near 1.5 k (each lane ~Poisson(1.5 k / lanes) below its 32 entries)
            sample = max(sample, _next_pow2(-(-64 * width // k)))
        sample = min(8192, max(256, sample))
        lanes = max(16, min(128, cap // (splits * self.stream_lane_entries)))
        v = max(8, 1024 // lanes)
        # A lane's tie list must reach past its first tile: with TCAP >= 2 V a full list ends in the lane's
        # second tile, so the ties known complete cover >= splits + 1 tiles of the row (the relu case)
        tie_cap = max(32, 2 * v)
        many = rows >= 512
        num_warps, unroll = self.stream_warps[0], 1
        stream_filter = self.filter_for(rows)
        if stream_filter == "thread":
            # the same lanes per row as the warp filter, one per thread (32..256 per split program); with v = 1
            # the tie lists hold >= 32 entries and together about 2 k (the ties known complete cover >= 2 k
            # entries of a relu-zero row)
            lanes = min(256, max(32, lanes))
            num_warps, v, unroll = lanes // 32, 1, self.stream_thread_unroll[0 if many else 1]
            tie_cap = max(32, min(MAX_SELECT_BLOCK // (splits * lanes), _next_pow2(2 * k // (splits * lanes))))
        return StreamConfig(splits=splits, cap=cap, lanes=lanes, v=v, tie_cap=tie_cap, sample=sample,
                            num_warps=num_warps, final_warps=self.stream_warps[1],
                            order_warps=self.stream_order_warps[0 if many else 1], bins=self.stream_bins,
                            order_chunks=self.stream_order_chunks[0 if rows >= 1024 else 1],
                            filter=stream_filter, unroll=unroll, register_sort=True,
                            sample_group=self.stream_sample_group)

    def filter_for(self, rows: int) -> str:
        """The streaming filter ("warp" or "thread") of a launch over ``rows`` rows."""
        if isinstance(self.stream_filter, str):
            return self.stream_filter
        return self.stream_filter[0 if rows >= 512 else 1]

    @staticmethod
    def for_device(device: "torch.device | str | None" = None) -> "SelectConfig":
        """The measured select defaults of the GPU of ``device`` (those of :meth:`TopkConfig.for_device`)."""
        return TopkConfig.for_device(device).select


@dataclass(frozen=True)
class TopkConfig:
    """Tuning of ``index_topk`` on Triton: workspace_bytes bounds the fp32 score workspace of the chunked
    path (rows per chunk = workspace_bytes // (4 * W)); sort orders each row by (score desc, index asc)
    (False: the same set in a deterministic, unspecified order); scores / select: the kernels' launch
    configs."""

    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES
    sort: bool = True
    scores: ScoresConfig = field(default_factory=ScoresConfig)
    select: SelectConfig = field(default_factory=SelectConfig)

    def __post_init__(self):
        wb = self.workspace_bytes
        check_int("workspace_bytes", wb, 1, message="workspace_bytes must be a positive int")
        check_bool("sort", self.sort)
        check_instance("scores", self.scores, ScoresConfig)
        check_instance("select", self.select, SelectConfig)

    def chunk_rows(self, rows: int, columns: int) -> int:
        """Query rows per chunk: the fp32 workspace [chunk, columns] fits workspace_bytes."""
        return rows_per_chunk(rows, columns, self.workspace_bytes)

    @staticmethod
    def for_device(device: "torch.device | str | None" = None) -> "TopkConfig":
        """The measured defaults of the GPU of ``device`` (the H200 table for GPUs not measured yet)."""
        return TOPK_DEFAULTS[gpu_key(device, TOPK_DEFAULTS)]


TOPK_DEFAULTS: dict[str, TopkConfig] = {"H200": TopkConfig(), "default": TopkConfig()}

__all__ = ["ScoresConfig", "SCORES_DEFAULTS", "FormatLaunch", "Launch", "H200_FORMATS", "TopkConfig",
           "HierarchyConfig",
           "SelectConfig", "StreamConfig", "TOPK_DEFAULTS", "DEFAULT_WORKSPACE_BYTES", "MAX_SELECT_BLOCK", "MAX_K",
           "STREAM_MAX_K"]


#: Pages stage 1 keeps per top-k entry wanted, by default: m = HIERARCHY_PAGES_PER_K * ceil(k / 64) pages,
#: i.e. stage 2 scores 4 * k entries (recall lab, docs/hierarchy.md: mean IoU >= 0.99 against the flat top-k).
HIERARCHY_PAGES_PER_K = 4
#: Fewest pages stage 1 keeps by default (small k still gets a few pages of choice).
HIERARCHY_MIN_PAGES = 16


@dataclass(frozen=True)
class HierarchyConfig:
    """Which pages hierarchical top-k scores exactly (docs/hierarchy.md).

    Stage 1 scores one representative per fully visible page and keeps its best ``pages`` (None = the
    default ``max(HIERARCHY_MIN_PAGES, HIERARCHY_PAGES_PER_K * ceil(k / 64))``); the first ``first_pages``
    pages and the last ``recent_pages`` visible pages (the partial page included) are kept whatever their
    score. ``exact=True`` adds every page whose score bound reaches the k-th score found so far, so the result
    equals the flat top-k (costs the bound computation and one sync).
    """

    pages: int | None = None
    first_pages: int = 1
    recent_pages: int = 2
    exact: bool = False

    def __post_init__(self):
        if self.pages is not None:
            check_int("HierarchyConfig.pages", self.pages, 1, MAX_K)
        check_int("HierarchyConfig.first_pages", self.first_pages, 0, 1024)
        check_int("HierarchyConfig.recent_pages", self.recent_pages, 1, 1024,
                  message="HierarchyConfig.recent_pages must be an int in 1..1024 (the query's own last page is "
                          "always kept: it is the only partially visible one)")
        check_bool("HierarchyConfig.exact", self.exact)

    def pages_for(self, k: int) -> int:
        """m: the pages stage 1 keeps for a top-k of k."""
        if self.pages is not None:
            return self.pages
        return min(MAX_K, max(HIERARCHY_MIN_PAGES, HIERARCHY_PAGES_PER_K * -(-k // 64)))

    def width(self, k: int) -> int:
        """Most pages stage 2 scores per query (approximate mode)."""
        return self.pages_for(k) + self.first_pages + self.recent_pages
