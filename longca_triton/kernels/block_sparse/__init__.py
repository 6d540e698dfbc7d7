"""Block-sparse attention (uniform and variable blocks): the public API."""

from longca_triton.kernels.block_sparse.config import CONFIG_KEYS, default_config, resolve_config, tile_sizes
from longca_triton.kernels.block_sparse.op import (
    BlockSparseAttentionFunction,
    block_sparse_attention,
    block_sparse_attention_from_tables,
    block_sparse_attention_op,
    block_sparse_bwd,
    block_sparse_fwd,
    table_build_time,
    tables_for,
    varblock_attention,
)

__all__ = ["CONFIG_KEYS", "BlockSparseAttentionFunction", "block_sparse_attention", "block_sparse_attention_from_tables",
           "block_sparse_attention_op", "block_sparse_bwd", "block_sparse_fwd", "default_config", "resolve_config",
           "table_build_time", "tables_for", "tile_sizes", "varblock_attention"]
