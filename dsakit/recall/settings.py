"""What a recall sweep depends on and where it runs: the settings, seeded generators, the lab's device.

Every JSONL row of a sweep records its :class:`RecallSettings`; runs draw their randomness from
:func:`generator_for` (seeded by the run seed and labels, so results do not depend on loop order).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .._memory import check_bool, check_choice, check_instance, check_int, check_int_list, is_int
from ..formats import KeyFormat
from ..ops._backend import resolve_backend, triton_available
from ..ops.indexer.config import MAX_K, HierarchyConfig
from .faults import FAULTS
from .synthetic import SyntheticConfig

ALL_FORMATS = ("bf16", "fp8", "fp8-ue8m0", "fp4", "fp4-rne", "fp8-centred", "fp4-centred")
DEFAULT_FORMATS = ("bf16", "fp8", "fp4", "fp8-centred", "fp4-centred")
DEFAULT_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)

ProgressFn = Callable[[dict], None]


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# Peak memory of a synthetic haystack per context token: the compressor's token states (two [S, 2 D] fp32
# draws) and the pooling's intermediates, measured at 64 Ki tokens with D = 128 (about 8 KiB).
HAYSTACK_BYTES_PER_TOKEN = 8 << 10

# Largest magnitudes the synthetic haystack accepts (SyntheticConfig field -> bound). Far beyond any trained
# model (shared ratios of 10..1000, needles a few sigma strong), and the keys, scores and norms built from them
# stay finite in fp32 at these bounds in every format (tested); a flag like --shared-ratio 1e308 or
# --needle-strength 1e40 overflows to Inf / NaN and would record NaN rows.
SYNTHETIC_MAXIMA = {"shared_ratio": 1e6, "needle_strength": 1e6, "outlier_scale": 1e6, "query_noise": 1e6,
                    "head_weight_spread": 10.0}


def physical_memory_bytes() -> int | None:
    """Installed memory of this machine (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_haystack_fits(option: str, context_tokens: int, memory: int | None = None) -> None:
    """ValueError naming ``option`` and the size when a haystack of ``context_tokens`` cannot fit in memory
    (checked by RecallSettings, before any sweep: the allocator would otherwise fail mid-run)."""
    memory = physical_memory_bytes() if memory is None else memory
    need = context_tokens * HAYSTACK_BYTES_PER_TOKEN
    if memory is not None and need > memory:
        raise ValueError(f"{option} {context_tokens} tokens needs about {need / 2**30:.0f} GiB for the synthetic "
                         f"haystack, more than this machine's {memory / 2**30:.0f} GiB of memory")



@dataclass(frozen=True)
class RecallSettings:
    """Everything a recall sweep depends on (recorded with every JSONL row)."""

    config: SyntheticConfig = field(default_factory=SyntheticConfig)
    formats: tuple[str, ...] = DEFAULT_FORMATS
    topks: tuple[int, ...] = (512,)
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    depths: tuple[float, ...] = DEFAULT_DEPTHS
    trials: int = 1
    horizon: bool = True
    horizon_topks: tuple[int, ...] = (128, 256, 512, 1024)
    horizon_trials: int = 200
    horizon_quantile: float = 0.99
    horizon_min: int = 512
    horizon_max: int = 65536
    horizon_steps_per_octave: int = 4
    faults: tuple[str, ...] = tuple(FAULTS)
    fault_format: str = "bf16"
    fault_contexts: tuple[int, ...] = (4096, 16384)
    fault_depths: tuple[float, ...] = (0.0, 0.5, 1.0)
    fault_trials: int = 1
    seed: int = 0
    backend: str = "reference"
    # hierarchical selection (docs/hierarchy.md): the sweep's top-k op becomes hierarchical_topk
    hierarchy: bool = False
    hierarchy_pages: int | None = None  # m, the pages stage 1 keeps (None = HierarchyConfig's default rule)
    hierarchy_exact: bool = False  # the exact mode: equal to the flat top-k

    def __post_init__(self):
        check_instance("config", self.config, SyntheticConfig)
        for name, bound in SYNTHETIC_MAXIMA.items():
            value = getattr(self.config, name)
            if value > bound:
                raise ValueError(f"{name} {value!r} exceeds {bound:g}: beyond it the synthetic keys and scores "
                                 f"overflow fp32 (Inf / NaN), so the runs would measure nothing")
        for name in ("formats", "topks", "contexts", "depths", "horizon_topks", "faults", "fault_contexts",
                     "fault_depths"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):  # "bf16" is not a list of names
                raise ValueError(f"{name} must be a sequence (tuple or list), got {value!r}")
            object.__setattr__(self, name, tuple(value))  # frozen: stored as tuples, hashable and JSON-ready
        for name in self.formats + (self.fault_format,):
            KeyFormat.parse(name)
        if not self.formats:
            raise ValueError("formats must name at least one key format")
        for what, ks in (("topks", self.topks), ("horizon_topks", self.horizon_topks)):
            check_int_list(what, ks, 1, message=f"{what} must be positive ints")  # MAX_K: every top-k op's limit
            if not ks or max(ks) > MAX_K:
                raise ValueError(f"{what} must be positive ints <= {MAX_K}, got {ks!r}")
        ratio = self.config.ratio
        for what, ctxs in (("contexts", self.contexts), ("fault_contexts", self.fault_contexts)):
            for c in ctxs:
                if not is_int(c) or c < ratio or c % ratio or c < self.config.query_tokens:
                    raise ValueError(f"{what}: context {c!r} must be a positive multiple of the compression "
                                     f"ratio {ratio} and at least query_tokens={self.config.query_tokens}")
        for what, ds in (("depths", self.depths), ("fault_depths", self.fault_depths)):
            for d in ds:
                if not _is_number(d) or not 0.0 <= d <= 1.0:
                    raise ValueError(f"{what}: depth {d!r} must be a number in [0, 1]")
        for what, n in (("trials", self.trials), ("horizon_trials", self.horizon_trials),
                        ("fault_trials", self.fault_trials), ("horizon_steps_per_octave", self.horizon_steps_per_octave)):
            check_int(what, n, 1, message=f"{what} must be a positive int")
        if not _is_number(self.horizon_quantile) or not 0.0 < self.horizon_quantile <= 1.0:
            raise ValueError(f"horizon_quantile must be in (0, 1], got {self.horizon_quantile!r}")
        if not (is_int(self.horizon_min) and is_int(self.horizon_max)
                and ratio <= self.horizon_min <= self.horizon_max):
            raise ValueError(f"need ratio <= horizon_min <= horizon_max, got {self.horizon_min!r}, {self.horizon_max!r}")
        check_int("seed", self.seed)
        check_bool("hierarchy", self.hierarchy)
        check_bool("hierarchy_exact", self.hierarchy_exact)
        if not self.hierarchy and (self.hierarchy_pages is not None or self.hierarchy_exact):
            raise ValueError("hierarchy_pages / hierarchy_exact set without hierarchy=True (--hierarchy): they "
                             "would change nothing")
        self.hierarchy_config()  # checks hierarchy_pages
        for name in self.faults:
            check_choice("fault", name, sorted(FAULTS))
        resolved_backend(self.backend)  # 'triton' on a machine that cannot run it fails here, not mid-sweep
        check_haystack_fits("contexts", max(self.contexts))
        if self.faults:
            check_haystack_fits("fault_contexts", max(self.fault_contexts))
        if self.horizon:
            check_haystack_fits("horizon_max", self.horizon_max)

    def hierarchy_config(self) -> HierarchyConfig | None:
        """The sweep's :class:`HierarchyConfig` (None: the flat ``index_topk``)."""
        if not self.hierarchy:
            return None
        return HierarchyConfig(pages=self.hierarchy_pages, exact=self.hierarchy_exact)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["config"] = self.config.as_dict()
        return d


def generator_for(seed: int, *labels) -> torch.Generator:
    """A CPU torch.Generator seeded from the run seed and labels (independent of loop order and formats)."""
    text = "/".join(str(x) for x in (seed,) + labels)
    return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1)


def rope_table(settings: RecallSettings, max_context: int) -> torch.Tensor:
    return settings.config.geometry.rope.cos_sin_table(max_context + 1)


def lab_device(backend: str) -> torch.device:
    """Where caches and queries live: CUDA for Triton on a GPU, the CPU otherwise (TRITON_INTERPRET=1 too)."""
    resolve_backend(backend)  # validates the name
    if backend in ("triton", "auto") and torch.cuda.is_available() and triton_available():
        return torch.device("cuda")
    return torch.device("cpu")


def resolved_backend(backend: str) -> str:
    """'reference' | 'triton': what ``backend`` runs as on the lab's device; ValueError if it cannot run there
    (``triton`` without CUDA and without TRITON_INTERPRET=1)."""
    return resolve_backend(backend, torch.empty(0, device=lab_device(backend)))


def op_backends(backend: str) -> dict[str, str]:
    """Which implementation each op used, for the records ('auto' resolved for the lab's device)."""
    used = resolved_backend(backend)
    return {name: used for name in ("store_index_keys", "index_scores", "index_topk")}
