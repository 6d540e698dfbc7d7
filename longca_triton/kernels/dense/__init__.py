"""Dense attention under structured (range) masks in plain Triton: ``dense_attention`` and its pieces.

``op`` holds the launchers, configs and public functions; ``fwd`` / ``bwd`` the kernels; ``plan`` the
tile plans; ``tune`` the autotune search space. What other families build on is public here:
``plans_for`` / ``TilePlan`` / ``get_tile_plan``, ``check_plan``, ``launch_bwd_preprocess``,
``launch_bwd_dkdv``, ``dense_bwd``, ``resolve_config`` / ``CONFIG_KEYS`` / ``CONFIG_SPEC`` (FlashMask
resolves its config there), ``DKDV_TILE_KEYS``, ``DQ_NUM_WARPS`` and ``check_deterministic``.
"""

from longca_triton.kernels.dense.op import (
    CONFIG_KEYS,
    CONFIG_SPEC,
    DKDV_TILE_KEYS,
    DQ_NUM_WARPS,
    DenseAttentionFunction,
    check_deterministic,
    check_plan,
    default_config,
    dense_attention,
    dense_attention_from_plans,
    dense_attention_op,
    dense_bwd,
    dense_fwd,
    launch_bwd_dkdv,
    launch_bwd_dq,
    launch_bwd_preprocess,
    mask_kind,
    plans_for,
    resolve_config,
    table_dim,
)
from longca_triton.kernels.dense.plan import TilePlan, get_tile_plan

__all__ = [
    "CONFIG_KEYS", "CONFIG_SPEC", "DKDV_TILE_KEYS", "DQ_NUM_WARPS", "DenseAttentionFunction", "TilePlan",
    "check_deterministic", "check_plan", "default_config", "dense_attention", "dense_attention_from_plans",
    "dense_attention_op", "dense_bwd", "dense_fwd", "get_tile_plan", "launch_bwd_dkdv", "launch_bwd_dq",
    "launch_bwd_preprocess", "mask_kind", "plans_for", "resolve_config", "table_dim",
]
