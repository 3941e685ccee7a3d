"""Fused per-hop attention kernels (Pallas) behind :func:`cpjax.ring_attention`.

A ring hop folds one visiting K/V chunk into this rank's queries. Its compute
runs on one of three backends (``implementation``): the portable XLA tile
loop of :mod:`cpjax.attention.ring`, Mosaic kernels for TPU or Triton kernels for GPU.
This package chooses between them (:func:`resolve_implementation`) and holds
each target's tiling rules (:data:`TARGETS`); :mod:`~cpjax.attention.ring.kernels.ptxas`
reads ptxas's register and spill report of the GPU kernels.

Internal modules: ``_common`` (the tile math and the per-hop tile schedule
both targets share), ``_tpu`` and ``_gpu`` (the kernels), ``_targets``
(the choice and the tile records), ``_interpret`` (Pallas' interpreter under
a mesh, how the CPU tests run the kernels).

>>> resolve_implementation(None, platform="cpu"), TARGETS["pallas_tpu"].chunk_multiple
('xla', 128)
"""

from cpjax.attention.ring.kernels._targets import IMPLEMENTATIONS as IMPLEMENTATIONS
from cpjax.attention.ring.kernels._targets import TARGETS as TARGETS
from cpjax.attention.ring.kernels._targets import KernelTarget as KernelTarget
from cpjax.attention.ring.kernels._targets import mesh_platform as mesh_platform
from cpjax.attention.ring.kernels._targets import resolve_implementation as resolve_implementation

__all__ = ["IMPLEMENTATIONS", "KernelTarget", "TARGETS", "mesh_platform", "resolve_implementation"]
