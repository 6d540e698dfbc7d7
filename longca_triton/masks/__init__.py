"""The mask IR shared by our kernels and every vendor adapter (docs/masks.md is the normative spec)."""

from .generators import MASK_NAMES, MASK_PARAMETERS, MASK_SPECS, STATIC_MASK_NAMES, aligned_block_bounds, histogram_for, load_histogram, make_mask, sample_doc_lengths
from .construct import block_diagonal, from_cu_seqlens, from_dense, from_mask_mod, from_row_intervals, window_mask
from .ir import FLOP_MODES, BlockSparseMask, BlockTables, Mask, RangeMask, SliceKind, merge_intervals
from .lowerings import (
    FlashMaskColumns,
    NotExpressible,
    VarlenForm,
    flashmask_columns,
    flex_block_mask,
    flex_mask_mod,
    varlen_form,
)

__all__ = [
    "MASK_NAMES",
    "MASK_PARAMETERS",
    "MASK_SPECS",
    "STATIC_MASK_NAMES",
    "aligned_block_bounds",
    "FLOP_MODES",
    "BlockSparseMask",
    "BlockTables",
    "FlashMaskColumns",
    "Mask",
    "NotExpressible",
    "RangeMask",
    "SliceKind",
    "VarlenForm",
    "block_diagonal",
    "flashmask_columns",
    "flex_block_mask",
    "flex_mask_mod",
    "from_cu_seqlens",
    "from_dense",
    "from_mask_mod",
    "from_row_intervals",
    "histogram_for",
    "load_histogram",
    "make_mask",
    "merge_intervals",
    "sample_doc_lengths",
    "varlen_form",
    "window_mask",
]
