"""Context-parallel indexer prefill on ``torch.distributed`` (NCCL on GPUs, gloo on the CPU).

Long prefills are split over the ranks of a process group by QUERY token, not by key: at 1M tokens the
compressed index keys are 262,144 entries (35 MB in fp8, 67 MB in bf16) while scoring them is petaflops.

1. :class:`ContextParallelPlan` ``.zigzag(query_seq)``: which query rows each rank owns, balanced for the
   causal mask (each sequence cut into 2 * world chunks, rank r takes chunks r and 2 * world - 1 - r).
2. Each rank stores the index-key entries it produced into its own paged pool (same page allocation on
   every rank), then :func:`all_gather_pages` (whole pages, any format) or :func:`all_gather_entries`
   (any split of the entries, formats without per-page data) copies them into every rank's pool.
3. :func:`context_parallel_index_topk` runs the ordinary top-k on the rank's rows (identical rows to the
   single-device result) and, with ``gather=True``, :func:`gather_rows` returns the full [T, k].

After the prefill every rank holds the full cache, so decode runs on any one rank with the ordinary ops.
See docs/distributed.md.
"""

from .exchange import CommStats, all_gather_entries, all_gather_pages, comm_device, gather_rows
from .split import ContextParallelPlan, zigzag_owner, zigzag_ranges
from .topk import context_parallel_index_topk

__all__ = ["ContextParallelPlan", "zigzag_ranges", "zigzag_owner", "all_gather_entries", "all_gather_pages",
           "gather_rows", "comm_device", "CommStats", "context_parallel_index_topk"]
