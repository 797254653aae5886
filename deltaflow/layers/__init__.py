"""deltaflow.layers: token mixers and building blocks for models.

- :class:`DeltaAttention`: the delta-rule mixer for every step rule (DeltaNet, Gated DeltaNet,
  EFLA, Longhorn, Kaczmarz, ...).
- :class:`SoftmaxAttention`: softmax attention baseline (RoPE, GQA, KV cache, sliding window).
- :class:`ShortConvolution`, :class:`RMSNorm`, :func:`l2_normalize`, :class:`DeltaFlowCache`.
- ``short_conv_triton``: the short conv as Triton kernels (custom ops), used where
  ``conv.TRITON_SHORT_CONV`` is on (off by default).

Every mixer has the same call: ``y, state = mixer(x, attention_mask=None, state=None,
use_cache=False)``.
"""

from deltaflow.layers.cache import DeltaFlowCache
from deltaflow.layers.conv import ShortConvolution
from deltaflow.layers.delta_attention import DeltaAttention, default_qk_norm
from deltaflow.layers.mask import prepare_padding_mask
from deltaflow.layers.norm import RMSNorm, l2_normalize
from deltaflow.layers.softmax_attention import SoftmaxAttention, apply_rope

__all__ = [
    "DeltaAttention",
    "SoftmaxAttention",
    "ShortConvolution",
    "RMSNorm",
    "l2_normalize",
    "DeltaFlowCache",
    "default_qk_norm",
    "prepare_padding_mask",
    "apply_rope",
]
