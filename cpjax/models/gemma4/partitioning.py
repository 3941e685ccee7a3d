"""How Gemma 4's parameters split over a ``tp`` mesh axis, and which meshes fit the model.

Megatron's split, written as shardings (see :mod:`cpjax.parallel`): the
query, key, value, gate and up projections are split by output rows (heads,
hidden units), the output and down projections by input columns, so each
``tp`` rank computes whole heads and whole hidden units and one all-reduce
closes each block (LoRA adapters follow: ``A`` of a column-split
projection splits by its input rows, ``B`` of a row-split one by its output
columns; a quantized base's scales follow their weight's output rows, and
its input columns where ``tp`` divides the groups, else stay whole). MoE
experts split over ``tp`` by expert, or, with expert
parallelism, over the ``expert_axes`` their tokens travel over
(:func:`cpjax.parallel.expert_axes`). Key/value
projections whose head count ``tp`` does not divide (Gemma 4's full layers
often have 1 to 4 KV heads) stay replicated over ``tp``, as in Megatron's
GQA. Everything else (embeddings, norms, router, vision tower) is split only
over ``fsdp``, by :func:`cpjax.parallel.param_specs`.

>>> from cpjax.models.gemma4 import Gemma4Config
>>> rule = partition_rule(Gemma4Config.preset("tiny"), tp=2)
>>> rule(("model", "language_model", "layers", "0", "self_attn", "o_proj", "weight"), (64, 64))
P(None, 'tp')
"""

from __future__ import annotations

import math

from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

from cpjax import checks
from cpjax.models.gemma4.config import Gemma4Config
from cpjax.parallel import PartitionRule, batch_axis_of, expert_axes

__all__ = ["check_expert_axes", "check_mesh", "partition_rule"]

_ROWS = ("q_proj", "gate_proj", "up_proj")  # [out = heads x head_dim or hidden, in]
_COLUMNS = ("o_proj", "down_proj")  # [out, in = heads x head_dim or hidden]


def partition_rule(
  cfg: Gemma4Config, *, tp: int, expert_axes: tuple[str, ...] = ()
) -> PartitionRule:
  """Make a ``rule(path, shape) -> PartitionSpec`` placing ``"tp"`` on Gemma 4's text decoder.

  The rule also places the experts over ``expert_axes`` when given (their
  expert dimension split over those axes, the first major).

  Args:
    cfg: the :class:`Gemma4Config`.
    tp: the tensor-parallel axis's size.
    expert_axes: the mesh axes the experts are split over.

  Returns:
    The :data:`cpjax.parallel.PartitionRule`.
  """
  if not isinstance(cfg, Gemma4Config):
    raise TypeError(f"cfg must be a Gemma4Config, got {type(cfg).__name__}")
  checks.integer("tp", tp, minimum=1)
  if not isinstance(expert_axes, tuple) or not all(isinstance(a, str) for a in expert_axes):
    raise TypeError(f"expert_axes must be a tuple of mesh axis names, got {expert_axes!r}")
  t = cfg.text

  def rule(path, shape):
    if len(path) < 6 or path[:3] != ("model", "language_model", "layers"):
      return P()
    layer, block, name = int(path[3]), path[4], path[5]
    if block == "experts":  # gate_up_proj [E, 2I, D], down_proj [E, D, I]
      return P(expert_axes) if expert_axes else P("tp") if tp > 1 else P()
    if tp == 1:
      return P()
    if block not in ("self_attn", "mlp"):
      return P()
    if name in ("k_proj", "v_proj"):
      split = "rows" if t.kv_heads(layer) % tp == 0 else None
    else:
      split = "rows" if name in _ROWS else "columns" if name in _COLUMNS else None
    # LoRA factors (cpjax.training.lora) follow their weight: A [in, r] splits where a
    # column-split weight does, B [r, out] where a row-split one does, so the
    # adapters' term is split (and reduced) exactly as the projection is.
    leaf = path[6] if len(path) > 6 else "weight"
    if split is None:
      return P()
    if leaf.endswith("_lora_a"):
      return P("tp", None) if split == "columns" else P()
    if leaf.endswith("_lora_b"):
      return P(None, "tp") if split == "rows" else P()
    if "scale" in path[7:]:  # a quantized weight's scales [out, groups] (qwix's QArray)
      if split == "rows":
        return P("tp", None)
      return P(None, "tp") if shape[1] % tp == 0 else P()
    return P("tp", None) if split == "rows" else P(None, "tp")

  return rule


