"""What a model receives and returns under context parallelism.

The contract between a model and the training step, below both:

* :class:`CPContext`: where the forward runs (inside ``shard_map`` over the
  ``cp`` axis, on a batch sharded by a :class:`cpjax.ShardLayout`) and which
  ring backend and expert parallelism it uses. The step hands it to the
  model's forward.
* :class:`ContextParallelSharder`: how a model's batches are sharded.
* :class:`HiddenStates`: what a forward may return instead of logits.
* :func:`batch_specs`, :func:`state_specs`, :func:`manual_axes`: the
  ``shard_map`` specs of a sharded batch and of a model's state, and the
  axes that ``shard_map`` is manual over.

Shape letters: ``B`` rows, ``L`` local tokens per row, ``D`` width, ``V``
vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, NamedTuple

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cpjax.attention.ring import STRATEGIES
from cpjax.attention.ring.kernels import resolve_implementation
from cpjax.batch.layout import ShardLayout, local_token_indices
from cpjax.parallel import key_names, lookup, ring_lookup

__all__ = [
  "CPContext",
  "ContextParallelSharder",
  "HiddenStates",
  "batch_specs",
  "manual_axes",
  "parse_strategy",
  "unknown_layer_kinds",
  "split_over",
  "state_specs",
]


class HiddenStates(NamedTuple):
  """What a forward may return instead of logits: the loss is then
  :func:`linear_cross_entropy` of ``cap(hidden @ head.T)``, exactly
  :func:`token_cross_entropy` of those logits, which are never whole.

  Attributes:
    hidden: [B, L, D] final hidden states (after the final norm).
    head: [V, D] output projection (a tied embedding table as it is).
    logits_soft_cap: ``cap`` of ``cap * tanh(logits / cap)``, or None.
    head_axis: None (``head`` whole), or the manual mesh axis whose rank
      ``i`` holds block ``i`` of the head's rows (:meth:`CPContext.head`).
    metrics: None, or float32 arrays the training step reports beside the
      loss, as sums over the tokens of this cp rank, every batch row (the
      step sums them over the cp ranks and microbatches): Gemma 4's MoE gives ``expert_tokens``
      [layers, E] and ``expert_dropped`` [layers].
  """

  hidden: jax.Array
  head: jax.Array
  logits_soft_cap: float | None = None
  metrics: dict | None = None
  head_axis: str | None = None


@dataclasses.dataclass(frozen=True)
class CPContext:
  """Where a forward runs: inside ``shard_map`` over ``axis_name``, on a batch
  sharded by ``layout``, and which per-hop attention backend it uses. The
  training step hands it to the model's forward.

  Attributes:
    layout: the batch's :class:`cpjax.ShardLayout`.
    axis_name: the context-parallel mesh axis.
    implementation, interpret: the ring's per-hop backend, as
      :func:`cpjax.ring_attention` takes them (None: the backend's default).
    expert_axes: mesh axes a mixture of experts is split over (expert
      parallelism, :func:`cpjax.parallel.expert_axes`); empty for none.
    capacity_factor: None (an expert never drops a token) or the factor
      bounding each expert's tokens (:mod:`cpjax.models.gemma4.experts`).
    gathered: ``((path, dim), ...)``, the state stored split over
      ``axis_name`` along ``dim`` (the training step fills it from the
      shardings; empty when the state is whole over cp): what :meth:`gather`,
      :meth:`lookup` and :meth:`head` read.
    strategy: how attention's K/V reach the queries (``ring_attention``'s
      ``strategy``): one of :data:`cpjax.attention.ring.STRATEGIES` for every layer, or
      one per layer kind, as a mapping or as text
      (``"full_attention=all_gather,sliding_attention=ring"``); a kind it
      does not name takes ``"ring"``. Stored as sorted ``(kind, strategy)``
      pairs (:func:`parse_strategy`).

  >>> import cpjax
  >>> cp = cpjax.CPContext(cpjax.ShardLayout(6, 8, 2), strategy={"full_attention": "all_gather"})
  >>> cp.axis_name, cp.attention_options("full_attention")
  ('cp', {'implementation': None, 'interpret': False, 'strategy': 'all_gather'})
  >>> cp.attention_options("sliding_attention")["strategy"]
  'ring'
  """

  layout: ShardLayout
  axis_name: str = "cp"
  implementation: str | None = None
  interpret: bool = False
  expert_axes: tuple[str, ...] = ()
  capacity_factor: float | None = None
  gathered: tuple = ()
  strategy: str | Mapping[str, str] | tuple = "ring"

  def __post_init__(self):
    # A mapping is stored as sorted pairs: the context stays hashable.
    object.__setattr__(self, "strategy", parse_strategy(self.strategy))
    if not isinstance(self.layout, ShardLayout):
      raise TypeError(f"layout must be a ShardLayout, got {type(self.layout).__name__}")
    if not isinstance(self.axis_name, str):
      raise TypeError(
        f"axis_name must be a mesh axis name (str), got "
        f"{type(self.axis_name).__name__} ({self.axis_name!r})"
      )
    if self.implementation is not None:
      resolve_implementation(self.implementation)
    if not isinstance(self.interpret, bool):
      raise TypeError(f"interpret must be a bool, got {type(self.interpret).__name__}")
    if not isinstance(self.expert_axes, tuple) or not all(
      isinstance(a, str) for a in self.expert_axes
    ):
      raise TypeError(f"expert_axes must be a tuple of mesh axis names, got {self.expert_axes!r}")
    if self.capacity_factor is not None and (
      isinstance(self.capacity_factor, bool)
      or not isinstance(self.capacity_factor, (int, float))
      or self.capacity_factor <= 0
    ):
      raise ValueError(
        f"capacity_factor must be None or a positive number, got {self.capacity_factor!r}"
      )

  def gather(
    self, state: Any, prefix: tuple[str, ...] = (), *, skip: Iterable[tuple[str, ...]] = ()
  ) -> Any:
    """Gather whole every leaf of ``state`` stored split over ``axis_name``.

    The gather is an ``all_gather``, whose transpose reduce-scatters the gradient.

    ``prefix`` is ``state``'s path in the model's whole state (a layer's, when
    the model gathers one layer where it runs); leaves under a path in ``skip``
    stay split. Without :attr:`gathered` (state whole over cp) this is ``state``.

    Args:
      state: a pytree of the model's state (or None).
      prefix: ``state``'s path in the model's whole state.
      skip: paths whose leaves stay split.

    Returns:
      ``state`` with those leaves gathered whole.
    """
    if not self.gathered or state is None:
      return state

    def leaf(path, x):
      keys = prefix + key_names(path)
      if any(keys[: len(p)] == p for p in skip):
        return x
      return self._gathered(x, keys)

    return jax.tree_util.tree_map_with_path(leaf, state)

  def split_dim(self, path: tuple[str, ...]) -> int | None:
    """Return the dimension the leaf at ``path`` is stored split along over ``axis_name``.

    Args:
      path: the leaf's path in the model's state.

    Returns:
      The dimension, or None.
    """
    return dict(self.gathered).get(_leaf_path(path))

  def _gathered(self, x, path):
    dim = self.split_dim(path)
    return x if dim is None else jax.lax.all_gather(x, self.axis_name, axis=dim, tiled=True)

  def lookup(self, table: jax.Array, ids: jax.Array, path: tuple[str, ...]) -> jax.Array:
    """Look up ``table[ids]`` of this rank's token ids [B, L].

    A :func:`cpjax.parallel.ring_lookup` when the table at ``path`` is stored
    split over its rows, else :func:`cpjax.parallel.lookup` (the table gathered
    first if split otherwise).

    Args:
      table: the table [V, ...].
      ids: this rank's token ids [B, L].
      path: the table's path in the model's state.

    Returns:
      ``table[ids]``.
    """
    if self.split_dim(path) == 0:
      return ring_lookup(table, ids, self.axis_name)
    return lookup(self._gathered(table, path), ids)

  def head(self, head: jax.Array, path: tuple[str, ...]) -> tuple:
    """Return ``(head, head_axis)`` for :class:`HiddenStates`.

    A head stored split over its rows stays split (the loss is
    vocabulary-parallel over ``axis_name``).

    Args:
      head: the output head's weights.
      path: the head's path in the model's state.

    Returns:
      ``(head, head_axis)``: ``head_axis`` is ``axis_name`` when the head stays
      split, else None.
    """
    if self.split_dim(path) == 0:
      return head, self.axis_name
    return self._gathered(head, path), None

  def expert_options(self) -> dict:
    """Return the keywords that pass this context's expert parallelism to a mixture of experts."""
    return {"expert_axes": self.expert_axes, "capacity_factor": self.capacity_factor}

  def attention_options(self, layer_kind: str | None = None) -> dict:
    """Return the keywords that pass this context's backend to :func:`cpjax.ring_attention`.

    Args:
      layer_kind: the calling layer's kind (Gemma 4's ``"sliding_attention"``
        or ``"full_attention"``), which picks its strategy; None for a caller
        without kinds, which takes a single strategy only.

    Returns:
      ``implementation``, ``interpret`` and ``strategy``.

    Raises:
      ValueError: a strategy per layer kind, and no ``layer_kind`` to pick by.
    """
    strategy = self.strategy
    if not isinstance(strategy, str):
      if layer_kind is None:
        raise ValueError(
          f"strategy is given per layer kind ({dict(strategy)}), but this attention "
          "call names no layer kind: give one strategy for every layer (a flax "
          "model's ring_attention_fn(strategy=...), or CPContext(strategy='all_gather'))"
        )
      strategy = dict(strategy).get(layer_kind, "ring")
    return {
      "implementation": self.implementation,
      "interpret": self.interpret,
      "strategy": strategy,
    }

  def check_layer_kinds(self, kinds: Collection[str]) -> None:
    """Raise a ``ValueError`` if the per-kind strategy names a kind not in ``kinds``.

    Args:
      kinds: the layer kinds of the model this context runs.
    """
    # (self.strategy is parsed already; parsing again, a no-op, gives its type.)
    for kind, strategy in unknown_layer_kinds(parse_strategy(self.strategy), kinds):
      raise ValueError(
        f"strategy names layer kind {kind!r} ({kind}={strategy}), which this model "
        f"lacks: its layer kinds are {sorted(set(kinds))}"
      )


