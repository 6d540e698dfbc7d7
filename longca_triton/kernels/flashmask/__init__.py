"""FlashMask's column-interval masking, ported onto our Triton tiling: ``flashmask_attention``.

``op`` holds the launchers, the config (the dense family's, ``kernels/tuning/dense.toml``) and the public
function; ``fwd`` / ``bwd`` the kernels and the tile classification; ``plan`` the columns and tile bounds.
"""

from longca_triton.kernels.flashmask.op import (
    CONFIG_KEYS,
    EMPTY,
    FULL,
    PARTIAL,
    FlashMaskAttentionFunction,
    FlashMaskPlan,
    classify_tiles,
    flashmask_attention,
    flashmask_bwd,
    flashmask_fwd,
    flashmask_plan,
    resolve_config,
    tile_bounds,
)

__all__ = [
    "CONFIG_KEYS", "EMPTY", "FULL", "PARTIAL", "FlashMaskAttentionFunction", "FlashMaskPlan", "classify_tiles",
    "flashmask_attention", "flashmask_bwd", "flashmask_fwd", "flashmask_plan", "resolve_config", "tile_bounds",
]
