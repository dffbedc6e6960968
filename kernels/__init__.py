"""ptx_kernels: attention kernels (Pallas for TPU/GPU) and pure-JAX references.

Installed from the folder `kernels/` under the import name `ptx_kernels`
(PyPI's `kernels` is another project). Depends on jax only; never imports ptx.

Layout everywhere: q [B, T, H, D], k/v [B, S, KV, D] with H a multiple of KV
(head h reads kv head h // (H // KV)); every function returns (out, lse) with a
natural-log lse [B, H, T] in float32, but cudnn_attention and splash_attention
(out only).
"""

from ptx_kernels.block_sizes import BlockSizes
from ptx_kernels.cudnn import cudnn_attention
from ptx_kernels.decode import decode_attention
from ptx_kernels.dense import dense_attention
from ptx_kernels.flash import flash_attention
from ptx_kernels.implementation import default_tiles
from ptx_kernels.lse import merge_lse
from ptx_kernels.lse import with_sinks
from ptx_kernels.paged import paged_attention
from ptx_kernels.reference import reference_attention
from ptx_kernels.ring import from_zigzag
from ptx_kernels.ring import ring_attention
from ptx_kernels.ring import to_zigzag
from ptx_kernels.splash import splash_attention

__all__ = [
    "BlockSizes",
    "cudnn_attention",
    "decode_attention",
    "default_tiles",
    "dense_attention",
    "flash_attention",
    "from_zigzag",
    "merge_lse",
    "paged_attention",
    "reference_attention",
    "ring_attention",
    "splash_attention",
    "to_zigzag",
    "with_sinks",
]