def unknown_layer_kinds(
  strategy: str | tuple[tuple[str, str], ...], kinds: Collection[str]
) -> list[tuple[str, str]]:
  """Return the ``(kind, name)`` pairs of a parsed strategy naming a kind not in ``kinds``.

  Args:
    strategy: one name (which names no kind) or sorted ``(kind, name)`` pairs.
    kinds: the layer kinds of a model.

  Returns:
    The pairs naming a kind the model lacks, in order.

  >>> unknown_layer_kinds((("global", "all_gather"),), ("full_attention",))
  [('global', 'all_gather')]
  """
  return [] if isinstance(strategy, str) else [p for p in strategy if p[0] not in kinds]


def parse_strategy(strategy: Any) -> str | tuple[tuple[str, str], ...]:
  """Check a CP attention strategy: one name, or one per layer kind.

  Args:
    strategy: a name of :data:`cpjax.attention.ring.STRATEGIES`; or a mapping of layer
      kinds to names, or its text ``"kind=name,kind=name"``, or its pairs.

  Returns:
    The name, or the sorted ``(kind, name)`` pairs.

  Raises:
    ValueError: a name that is not a strategy, or text that is not pairs.
    TypeError: anything else.

  >>> parse_strategy("sliding_attention=ring, full_attention=all_gather")
  (('full_attention', 'all_gather'), ('sliding_attention', 'ring'))
  """
  expected = f"one of {STRATEGIES} or a mapping of layer kinds to them"
  if isinstance(strategy, str) and "=" in strategy:
    pairs = [item.split("=") for item in strategy.split(",")]
    if any(len(p) != 2 for p in pairs):
      raise ValueError(f"strategy must be {expected} (kind=name,...), got {strategy!r}")
    pairs = [(kind.strip(), name.strip()) for kind, name in pairs]
  elif isinstance(strategy, str):
    if strategy not in STRATEGIES:
      raise ValueError(f"strategy must be {expected}, got {strategy!r}")
    return strategy
  elif isinstance(strategy, Mapping):
    pairs = list(strategy.items())
  elif isinstance(strategy, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in strategy):
    pairs = list(strategy)
  else:
    raise TypeError(f"strategy must be {expected}, got {strategy!r}")
  seen = set()
  for kind, name in pairs:
    if not isinstance(kind, str) or not kind:
      raise ValueError(f"strategy's layer kinds must be non-empty names, got {kind!r}")
    if kind in seen:
      raise ValueError(f"strategy names layer kind {kind!r} twice")
    seen.add(kind)
    if name not in STRATEGIES:
      raise ValueError(f"strategy[{kind!r}] must be one of {STRATEGIES}, got {name!r}")
  return tuple(sorted(pairs))


