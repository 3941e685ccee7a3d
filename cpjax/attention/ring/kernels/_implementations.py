"""Which per-hop backend runs, its block sizes, and what it can tile.

``implementation`` names the backend of every ring hop:

* ``"xla"``: the portable tile loop of :mod:`cpjax.attention.ring` (CPU, or
  any backend);
* ``"pallas_tpu"``: Mosaic kernels (:mod:`cpjax.attention.ring.kernels._tpu`);
* ``"pallas_gpu"``: Triton kernels (:mod:`cpjax.attention.ring.kernels._gpu`);
* ``None``: the Pallas implementation of the default backend, XLA on CPU.

A Pallas implementation compiled for another platform fails when the program is
lowered, before anything runs, with a ``ValueError`` that names the
platform; ``interpret=True`` runs the kernels in Pallas' interpreter on any
backend (how the CPU tests check them). Lowering for a named platform from a
CPU machine (``jax.jit(f).trace(...).lower(lowering_platforms=("tpu",))``)
works like compiling on that platform.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax._src import core as jax_core
from jax._src import dispatch
from jax._src.interpreters import mlir
from jax.typing import DTypeLike

from cpjax.parallel import (
  IMPLEMENTATIONS,
  chunk_multiple,
  mesh_platform,
  resolve_implementation,
)

__all__ = [
  "IMPLEMENTATIONS",
  "PALLAS_IMPLEMENTATIONS",
  "PallasImplementation",
  "mesh_platform",
  "resolve_implementation",
]


def _pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class PallasImplementation:
  """One Pallas implementation of a ring hop: the platforms it compiles for,
  its tiling rules and its default tile shapes.

  Attributes:
    name: the ``implementation`` string.
    platforms: XLA platform names the kernels lower for.
    tiles: ``((max head dim, rows R, keys K), ...)`` ascending: the default
      tile for head dims up to that size. ``R = block_q * G`` query rows.
    f32_tiles: the same for float32 inputs, where they differ (empty: ``tiles``).
    schedule_tiles: the most (row block, key block) pairs one hop's schedule
      may hold; past it, :meth:`schedule_blocks` groups tiles into larger
      blocks (None: every tile its own block).
    chosen_on: which chip and compile the records were chosen on.
  """

  name: str
  platforms: tuple[str, ...]
  tiles: tuple[tuple[int, int, int], ...]
  f32_tiles: tuple[tuple[int, int, int], ...] = ()
  schedule_tiles: int | None = None
  chosen_on: str = ""

  @property
  def chunk_multiple(self) -> int:
    """Tokens a layout chunk must be a multiple of for this implementation's tiles to
    divide it (``shard_batch`` pads rows to it): Mosaic's 128 lanes, Triton's
    smallest power-of-two tile."""
    return chunk_multiple(self.name)

  def default_tile(self, head_dim: int, dtype: DTypeLike | None = None) -> tuple[int, int]:
    """(rows, keys) of the tile record for ``head_dim`` and the inputs' ``dtype``."""
    table = (
      self.f32_tiles
      if self.f32_tiles and np.dtype(dtype or np.float16) == np.float32
      else self.tiles
    )
    for max_d, rows, keys in table:
      if head_dim <= max_d:
        return rows, keys
    return table[-1][1:]

  def schedule_blocks(
    self, block_q: int, block_kv: int, *, chunk_len: int, local_len: int, key_len: int | None = None
  ) -> tuple[int, int]:
    """(query tokens, keys) per block of a hop's schedule: the tile, grown in
    powers of two until the schedule has at most ``schedule_tiles`` blocks.
    A hop's keys are ``local_len`` tokens (one rank's chunk) unless
    ``key_len`` says otherwise (the all-gather's whole row).

    A schedule is dense in (row block, key block), so with small tiles it
    grows as L**2: Triton's 16-row tiles at head dim 512 and L = 262144 local
    tokens made 8 GiB tables per hop. Each doubling goes to the side with
    fewer tokens (queries first on a tie: a query tile holds G rows a token),
    and a block never straddles a chunk. The kernels walk every tile inside
    a scheduled block; a block the mask leaves empty is still skipped whole.

    >>> gpu = PALLAS_IMPLEMENTATIONS["pallas_gpu"]
    >>> gpu.schedule_blocks(2, 16, chunk_len=131072, local_len=262144)
    (256, 256)
    >>> gpu.schedule_blocks(2, 16, chunk_len=1024, local_len=2048)   # 131072 blocks: as is
    (2, 16)
    >>> gpu.schedule_blocks(2, 16, chunk_len=1024, local_len=4096, key_len=8 * 4096)  # a row
    (8, 16)
    """
    bq, bk = block_q, block_kv
    if self.schedule_tiles is None:
      return bq, bk
    key_len = local_len if key_len is None else key_len
    while (local_len // bq) * (key_len // bk) > self.schedule_tiles:
      sides = [side for side, size in (("q", bq), ("k", bk)) if chunk_len % (2 * size) == 0]
      if not sides:
        break
      if min(sides, key=lambda side: (bq if side == "q" else bk, side)) == "q":
        bq *= 2
      else:
        bk *= 2
    return bq, bk

  def head_dim_problem(self, head_dim: int) -> str | None:
    if self.name == "pallas_gpu" and not (_pow2(head_dim) and head_dim >= 16):
      return "a power of two >= 16 (Triton tiles are powers of two)"
    return None

  def block_problem(self, rows: int, keys: int, *, local_rows: int, local_len: int) -> str | None:
    """Why a tile of ``rows`` x ``keys`` cannot be used, or None."""
    if self.name == "pallas_tpu":
      # A block's last dimension is a multiple of the 128 lanes or the whole array.
      if rows % 128 and rows != local_rows:
        return f"block_q * G = {rows} rows must be a multiple of 128"
      if keys % 128 and keys != local_len:
        return f"block_kv = {keys} must be a multiple of 128"
    elif self.name == "pallas_gpu":
      if not (_pow2(rows) and rows >= 16):
        return f"block_q * G = {rows} rows must be a power of two >= 16"
      if not (_pow2(keys) and keys >= 16):
        return f"block_kv = {keys} must be a power of two >= 16"
    return None


# TPU: splash attention's defaults, scaled so a tile's f32 state stays within
# VMEM for each head dim; Mosaic accepts them for v5e at head dims 256 and
# 512, bfloat16 and float32 (tests/test_compile_targets.py). GPU: the largest
# tiles that ptxas compiles for sm_90a (8 warps) without spilling registers,
# read from ptxas -v (cpjax.attention.ring.kernels.ptxas) on the ring's three kernels; with
# float32 inputs at head dims 256 and 512 even 16 x 16 tiles spill in dK/dV
# (tests/test_compile_targets.py records how much). Those small tiles are why
# only the GPU groups its schedule's tiles (schedule_tiles); the TPU's are 256
# to 1024 rows, and their tables go to SMEM in pieces (cpjax.attention.ring.kernels._tpu).
# Neither is tuned for speed on hardware yet: see benchmarks/accelerator.py.
PALLAS_IMPLEMENTATIONS = {
  "pallas_tpu": PallasImplementation(
    "pallas_tpu",
    ("tpu",),
    ((128, 1024, 512), (256, 512, 512), (512, 256, 512)),
    chosen_on="Mosaic for TPU v5e (compile-only, libtpu 0.0.42)",
  ),
  "pallas_gpu": PallasImplementation(
    "pallas_gpu",
    ("cuda",),
    ((64, 128, 128), (128, 128, 64), (256, 32, 32), (512, 16, 16)),
    f32_tiles=((64, 64, 32), (128, 32, 32), (256, 16, 16), (512, 16, 16)),
    schedule_tiles=1 << 20,
    chosen_on="ptxas for sm_90a (H200, compile-only, CUDA 12)",
  ),
}


# --------------------------------------------------- the platform guard
# An identity whose lowering checks the platform, so a Pallas implementation compiled
# for the wrong backend is a clear error at lowering time (before anything
# runs), while lowering for the right platform from any machine still works.
_guard_p = jax_core.Primitive("cpjax_kernel_platform_guard")
_guard_p.def_impl(functools.partial(dispatch.apply_primitive, _guard_p))  # eager: lower too
_guard_p.def_abstract_eval(lambda aval, *, implementation: aval)


def _guard_lowering(ctx, x, *, implementation: str):
  allowed = PALLAS_IMPLEMENTATIONS[implementation].platforms
  wrong = [p for p in ctx.module_context.platforms if p not in allowed]
  if wrong:
    raise ValueError(
      f"implementation={implementation!r} compiles for {'/'.join(allowed)}, but this program "
      f"is lowered for the {wrong[0]!r} backend. Pass implementation=None (the default: the "
      f"backend's own kernels, XLA on CPU) or 'xla', or interpret=True to run the "
      f"{implementation} kernels in Pallas' interpreter."
    )
  return [x]


mlir.register_lowering(_guard_p, _guard_lowering)


def platform_guard(x: jax.Array, implementation: str) -> jax.Array:
  """``x`` unchanged; lowering fails unless it is for ``implementation``'s platforms."""
  return _guard_p.bind(x, implementation=implementation)
