"""The built-in experiment grids (data): ``bench --preset NAME``; :func:`.config.preset` builds them."""

from __future__ import annotations

__all__ = ["PRESETS", "SMOKE_PRESET", "OPTIONAL_PRESET_BACKENDS"]

PRESETS: dict[str, dict] = {
    # tiny sizes: runs on a CPU through the reference and the Triton interpreter in well under 2 min
    "smoke": dict(
        name="smoke",
        description="CPU smoke grid: tiny sizes, reference backends and (when registered) our Triton kernel, interpreted",
        masks=["full", "causal", "causal_document", "sliding_window_causal", "share_question"],
        seqlens=[160],
        heads=[(4, 2)],
        head_dims=[32],
        dtypes=["float32"],
        modes=["fwd", "bwd"],
        backends=["reference", "reference-chunked", "sdpa-math", "flex", "triton"],
        batch=1,
        seed=0,
        mask_params={"sliding_window_causal": {"window": "S//4"},
                     "causal_document": {"doc_lens": ["S//3", "S//4", "S - S//3 - S//4"]},
                     "share_question": {"doc_lens": ["S//4", "S//3", "S - S//4 - S//3"]}},
        warmup_ms=0.0,
        rep=3,
        max_ms=500.0,
        check=True,
    ),
    # block-sparse grids at interpreter sizes: two block sizes, one density, a pattern per KV head
    "smoke-sparse": dict(
        name="smoke-sparse",
        kind="sparse",
        description="CPU smoke grid for bench sparse: uniform blocks 16/32, density 0.5, tiny sizes, interpreted",
        masks=["block_sparse"],
        seqlens=[192],
        heads=[(4, 2)],
        head_dims=[32],
        dtypes=["float32"],
        modes=["fwd", "bwd"],
        backends=["reference", "triton-sparse", "triton-varblock", "flex"],
        batch=1,
        seed=0,
        mask_params={"block_sparse": {"block": [16, 32], "density": [0.5], "patterns": "Hkv"}},
        warmup_ms=0.0,
        rep=3,
        max_ms=500.0,
        check=True,
    ),
    "smoke-varblock": dict(
        name="smoke-varblock",
        kind="varblock",
        description="CPU smoke grid for bench varblock: mean blocks 32/48, density 0.5, tiny sizes, interpreted",
        masks=["varblock_sparse"],
        seqlens=[192],
        heads=[(4, 2)],
        head_dims=[32],
        dtypes=["float32"],
        modes=["fwd", "bwd"],
        backends=["reference", "triton-varblock", "flex"],
        batch=1,
        seed=0,
        mask_params={"varblock_sparse": {"block": [32, 48], "min_block": "block/2", "density": [0.5], "patterns": "Hkv"}},
        warmup_ms=0.0,
        rep=3,
        max_ms=500.0,
        check=True,
    ),
}

#: the CPU preset of each bench command
SMOKE_PRESET = {"dense": "smoke", "sparse": "smoke-sparse", "varblock": "smoke-varblock"}

#: backends a preset lists that may not be registered in every build (silently dropped if absent)
OPTIONAL_PRESET_BACKENDS = {"triton", "triton-sparse", "triton-varblock"}
