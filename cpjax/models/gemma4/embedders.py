"""The 12B unified model's image embedder (transformers' ``Gemma4UnifiedVisionEmbedder``).

No encoder: every patch of ``model_patch_size`` pixels a side is one soft
token, embedded on its own (norms, a dense layer with bias, and a 2-D position
table indexed by the patch's column and row). Nothing mixes patches, so under
context parallelism each rank embeds only the patches of its own image tokens
(:meth:`cpjax.models.gemma4.Gemma4.embed`). ``embed_vision`` (RMS0 and a
projection into the text width) follows, as does ``embed_audio`` for audio
frames: :class:`~cpjax.models.gemma4.vision.MultimodalEmbedder`.

Shape letters: ``F`` pixels of a patch (3 x model_patch_size**2), ``E`` the
embedder's width, ``T`` positions of each axis of the table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike, DTypeLike

from cpjax.models.gemma4.layers import LayerNorm, Linear
from cpjax.models.gemma4.unified_config import LAYER_NORM_EPS, Gemma4UnifiedVisionConfig

__all__ = ["UnifiedVisionEmbedder"]


class UnifiedVisionEmbedder(nnx.Module):
  """``model.vision_embedder``: patches [..., F] at (x, y) -> [..., E].

  ``LN(LN(dense(LN(patch))) + table[x, 0] + table[y, 1])``, a padding
  position (-1) adding nothing, as transformers computes it.

  Example:
    >>> import numpy as np
    >>> cfg = Gemma4UnifiedVisionConfig(patch_size=2, pooling_kernel_size=2, mm_embed_dim=8,
    ...                                 mm_posemb_size=4, output_proj_dims=8)
    >>> embed = UnifiedVisionEmbedder(cfg, rngs=nnx.Rngs(0))
    >>> embed(np.ones((3, 48)), np.array([[0, 0], [1, 0], [-1, -1]]), jnp.float32).shape
    (3, 8)
  """

  def __init__(self, cfg: Gemma4UnifiedVisionConfig, *, rngs: nnx.Rngs | None):
    f, e = cfg.patch_features, cfg.mm_embed_dim
    self.patch_ln1 = LayerNorm(f, eps=LAYER_NORM_EPS)
    self.patch_dense = Linear(f, e, bias=True, rngs=rngs)
    self.patch_ln2 = LayerNorm(e, eps=LAYER_NORM_EPS)
    shape = (cfg.mm_posemb_size, 2, e)
    table = jnp.zeros(shape) if rngs is None else 0.02 * jax.random.normal(rngs.params(), shape)
    self.pos_embedding = nnx.Param(table.astype(jnp.float32))
    self.pos_norm = LayerNorm(e, eps=LAYER_NORM_EPS)

  def __call__(self, patches: ArrayLike, positions: ArrayLike, dtype: DTypeLike) -> jax.Array:
    """Embed patches [..., F] at positions int[..., 2] ((x, y); -1 = padding) in ``dtype``."""
    h = self.patch_ln2(self.patch_dense(self.patch_ln1(jnp.asarray(patches).astype(dtype))))
    positions = jnp.asarray(positions)
    table = self.pos_embedding[...].astype(dtype)
    # The column's entry of axis 0 plus the row's of axis 1, summed first.
    axes = [
      jnp.where((positions[..., a] >= 0)[..., None], table[jnp.maximum(positions[..., a], 0), a], 0)
      for a in (0, 1)
    ]
    return self.pos_norm(h + (axes[0] + axes[1]))
