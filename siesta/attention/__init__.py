"""Paged attention: the metadata every backend reads, a torch reference, Triton kernels."""

from siesta.attention.base import AttentionBackend, AttentionMetadata, KVCache
from siesta.attention.select import get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "KVCache", "get_attention_backend"]
