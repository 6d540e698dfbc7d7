"""Dense structured-mask attention in Gluon, warp-specialized for sm_90 (Hopper): ``gluon_attention``
and its launch config (``config.resolve_config``, the shipped table ``kernels/tuning/gluon.toml``)."""

from longca_triton.kernels.gluon.config import CONFIG_KEYS, device_reason, resolve_config
from longca_triton.kernels.gluon.op import gluon_attention

__all__ = ["CONFIG_KEYS", "device_reason", "gluon_attention", "resolve_config"]
