"""Fused per-hop attention kernels (Pallas) behind :func:`cpjax.ring_attention`.

:mod:`~cpjax.kernels.common` holds the tile math and the per-hop schedule,
:mod:`~cpjax.kernels.tpu` and :mod:`~cpjax.kernels.gpu` the two targets,
:mod:`~cpjax.kernels.targets` the choice between them and their tiling rules.
"""

from cpjax.kernels.targets import IMPLEMENTATIONS as IMPLEMENTATIONS
from cpjax.kernels.targets import TARGETS as TARGETS
from cpjax.kernels.targets import KernelTarget as KernelTarget
from cpjax.kernels.targets import resolve_implementation as resolve_implementation
