"""Using our kernels where models are trained: ``torch.compile`` and HuggingFace transformers.

* :func:`compiled_attention` and :func:`mask_tensor` (``ops.py``): attention through the
  ``longca_triton::attention`` custom op, whose mask is a tensor, so a compiled model neither breaks
  its graph nor recompiles when the documents change;
* ``longca_triton.integrations.transformers.register()``: ``attn_implementation="longca_triton"``
  for transformers models (causal, padded, packed and sliding-window attention, GQA), falling back
  to transformers' SDPA with a logged reason where our kernels cannot run the call.
"""

from .ops import compiled_attention, mask_from_tensor, mask_tensor

__all__ = ["compiled_attention", "mask_from_tensor", "mask_tensor"]
