"""A quantized frozen base under LoRA (QLoRA), with qwix: which weights, in what form.

With ``LoraConfig.base_dtype`` one of :data:`QUANTIZED_DTYPES`, the decoder's
projections (:data:`QUANTIZED_MODULES`: attention q/k/v/o and the dense MLP's
gate/up/down, adapted or not) and the MoE's expert tensors are stored
quantized; everything else (embeddings, norms, the router, the vision tower)
keeps the storage dtype the model was loaded in. The adapters stay float32.

The scheme is qwix's weight-only quantization, symmetric, with no zero point:

* ``int8`` / ``int4``: ``scale = absmax / (qmax + 1/2)`` (``qmax`` 127 or 7:
  the top bucket is used in full), ``q = clip(round(w / scale), -qmax - 1, qmax)``;
* ``nf4`` (QLoRA's NormalFloat): ``scale = absmax``, ``q`` the nearest of the
  16 NF4 values to ``w / scale``;
* ``float8_e4m3fn``: ``scale = absmax / 448`` (its largest value), ``q`` =
  ``w / scale`` rounded to the nearest float8 (ties to even);

with ``absmax`` over each output channel's whole input (``group_size`` None:
per-channel scales) or over each run of ``group_size`` input values
(per-group scales). The forward computes with ``q * scale``: qwix's own
product for the projections, the experts' grouped matmul on the tensor
dequantized to the compute dtype (:class:`cpjax.models.gemma4.text.Experts`).
Every chip computes it so, in the activations' dtype: a quantized base is a
storage format (a float8 base does not need a chip with float8 matmuls).

Shape letters: ``E`` experts, ``O`` a weight's output width, ``I`` its input
width, ``G`` its groups (``I / group_size``, 1 per channel).
"""

from __future__ import annotations

from typing import Any

import jax
import qwix
from flax import nnx

__all__ = ["QUANTIZED_DTYPES", "QUANTIZED_MODULES", "quantize_experts", "quantize_tensor"]

QUANTIZED_DTYPES = ("int8", "int4", "nf4", "float8_e4m3fn")

# The decoder's projections: most of a dense model's weights. (Not the router:
# its logits pick the experts, and it is tiny.)
QUANTIZED_MODULES = (
  r".*language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
)


def qtype(base_dtype: str) -> Any:
  """Return qwix's qtype of a quantized ``base_dtype`` (``"int4"`` -> ``jnp.int4``)."""
  import jax.numpy as jnp

  return {
    "int8": jnp.int8,
    "int4": jnp.int4,
    "nf4": "nf4",
    "float8_e4m3fn": jnp.float8_e4m3fn,
  }[base_dtype]


def quantize_tensor(weight: jax.Array, base_dtype: str, group_size: int | None) -> qwix.QArray:
  """Quantize an expert stack [E, O, I] as qwix quantizes a projection's weight.

  Args:
    weight: [E, O, I].
    base_dtype: one of :data:`QUANTIZED_DTYPES`.
    group_size: input values a scale (None: one scale per output channel).

  Returns:
    qwix's ``QArray``: ``qvalue`` [E, O, I] and ``scale`` [E, O, G] in
    ``weight``'s dtype.

  >>> import jax.numpy as jnp
  >>> q = quantize_tensor(jnp.array([[[1.0, -3.0, 0.5, 2.0]]]), "int4", 2)
  >>> q.qvalue.tolist(), q.scale.tolist()          # scales 3 / 7.5 and 2 / 7.5
  ([[[2, -7, 2, 7]]], [[[0.40000003576278687, 0.2666666805744171]]])
  """
  tiles = {} if group_size is None else {2: group_size}
  return qwix.quantize(weight, qtype(base_dtype), channelwise_axes=(0, 1), tiled_axes=tiles)


def quantize_experts(model: nnx.Module, base_dtype: str, group_size: int | None) -> None:
  """Store every tensor a module lists in ``lora_parameters`` quantized, in place."""
  for _, module in nnx.iter_modules(model):
    for name in getattr(module, "lora_parameters", ()):
      param = getattr(module, name)
      value = param.get_value()
      if not isinstance(value, qwix.QArray):
        param.set_value(quantize_tensor(value, base_dtype, group_size))