@dataclasses.dataclass(frozen=True)
class ContextParallelSharder:
  """What a model hands the training loop to say how its batches are sharded.

  Attributes:
    shard_batch: ``(batch, mesh, **kw) -> (sharded_batch, ShardLayout)``,
      e.g. :func:`cpjax.shard_batch` or the Gemma4 aux-only sharder.
    local_token_indices: ``(layout, rank) -> int32[L]`` global token indices.

  Example:
    >>> import cpjax
    >>> sharder = cpjax.ContextParallelSharder(cpjax.shard_batch)
    >>> sharder.local_token_indices is cpjax.local_token_indices
    True
  """

  shard_batch: Callable[..., tuple[dict, ShardLayout]]
  local_token_indices: Callable[[ShardLayout, Any], jax.Array] = local_token_indices

  def __post_init__(self):
    for name in ("shard_batch", "local_token_indices"):
      if not callable(getattr(self, name)):
        raise TypeError(f"{name} must be callable, got {getattr(self, name)!r}")


def batch_specs(batch: Mapping[str, Any]) -> dict:
  """Return the ``shard_map`` in_specs of a sharded batch: each array's own ``PartitionSpec``.

  The model's sharder decides where every key lives; this reads it back
  (``jax.typeof(x).sharding`` under ``jit`` on an Explicit mesh, the array's
  sharding outside). Keys with no named sharding (numpy arrays, scalars) are
  replicated: ``P()``.

  Args:
    batch: the sharded batch.

  Returns:
    ``{key: PartitionSpec}``.

  >>> import jax, numpy as np, cpjax
  >>> mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
  >>> batch, _ = cpjax.shard_batch({"input_ids": np.zeros((1, 6), np.int32),
  ...                               "labels": np.zeros((1, 6), np.int32)}, mesh, aux_only=True)
  >>> batch_specs(batch)["input_ids"], batch_specs(batch)["labels"]
  (P(None, None), P(None, 'cp'))
  """

  def spec(x):
    sharding = getattr(jax.typeof(x), "sharding", None) if isinstance(x, jax.Array) else None
    return sharding.spec if isinstance(sharding, NamedSharding) else P()

  return {key: spec(x) for key, x in batch.items()}


