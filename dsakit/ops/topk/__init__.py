from .reference import index_topk, select_topk, topk_to_slots

__all__ = ["index_topk", "select_topk", "topk_to_slots"]
