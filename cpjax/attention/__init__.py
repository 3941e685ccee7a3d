"""The attention half: context-parallel attention over the ``cp`` ranks.

* :mod:`cpjax.attention.ring`: the strategies (ring, all-gather with a
  window's halo, Ulysses, hybrid) inside ``shard_map``, and their per-hop
  kernels (:mod:`cpjax.attention.ring.kernels`);
* :mod:`cpjax.attention.global_attention`: the same on global arrays, with
  its own ``shard_map``;
* :mod:`cpjax.attention.cp_context`: a model's CP settings in one object
  (:class:`CPContext`), with its batch's sharder;
* :mod:`cpjax.attention.flax_attention`: the hook that routes a Flax model's
  attention through the ring (:func:`use_cp`, :func:`ring_attention_fn`);
* :mod:`cpjax.attention.reference`: the dense float32 attention every path
  is checked against.

Its entry points are exported by :mod:`cpjax` itself
(:func:`cpjax.ring_attention`, :func:`cpjax.context_parallel_attention`,
:class:`cpjax.CPContext`, ...): one path per name.

Example:
  >>> import numpy as np, cpjax
  >>> q = k = v = np.ones((1, 4, 2, 8), np.float32)
  >>> cpjax.reference_attention(q, k, v, causal=True).shape
  (1, 4, 2, 8)
"""
