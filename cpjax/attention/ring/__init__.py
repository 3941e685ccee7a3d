"""Ring attention over a named mesh axis, and the kernels of its hops.

:func:`ring_attention` runs inside ``jax.shard_map``: K/V chunks travel
around a ``lax.ppermute`` ring over ``cp`` and each rank folds every visiting
chunk into flash-style online-softmax statistics, skipping the tiles its
mask leaves empty; the backward pass replays the ring from the saved
log-sum-exp. :func:`ring_plan` says, before tracing, which hops a mask's
reach needs (:class:`RingPlan`). With ``strategy="all_gather"`` the same
passes take no hops: each rank gathers the whole row's K/V at once, or a
window's halo (:func:`halo`); with ``strategy="ulysses"`` all-to-alls turn
the sequence split into a head split; ``strategy="hybrid"`` runs Ulysses
inside groups of neighbouring ranks and the ring over the groups
(:func:`hybrid_ulysses_size`, :data:`STRATEGIES`).

Internal modules: ``_schedule`` (the static plan and the tile sizes),
``_passes`` (the forward and backward passes and their custom VJP),
``_attention`` (the entry point: checks, then the ring);
:mod:`cpjax.attention.ring.kernels` holds the fused Pallas kernels of one hop.

>>> import cpjax
>>> ring_plan(cpjax.ShardLayout(8192, 8192, 8, "contiguous"), sliding_window=512)
RingPlan(forward_hops=1, backward_hops=0)
>>> default_block_size(1024)
128
"""

from cpjax.attention.ring._attention import STRATEGIES as STRATEGIES
from cpjax.attention.ring._attention import hybrid_ulysses_size as hybrid_ulysses_size
from cpjax.attention.ring._attention import ring_attention as ring_attention
from cpjax.attention.ring._attention import ulysses_kv_repeats as ulysses_kv_repeats
from cpjax.attention.ring._schedule import Halo as Halo
from cpjax.attention.ring._schedule import RingPlan as RingPlan
from cpjax.attention.ring._schedule import default_block_size as default_block_size
from cpjax.attention.ring._schedule import halo as halo
from cpjax.attention.ring._schedule import ring_plan as ring_plan

__all__ = [
  "STRATEGIES",
  "Halo",
  "RingPlan",
  "default_block_size",
  "halo",
  "hybrid_ulysses_size",
  "ring_attention",
  "ring_plan",
  "ulysses_kv_repeats",
]
