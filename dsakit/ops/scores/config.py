"""Launch configuration of the Triton scores kernels: :class:`ScoresConfig` and its per-GPU defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..._memory import check_int, check_power_of_two
from .._tuning import gpu_key

KERNELS = ("auto", "tile", "group")
DECODE_FP4 = ("blocks", "dequant")
DECODE_LOADS = ("gather", "tma")
PREFILL_KERNELS = ("triton", "gluon", "auto")
# (key tile, warps) of the Gluon prefill kernel, compiled for sm_90 with asynchronous wgmma and no spills at the
# V4 shape (H 64, tests/test_scores_gluon.py): (128, 8) two warpgroups side by side (128 registers: two programs
# per SM), the default; (128, 4) one warpgroup on the whole tile (255 registers; it spills at other head counts,
# with q_scale or with 3 q buffers); (64, 4) and (64, 8) half the key tile (q gathered twice as often)
GLUON_TILES = ((128, 8), (128, 4), (64, 4), (64, 8))
GLUON_STAGES = (3, 4, 5, 6)  # q buffers: 32 KB of keys + 16 KB per buffer (<= 128 KB of the 227 KB of an SM)
GLUON_MAX_BLOCK_T = 64  # the Gluon kernel's query tile (one wgmma M); plans' shorter tiles are padded to it


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
    """Tuning of :func:`dsakit.ops.scores.triton.index_scores_triton` (all compile-time launch choices).

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
    prefill_kernel: the kernel of tile plans (prefill) for bf16 keys: "triton" (default: the portable tile
    kernel) or "gluon" (sm_90 only: the Gluon kernel whose per-head dots are asynchronous wgmma overlapped with
    the previous head's relu-and-weight epilogue; :func:`dsakit.ops.scores.triton.choose_prefill_kernel`
    refuses it with a ValueError where it cannot run: not an sm_90 GPU, no Gluon, the interpreter, other key
    formats) or "auto" (the Gluon kernel exactly where it can run, the Triton kernel elsewhere: the value a
    per-GPU table takes once the H200 has timed it). Its key tile is prefill_block_n (64 or 128); "gluon" needs
    prefill_block_t <= 64 ("auto" runs the Triton kernel on larger tiles);
    prefill_gluon_warps / prefill_gluon_stages: its warps (one or two warpgroups, :data:`GLUON_TILES`) and q
    buffers (q of head h + stages - 2 is gathered while head h is scored; 4 buffers and 8 warps: 96 KB of
    shared memory and 128 registers, two programs per SM).
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
    prefill_kernel: str = "triton"
    prefill_gluon_warps: int = 8
    prefill_gluon_stages: int = 4
    formats: tuple[tuple[str, FormatLaunch], ...] = field(default=H200_FORMATS, repr=False)

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be 'auto', 'tile' or 'group', got {self.kernel!r}")
        if self.decode_fp4 not in DECODE_FP4:
            raise ValueError(f"decode_fp4 must be 'blocks' or 'dequant', got {self.decode_fp4!r}")
        if self.prefill_kernel not in PREFILL_KERNELS:
            raise ValueError(f"prefill_kernel must be 'triton', 'gluon' or 'auto', got {self.prefill_kernel!r}")
        if self.prefill_gluon_stages not in GLUON_STAGES or isinstance(self.prefill_gluon_stages, bool):
            raise ValueError(f"prefill_gluon_stages must be one of {GLUON_STAGES}, got {self.prefill_gluon_stages!r}")
        if self.prefill_gluon_warps not in (4, 8) or isinstance(self.prefill_gluon_warps, bool):
            raise ValueError(f"prefill_gluon_warps must be 4 or 8, got {self.prefill_gluon_warps!r}")
        if self.decode_loads not in DECODE_LOADS:
            raise ValueError(f"decode_loads must be 'gather' or 'tma', got {self.decode_loads!r}")
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

        gluon = self.prefill_kernel
        if gluon != "triton" and (self.prefill_block_n, self.prefill_gluon_warps) not in GLUON_TILES:
            raise ValueError(f"prefill_kernel={gluon!r} takes (prefill_block_n, prefill_gluon_warps) in "
                             f"{GLUON_TILES}, got ({self.prefill_block_n}, {self.prefill_gluon_warps})")
        if gluon == "gluon" and self.prefill_block_t > GLUON_MAX_BLOCK_T:
            raise ValueError(f"prefill_kernel='gluon' needs prefill_block_t <= {GLUON_MAX_BLOCK_T} (its query tile), "
                             f"got {self.prefill_block_t}")
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

    def gluon_launch(self) -> Launch:
        """The Gluon prefill kernel (``prefill_kernel="gluon"``): BLOCK_N = prefill_block_n, warps =
        prefill_gluon_warps, stages = prefill_gluon_stages (q buffers; no register cap)."""
        return Launch(self.prefill_block_n, 1, self.prefill_gluon_warps, self.prefill_gluon_stages)

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

__all__ = ["ScoresConfig", "SCORES_DEFAULTS", "FormatLaunch", "Launch", "H200_FORMATS", "PREFILL_KERNELS",
           "GLUON_TILES"]