def manual_axes(mesh: Mesh, axis_name: str = "cp") -> frozenset[str]:
  """Return the mesh axes the loss's ``shard_map`` is manual over.

  They are ``axis_name`` and every axis that is not Auto.

  Auto axes (``fsdp``, ``tp`` and ``dp`` of :func:`cpjax.make_mesh`) stay the
  SPMD partitioner's: the parameters' and batch's shardings over them flow
  through the model untouched (see :mod:`cpjax.parallel`).

  Args:
    mesh: the training mesh.
    axis_name: the context-parallel mesh axis.

  Returns:
    The manual axes' names.

  >>> from cpjax.parallel import make_mesh
  >>> sorted(manual_axes(make_mesh(fsdp=2, cp=2, tp=2)))
  ['cp']
  """
  auto = {
    a for a, kind in zip(mesh.axis_names, mesh.axis_types) if kind == jax.sharding.AxisType.Auto
  }
  return frozenset(a for a in mesh.axis_names if a == axis_name or a not in auto)


def _leaf_path(keys) -> tuple[str, ...]:
  """A state leaf's path without the ``value`` a Variable adds to it."""
  keys = tuple(keys)
  return keys[:-1] if keys[-1:] == ("value",) else keys


def split_over(
  specs: Any, axis_name: str, *, skip: Callable[[tuple[str, ...]], bool] = lambda k: False
) -> tuple:
  """List the leaves whose ``PartitionSpec`` splits a dimension over ``axis_name``.

  For :attr:`CPContext.gathered`; those ``skip(path)`` rejects are left out.

  Args:
    specs: a pytree of ``PartitionSpec`` (from :func:`state_specs`).
    axis_name: the mesh axis.
    skip: ``skip(path)`` is true for the leaves to leave out.

  Returns:
    ``((path, dim), ...)``, sorted: the leaves whose ``PartitionSpec`` splits
    ``dim`` over ``axis_name``.
  """
  split = {}
  for path, spec in jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, P)):
    keys = _leaf_path(key_names(path))
    for dim, part in enumerate(spec):
      if axis_name in (part if isinstance(part, tuple) else (part,)) and not skip(keys):
        split[keys] = dim
  return tuple(sorted(split.items()))


def state_specs(state: Any, axes: Collection[str]) -> Any:
  """Return the ``shard_map`` in_specs of parameters (or frozen state).

  For a ``shard_map`` manual over ``axes``: ``P()`` for every leaf but those
  stored split over one of ``axes`` (experts over ``cp``), which enter split as
  they are stored (read from ``jax.typeof(x).sharding`` under ``jit``, which
  names the Explicit axes).

  Args:
    state: the parameters (or frozen state), or None.
    axes: the mesh axes the ``shard_map`` is manual over.

  Returns:
    A ``PartitionSpec`` per leaf (``P()`` when ``state`` is None).
  """
  if state is None:
    return P()

  def spec(x):
    sharding = getattr(jax.typeof(x), "sharding", None) if isinstance(x, jax.Array) else None
    if not isinstance(sharding, NamedSharding):
      return P()
    parts = []
    for part in sharding.spec:
      names = part if isinstance(part, tuple) else (part,) if part else ()
      kept = tuple(n for n in names if n in axes)
      parts.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    while parts and parts[-1] is None:
      parts.pop()
    return P(*parts)

  return jax.tree.map(spec, state)
