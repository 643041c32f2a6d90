from .reference import index_scores, index_scores_dense

__all__ = ["index_scores", "index_scores_dense"]
