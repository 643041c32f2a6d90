"""Tuning of the Triton top-k: :class:`SelectConfig` (which select runs and how it is launched),
:class:`StreamConfig` (one launch of the streaming select), :class:`TopkConfig` (the fused scores + select of
``index_topk``), with per-GPU defaults. Every launch setting of the top-k kernels is decided here; the
launchers only read it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..._memory import check_bool, check_choice, check_float, check_instance, check_int, check_power_of_two
from .._tuning import gpu_key
from ..scores.config import ScoresConfig

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
    # "auto": the streaming select (dsakit.ops.topk._select_stream: one pass over the scores in the common
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
    # the one-program sort of the k winners (>= 1024 rows; fewer rows use order chunks) with its low strides in
    # registers (StreamConfig.register_sort): 1,344 instead of 2,496 shuffles, 72 instead of 256 shared-memory
    # stores per thread in the sm_90 SASS at k 2048; H200, 8192 x 65536 sorted, two rounds each: after the
    # thread filter 3.62 -> 3.19 ms (312c102), after the warp filter 3.46 -> 3.03 (b1556ae)
    stream_register_sort: bool = True
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
        check_bool("stream_register_sort", self.stream_register_sort)
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
                            filter=stream_filter, unroll=unroll, register_sort=self.stream_register_sort,
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
    (False: the same set in a deterministic, unspecified order); overlap: on CUDA, when the rows need
    several chunks, select chunk i on a second (high-priority) stream while chunk i + 1 is scored, ping-ponging
    two workspaces of workspace_bytes / 2 each (rows per chunk = (workspace_bytes // 2) // (4 * W)), so the
    score workspace still totals workspace_bytes; the same indices as overlap=False (with sort=False the same
    set per row, its order may follow the smaller chunks); ignored on one chunk and off CUDA; off by default:
    on the H200 the scores kernel keeps every SM busy and a select program does not fit beside it, so the
    two streams ran no faster than one (T 8192 x N 65536: fp8 13.3 vs 13.1 ms, bf16 19.1 vs 18.8 ms);
    scores / select: the kernels' launch configs."""

    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES
    sort: bool = True
    overlap: bool = False
    scores: ScoresConfig = field(default_factory=ScoresConfig)
    select: SelectConfig = field(default_factory=SelectConfig)

    def __post_init__(self):
        wb = self.workspace_bytes
        check_int("workspace_bytes", wb, 1, message="workspace_bytes must be a positive int")
        check_bool("sort", self.sort)
        check_bool("overlap", self.overlap)
        check_instance("scores", self.scores, ScoresConfig)
        check_instance("select", self.select, SelectConfig)

    def overlaps(self, rows: int, columns: int) -> bool:
        """Whether ``overlap`` applies to ``rows`` query rows over a workspace of ``columns``: they need
        several chunks (on CUDA; the launcher checks the device)."""
        return self.overlap and rows_per_chunk(rows, columns, self.workspace_bytes) < rows

    def chunk_rows(self, rows: int, columns: int, overlap: bool) -> int:
        """Query rows per chunk: the fp32 workspace [chunk, columns] fits workspace_bytes, or half of it for
        each of the two workspaces of an overlapped launch."""
        return rows_per_chunk(rows, columns, self.workspace_bytes // 2 if overlap else self.workspace_bytes)

    @staticmethod
    def for_device(device: "torch.device | str | None" = None) -> "TopkConfig":
        """The measured defaults of the GPU of ``device`` (the H200 table for GPUs not measured yet)."""
        return TOPK_DEFAULTS[gpu_key(device, TOPK_DEFAULTS)]


TOPK_DEFAULTS: dict[str, TopkConfig] = {"H200": TopkConfig(), "default": TopkConfig()}

__all__ = ["TopkConfig", "SelectConfig", "StreamConfig", "TOPK_DEFAULTS", "DEFAULT_WORKSPACE_BYTES",
           "MAX_SELECT_BLOCK", "MAX_K", "STREAM_MAX_K"]


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
