"""The built-in experiment grids (data): ``bench --preset NAME``; :func:`.config.preset` builds them."""

from __future__ import annotations

__all__ = ["PRESETS", "SMOKE_PRESET", "OPTIONAL_PRESET_BACKENDS"]

#: what every CPU smoke grid shares: tiny sizes, float32 (the interpreter's bf16 dot is unusable),
#: both passes, a short timing and the correctness check
_SMOKE = dict(heads=[(4, 2)], head_dims=[32], dtypes=["float32"], modes=["fwd", "bwd"], batch=1, seed=0,
              warmup_ms=0.0, rep=3, max_ms=500.0, check=True)



def _sparse_smoke(kind: str, blocks: str, backends: list, mask_params: dict) -> dict:
    """A CPU smoke grid for ``bench sparse`` / ``bench varblock`` (S = 192, density 0.5)."""
    return dict(_SMOKE, name=f"smoke-{kind}", kind=kind, masks=list(mask_params), seqlens=[192], backends=backends,
                description=f"CPU smoke grid for bench {kind}: {blocks}, density 0.5, tiny sizes, interpreted",
                mask_params=mask_params)


PRESETS: dict[str, dict] = {
    # tiny sizes: runs on a CPU through the reference and the Triton interpreter in well under 2 min
    "smoke": dict(
        _SMOKE,
        name="smoke",
        description="CPU smoke grid: tiny sizes, reference backends and (when registered) our Triton kernel, interpreted",
        masks=["full", "causal", "causal_document", "sliding_window_causal", "share_question"],
        seqlens=[160],
        backends=["reference", "reference-chunked", "sdpa-math", "flex", "triton"],
        mask_params={"sliding_window_causal": {"window": "S//4"},
                     "causal_document": {"doc_lens": ["S//3", "S//4", "S - S//3 - S//4"]},
                     "share_question": {"doc_lens": ["S//4", "S//3", "S - S//4 - S//3"]}},
    ),
    # block-sparse grids at interpreter sizes: two block sizes, one density, a pattern per KV head
    "smoke-sparse": _sparse_smoke(
        "sparse", "uniform blocks 16/32", ["reference", "triton-sparse", "triton-varblock", "flex"],
        {"block_sparse": {"block": [16, 32], "density": [0.5], "patterns": "Hkv"}}),
    "smoke-varblock": _sparse_smoke(
        "varblock", "mean blocks 32/48", ["reference", "triton-varblock", "flex"],
        {"varblock_sparse": {"block": [32, 48], "min_block": "block/2", "density": [0.5], "patterns": "Hkv"}}),
}

#: the CPU preset of each bench command
SMOKE_PRESET = {"dense": "smoke", "sparse": "smoke-sparse", "varblock": "smoke-varblock"}

#: backends a preset lists that may not be registered in every build (silently dropped if absent)
OPTIONAL_PRESET_BACKENDS = {"triton", "triton-sparse", "triton-varblock"}
