"""Ring attention for your own Flax NNX model: an ``attention_fn`` and a CP context.

``nnx.MultiHeadAttention(..., attention_fn=cpjax.ring_attention_fn())`` runs
its attention through :func:`cpjax.ring_attention`. The module does not know
whether it runs context-parallel: that is said where the model is called,

* inside ``shard_map`` under ``with cpjax.use_cp(cp):`` (``cp`` a
  :class:`cpjax.CPContext`, the one :func:`cpjax.training.step.make_train_step` hands
  its ``forward``), every attention call is a ring over ``cp.axis_name``;
* outside any context, the same call is exact attention over the whole
  sequence on one device (the ring with ``cp_size = 1``: no collectives).

The mask travels as the module's ``mask=`` argument: a
:class:`cpjax.AttentionMask` whose arrays hold the tokens the call sees
([B, L] under CP), or None for plain causal (``is_causal=True``) or full
attention.

Shape letters: ``B`` batch, ``L`` tokens on this device, ``H``/``Hkv`` query
and key/value heads, ``D`` head dim.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Generator

import jax.numpy as jnp

from cpjax.attention.cp_context import CPContext
from cpjax.attention.ring import STRATEGIES, ring_attention
from cpjax.attention.ring.kernels import resolve_implementation
from cpjax.batch.layout import ShardLayout
from cpjax.masks import AttentionMask

__all__ = ["use_cp", "current_context", "ring_attention_fn"]

_CONTEXT: contextvars.ContextVar[CPContext | None] = contextvars.ContextVar(
  "cpjax_context_parallel", default=None
)


@contextlib.contextmanager
def use_cp(cp: CPContext | None) -> Generator[CPContext | None, None, None]:
  """Run the :func:`ring_attention_fn` calls traced inside as a ring described by ``cp``.

  ``cp=None`` leaves them single-device, so one ``forward`` serves both runs.
  It is read while tracing: enter it inside the function that ``shard_map``
  (or :func:`cpjax.training.step.make_train_step`) traces.

  >>> import cpjax
  >>> with cpjax.use_cp(cpjax.CPContext(cpjax.ShardLayout(8, 8, 2))) as cp:
  ...   cpjax.attention.flax_attention.current_context() is cp
  True
  """
  if cp is not None and not isinstance(cp, CPContext):
    raise TypeError(f"cp must be a cpjax.CPContext or None, got {type(cp).__name__}")
  token = _CONTEXT.set(cp)
  try:
    yield cp
  finally:
    _CONTEXT.reset(token)


def current_context() -> CPContext | None:
  """Return the innermost :func:`use_cp` context, or None."""
  return _CONTEXT.get()


def ring_attention_fn(
  *,
  scale: float | None = None,
  logits_soft_cap: float | None = None,
  block_q: int | None = None,
  block_kv: int | None = None,
  implementation: str | None = None,
  interpret: bool | None = None,
  strategy: str | None = None,
) -> Callable:
  """Make an ``attention_fn`` for ``flax.nnx.MultiHeadAttention`` that runs on the ring.

  The returned function takes flax's arguments ``(query [B, L, H, D], key,
  value [B, L, Hkv, D], bias=None, mask=None, ..., is_causal=False)`` and
  returns [B, L, H, D]. ``mask`` is a :class:`cpjax.AttentionMask` or None
  (then ``is_causal`` picks causal or full attention). Dense mask arrays,
  ``bias``, attention dropout and ``precision`` have no ring equivalent and
  are a ``TypeError`` / ``ValueError``, never ignored.

  Args:
    scale, logits_soft_cap, block_q, block_kv: as :func:`cpjax.ring_attention`.
    implementation, interpret, strategy: as :func:`cpjax.ring_attention`;
      None takes them from the active :class:`cpjax.CPContext` (its defaults
      outside one).

  Returns:
    The ``attention_fn``.

  Example:
    >>> import jax, numpy as np, cpjax
    >>> from flax import nnx
    >>> attn = nnx.MultiHeadAttention(2, 8, decode=False, rngs=nnx.Rngs(0),
    ...                               attention_fn=cpjax.ring_attention_fn())
    >>> x = np.random.default_rng(0).standard_normal((1, 6, 8), np.float32)
    >>> docs = np.array([[1, 1, 1, 2, 2, 2]])
    >>> out = attn(x, mask=cpjax.AttentionMask.create(document_ids=docs))   # one device
    >>> plain = nnx.MultiHeadAttention(2, 8, decode=False, rngs=nnx.Rngs(0))
    >>> dense = cpjax.AttentionMask.create(document_ids=docs).allowed()[:, None]
    >>> bool(np.allclose(out, plain(x, mask=dense), atol=1e-5))
    True
  """
  if implementation is not None:
    resolve_implementation(implementation)
  if interpret is not None and not isinstance(interpret, bool):
    raise TypeError(f"interpret must be a bool or None, got {type(interpret).__name__}")
  if strategy is not None and strategy not in STRATEGIES:
    raise ValueError(f"strategy must be one of {STRATEGIES} or None, got {strategy!r}")

  def attention_fn(
    query,
    key,
    value,
    bias=None,
    mask=None,
    broadcast_dropout: bool = True,
    dropout_rng=None,
    dropout_rate: float = 0.0,
    deterministic: bool = True,
    dtype=None,
    precision=None,
    module=None,
    is_causal: object = False,  # read for its truth value, as flax reads it
    **unused,
  ):
    if unused:
      raise TypeError(f"ring_attention_fn got unexpected arguments {sorted(unused)}")
    del broadcast_dropout, dropout_rng
    if bias is not None:
      raise ValueError("ring_attention_fn takes no bias: express the rule as an AttentionMask")
    if dropout_rate > 0.0 and not deterministic:
      raise ValueError(
        f"ring_attention_fn has no attention dropout, got dropout_rate="
        f"{dropout_rate} with deterministic=False"
      )
    if precision is not None:
      raise ValueError(
        f"ring_attention_fn multiplies in the inputs' dtype with float32 "
        f"accumulation; precision must be None, got {precision!r}"
      )
    if module is not None:
      raise ValueError(
        "ring_attention_fn never materialises attention weights: sow_weights=True is not supported"
      )
    if mask is not None and not isinstance(mask, AttentionMask):
      raise TypeError(
        f"mask must be a cpjax.AttentionMask (a dense [B, H, Q, K] mask cannot "
        f"travel the ring), got {type(mask).__name__}"
      )
    if mask is not None and is_causal:
      raise ValueError("pass either is_causal=True or an AttentionMask, not both")
    if mask is None:
      mask = AttentionMask.create(causal=bool(is_causal))
    if dtype is not None:
      query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    cp = current_context()
    if cp is None:
      length = jnp.shape(query)[-3]
      cp = CPContext(ShardLayout(length, length, 1))
    options = cp.attention_options()
    if implementation is not None:
      options["implementation"] = implementation
    if interpret is not None:
      options["interpret"] = interpret
    if strategy is not None:
      options["strategy"] = strategy
    return ring_attention(
      query,
      key,
      value,
      layout=cp.layout,
      axis_name=cp.axis_name,
      mask=mask,
      scale=scale,
      logits_soft_cap=logits_soft_cap,
      block_q=block_q,
      block_kv=block_kv,
      **options,
    )

  return attention_fn
