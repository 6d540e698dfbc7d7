"""longca-triton: a pure-Triton laboratory for long-context attention.

>>> import torch, longca_triton as lt
>>> mask = lt.make_mask("causal_document", 4096, seed=0)
>>> q = torch.randn(1, 4096, 8, 64); k = v = torch.randn(1, 4096, 2, 64)
>>> out = lt.attention(q, k, v, mask, backend="reference")
"""

from .masks import MASK_NAMES, BlockSparseMask, RangeMask, SliceKind, make_mask
from .api import attention
from .flash_api import flash_attn_func, flash_attn_varlen_func

__version__ = "0.1.0"

__all__ = ["MASK_NAMES", "BlockSparseMask", "RangeMask", "SliceKind", "attention", "flash_attn_func",
           "flash_attn_varlen_func", "make_mask", "__version__"]
