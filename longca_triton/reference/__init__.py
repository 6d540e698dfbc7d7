"""Plain-PyTorch references (imported as ``longca_triton.reference``)."""

from .chunked import chunk_mask, chunked_attention
from .naive import dense_head_mask, naive_attention

__all__ = ["chunk_mask", "chunked_attention", "dense_head_mask", "naive_attention"]
