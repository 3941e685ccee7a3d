"""Which per-hop attention backend runs on a mesh's platform, and the chunk
its layout must be a multiple of.

Both halves need this: the batch is padded to the backend's chunk
(:func:`cpjax.shard_batch`), and the attention runs that backend
(:mod:`cpjax.attention.ring.kernels`, where each backend's tiles live). The
backends, by their ``implementation`` name:

* ``"xla"``: the portable tile loop (CPU, or any backend);
* ``"pallas_tpu"``: Mosaic kernels;
* ``"pallas_gpu"``: Triton kernels;
* ``None``: the Pallas backend of the platform, XLA on CPU.

>>> resolve_implementation(None, platform="tpu"), chunk_multiple("pallas_tpu")
('pallas_tpu', 128)
"""

from __future__ import annotations

import jax
import numpy as np

__all__ = ["IMPLEMENTATIONS", "chunk_multiple", "mesh_platform", "resolve_implementation"]

IMPLEMENTATIONS = ("xla", "pallas_tpu", "pallas_gpu")


def chunk_multiple(implementation: str) -> int:
  """Return the tokens a layout chunk must be a multiple of for ``implementation``'s
  tiles to divide it: Mosaic's 128 lanes, Triton's smallest power-of-two tile, 1
  for XLA's tile loop (which pads its own last tile)."""
  return {"pallas_tpu": 128, "pallas_gpu": 16}.get(resolve_implementation(implementation), 1)


def mesh_platform(mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh) -> str | None:
  """The platform of a concrete mesh's devices ("tpu" for compile-only TPU
  devices too); None for an abstract mesh (then the default backend's)."""
  devices = getattr(mesh, "devices", None)
  return None if devices is None else np.asarray(devices).flat[0].platform


def resolve_implementation(implementation: str | None, *, platform: str | None = None) -> str:
  """The backend name ``implementation`` stands for.

  None means the Pallas implementation of ``platform`` ("tpu", "gpu" or "cuda"; "xla"
  for anything else), by default the platform of ``jax.default_backend()``.
  A program whose mesh is on other devices than the default backend's (CPU
  devices on a TPU host) passes that platform, or names the implementation.

  >>> resolve_implementation("xla"), resolve_implementation(None, platform="tpu")
  ('xla', 'pallas_tpu')
  >>> resolve_implementation("cuda")
  Traceback (most recent call last):
  ...
  ValueError: implementation must be None or one of ('xla', 'pallas_tpu', 'pallas_gpu'), got 'cuda'
  """
  if implementation is None:
    platform = jax.default_backend() if platform is None else platform
    return {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu"}.get(platform, "xla")
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
      f"implementation must be None or one of {IMPLEMENTATIONS}, got {implementation!r}"
    )
  return implementation
