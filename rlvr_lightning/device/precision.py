"""Mixed precision that casts each weight once per block of work, not once per matmul.

Lightning's ``bf16-mixed``/``16-mixed`` run every step inside ``torch.autocast(...,
cache_enabled=False)``, so each matmul casts its fp32 weight to the low-precision dtype again:
once per decoding step in generation, once per micro-batch in the update. Inside
:func:`weights_cast_once` autocast keeps the cast copy of every trainable weight and reuses it.
The copies are valid only while the weights do not change, so a block never spans an optimiser
step, and the cache is cleared when it ends. On the CPU the same block lets no-grad products use
weights packed once for oneDNN (``cpu_linear.packed_weights``), where measured faster.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from rlvr_lightning.device import cpu_linear


@contextmanager
def weights_cast_once(device_type: str) -> Iterator[None]:
    """Within: an active autocast on ``device_type`` reuses each weight's cast copy (autocast's
    cache holds leaf tensors that require grad, i.e. the trainable weights). Without an active
    autocast nothing changes. The weights must not be modified inside the block."""
    if not torch.is_autocast_enabled(device_type):
        yield
        return
    dtype = torch.get_autocast_dtype(device_type)
    try:
        with (
            torch.autocast(device_type, dtype=dtype, cache_enabled=True),
            cpu_linear.packed_weights(dtype),
        ):
            yield
    finally:
        torch.clear_autocast_cache()  # a nested autocast keeps its cache on exit
