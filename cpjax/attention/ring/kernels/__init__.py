"""Fused per-hop attention kernels (Pallas) behind :func:`cpjax.ring_attention`.

A ring hop folds one visiting K/V chunk into this rank's queries. Its compute
runs on one of three backends (``implementation``): the portable XLA tile
loop of :mod:`cpjax.attention.ring`, Mosaic kernels for TPU or Triton kernels for GPU.
This package chooses between them (:func:`resolve_implementation`) and holds
each Pallas implementation's tiling rules (:data:`PALLAS_IMPLEMENTATIONS`);
:mod:`~cpjax.attention.ring.kernels.ptxas` reads ptxas's register and spill
report of the GPU kernels. (A *target*, in cpjax, is a chip the plan compiles
for: :mod:`cpjax.training.targets`.)

Internal modules: ``_common`` (the tile math and the per-hop tile schedule
both Pallas implementations share), ``_tpu`` and ``_gpu`` (the kernels),
``_implementations`` (the choice and the tile records), ``_interpret``
(Pallas' interpreter under a mesh, how the CPU tests run the kernels).

>>> resolve_implementation(None, platform="cpu")
'xla'
>>> PALLAS_IMPLEMENTATIONS["pallas_tpu"].chunk_multiple
128
"""

from cpjax.attention.ring.kernels._implementations import IMPLEMENTATIONS as IMPLEMENTATIONS
from cpjax.attention.ring.kernels._implementations import (
  PALLAS_IMPLEMENTATIONS as PALLAS_IMPLEMENTATIONS,
)
from cpjax.attention.ring.kernels._implementations import (
  PallasImplementation as PallasImplementation,
)
from cpjax.attention.ring.kernels._implementations import mesh_platform as mesh_platform
from cpjax.attention.ring.kernels._implementations import (
  resolve_implementation as resolve_implementation,
)

__all__ = [
  "IMPLEMENTATIONS",
  "PALLAS_IMPLEMENTATIONS",
  "PallasImplementation",
  "mesh_platform",
  "resolve_implementation",
]


def __getattr__(name: str) -> object:
  # KernelTarget and TARGETS, the Pallas implementations' names in 0.1,
  # resolve for one release with a warning.
  from cpjax import _deprecations

  return _deprecations.moved_attribute(__name__, name)
