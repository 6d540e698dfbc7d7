"""Gluon kernels (``triton.experimental.gluon``): explicit warp specialization, async wgmma,
TMA and mbarriers on sm_90. They cannot run in Triton's CPU interpreter; the plain-Triton kernels
one directory up stay the CPU-tested baseline. See ``attention_fwd.py`` for the design."""
