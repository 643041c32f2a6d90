"""The recall lab: needle sweeps, the recall horizon and fault rows through dsakit's own ops.

>>> from dsakit.recall import RecallSettings, SyntheticConfig, run_sweep, recall_horizon
>>> settings = RecallSettings(formats=("bf16", "fp8"), contexts=(4096,), depths=(0.5,), horizon=False, faults=())
>>> runs = run_sweep(settings)          # one dict per (context, depth, trial, format, top-k)

See docs/recall.md for the model behind the synthetic data, the metrics and the file formats.
"""

from .captured import (CapturedTensors, capture_deepseek_v4_indexer, load_captured, run_captured,
                       save_captured)
from .faults import FAULTS, Fault, parse_faults
from .haystack import StoredHaystack
from .horizon import horizon_grid, recall_horizon
from .metrics import (needle_rank, needle_score_ratio, score_margin, set_recall, topk_contains)
from .settings import ALL_FORMATS, DEFAULT_FORMATS, RecallSettings
from .sweep import run_faults, run_sweep
from .synthetic import SyntheticConfig, make_haystack, place_needle

__all__ = ["CapturedTensors", "capture_deepseek_v4_indexer", "load_captured", "run_captured", "save_captured",
           "FAULTS", "Fault", "parse_faults", "ALL_FORMATS", "DEFAULT_FORMATS", "RecallSettings", "StoredHaystack",
           "horizon_grid", "recall_horizon", "run_faults", "run_sweep", "needle_rank", "needle_score_ratio",
           "score_margin", "set_recall", "topk_contains", "SyntheticConfig", "make_haystack", "place_needle"]