def check_expert_axes(cfg: Gemma4Config, mesh: Mesh, expert_axes: tuple[str, ...]) -> None:
  """Check that ``expert_axes`` of ``mesh`` can split ``cfg``'s experts evenly.

  Args:
    cfg: the :class:`Gemma4Config`.
    mesh: the mesh.
    expert_axes: the mesh axes the experts are split over
      (:func:`cpjax.parallel.expert_axes`).

  Raises:
    ValueError: naming ep and the experts' count when ``expert_axes`` of
      ``mesh`` cannot split ``cfg``'s experts evenly, or ``cfg`` has none.

  >>> import jax
  >>> mesh = jax.make_mesh((8,), ("cp",), devices=jax.devices()[:8])
  >>> check_expert_axes(Gemma4Config.preset("tiny-moe"), mesh, ("cp",))
  Traceback (most recent call last):
  ...
  ValueError: ep=8 does not divide the 4 experts (expert_axes ('cp',))
  """
  expert_axes = tuple(expert_axes)
  if not expert_axes:
    return
  unknown = [a for a in expert_axes if a not in mesh.axis_names]
  if unknown:
    raise ValueError(
      f"expert_axes {expert_axes} name axes {unknown} the mesh {mesh.axis_names} does not have"
    )
  ep = math.prod(int(mesh.shape[a]) for a in expert_axes)
  if not cfg.text.enable_moe_block:
    raise ValueError(
      f"ep={ep} needs a mixture of experts; this Gemma 4 has none "
      f"(enable_moe_block is false; expert_axes {expert_axes})"
    )
  assert cfg.text.num_experts is not None  # enable_moe_block requires it
  if cfg.text.num_experts % ep:
    raise ValueError(
      f"ep={ep} does not divide the {cfg.text.num_experts} experts (expert_axes {expert_axes})"
    )


def check_mesh(
  cfg: Gemma4Config,
  mesh: Mesh,
  *,
  seq_len: int | None = None,
  batch_size: int | None = None,
  ep: int = 1,
) -> None:
  """Check that ``mesh`` can run ``cfg``.

  ``tp`` must divide the query heads, every layer's MLP width and the number
  of experts; the batch axis must divide ``batch_size``; ``cp`` must
  divide ``seq_len`` (the sharder pads a row to a multiple of ``2 * cp``;
  a planned length must not need padding); and ``ep`` (expert parallelism,
  :func:`cpjax.parallel.expert_axes`) needs a mixture of experts whose
  expert count it divides.

  Args:
    cfg: the :class:`Gemma4Config`.
    mesh: the mesh.
    seq_len: the row length, or None.
    batch_size: the batch size, or None.
    ep: the expert parallelism.

  Raises:
    ValueError: naming the axis and the sizes when ``mesh`` cannot run ``cfg``.
  """
  if not isinstance(cfg, Gemma4Config):
    raise TypeError(f"cfg must be a Gemma4Config, got {type(cfg).__name__}")
  if not isinstance(mesh, (Mesh, AbstractMesh)):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
    if value is not None:
      checks.integer(name, value, minimum=1)
  t = cfg.text
  tp = int(mesh.shape["tp"]) if "tp" in mesh.axis_names else 1
  if t.num_attention_heads % tp:
    raise ValueError(
      f"mesh axis 'tp' of size {tp} does not divide the {t.num_attention_heads} attention heads"
    )
  for i in range(t.num_hidden_layers):
    if t.mlp_size(i) % tp:
      raise ValueError(
        f"mesh axis 'tp' of size {tp} does not divide layer {i}'s MLP width {t.mlp_size(i)}"
      )
  if t.enable_moe_block:
    assert t.num_experts is not None  # enable_moe_block requires it
    if t.num_experts % tp:
      raise ValueError(f"mesh axis 'tp' of size {tp} does not divide the {t.num_experts} experts")
  check_expert_axes(cfg, mesh, expert_axes(mesh, ep))
  batch_axis = batch_axis_of(mesh)
  if batch_size is not None and batch_axis is not None and batch_size % mesh.shape[batch_axis]:
    raise ValueError(
      f"mesh axis {batch_axis!r} of size {mesh.shape[batch_axis]} does not "
      f"divide the batch size {batch_size}"
    )
  if seq_len is not None and "cp" in mesh.axis_names and seq_len % mesh.shape["cp"]:
    raise ValueError(
      f"mesh axis 'cp' of size {mesh.shape['cp']} does not divide the sequence length {seq_len}"
    )
