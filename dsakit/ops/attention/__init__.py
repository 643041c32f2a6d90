from .reference import sparse_attention, window_topk_indices

__all__ = ["sparse_attention", "window_topk_indices"]
