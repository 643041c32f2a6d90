from .reference import prepare_attention_kv, prepare_index_keys, store_attention_kv, store_index_keys

__all__ = ["store_index_keys", "store_attention_kv", "prepare_index_keys", "prepare_attention_kv"]
