"""LoRA adapters on a Flax NNX model, with qwix: create, split, count and merge them.

The method, the initialisation and the targets are described in
:mod:`cpjax.training.lora`; PEFT's files are :mod:`cpjax.training.lora.peft_format`.

Shape letters: ``I`` a projection's input width, ``O`` its output width,
``r`` the rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any, Literal, Optional, TypeVar, Union, cast

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx

from cpjax.parallel import linear_tracing
from cpjax.training.lora.quantize import (
  QUANTIZED_DTYPES,
  QUANTIZED_MODULES,
  qtype,
  quantize_experts,
)

__all__ = [
  "DEFAULT_LORA_PARAMETERS",
  "DEFAULT_LORA_TARGETS",
  "LoraConfig",
  "adapted_modules",
  "apply_lora",
  "check_lora_config",
  "lora_param_count",
  "merge_lora",
  "split_lora",
]

# The attention and MLP projections of Gemma 4's text decoder, by the names
# PEFT users know (q_proj ... down_proj). Restricted to the language model:
# the vision tower's projections share the names but are clipped linears
# (``q_proj.linear`` holds the weight), and PEFT cannot adapt those wrappers.
DEFAULT_LORA_TARGETS = (
  r".*language_model\.layers\.\d+\."
  r"(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
)

# The MoE experts' tensors (PEFT's target_parameters): most of an MoE's
# weights, adapted per expert. A model without experts has none to match.
DEFAULT_LORA_PARAMETERS = r".*language_model\.layers\.\d+\.experts\.(gate_up_proj|down_proj)"

# A model's own class: adapting and merging keep it (qwix's adapted model is an
# instance of a subclass of it).
_Model = TypeVar("_Model", bound=nnx.Module)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters on a frozen base instead of every weight (PEFT's format).

  What :func:`apply_lora` builds, the ``lora`` section of a run config
  (:class:`cpjax.training.run_config.RunConfig`), and what a PEFT
  ``adapter_config.json`` reads into (:func:`read_adapter_config`).

  >>> LoraConfig(rank=4, alpha=16.0).scale
  4.0
  """

  rank: Optional[int] = dataclasses.field(default=None, metadata={"positive": True})
  """train rank-R adapters; the base is frozen (default: train every weight)"""
  alpha: float = dataclasses.field(default=8.0, metadata={"positive": True})
  """the adapters' scale is alpha / rank (PEFT's default 8)"""
  targets: Union[str, tuple[str, ...]] = DEFAULT_LORA_TARGETS
  """modules to adapt: a regex matched in full against paths such as
  model.language_model.layers.0.self_attn.q_proj, or a list of module names
  (PEFT's target_modules; default: the decoder's q/k/v/o and gate/up/down
  projections; () for none)"""
  target_parameters: Union[str, tuple[str, ...]] = DEFAULT_LORA_PARAMETERS
  """tensors to adapt inside the module that runs them, per expert (PEFT's
  target_parameters): a regex matched in full against paths such as
  model.language_model.layers.0.experts.gate_up_proj, or a list of
  parameter names; () for none (default: the MoE experts' gate_up_proj and
  down_proj, where the model has experts)"""
  use_rslora: bool = False
  """rank-stabilised LoRA: scale by alpha / sqrt(rank) instead"""
  base_dtype: Literal["float32", "bfloat16", "int8", "int4", "nf4", "float8_e4m3fn"] = "float32"
  """the frozen base's storage: float32 or bfloat16 (cpjax train casts the
  base to it), or quantized (QLoRA: the decoder's projections and the
  experts in int8, int4, nf4 or float8_e4m3fn, through qwix; the rest in
  bfloat16)"""
  group_size: Optional[int] = dataclasses.field(default=None, metadata={"positive": True})
  """with a quantized base: one scale per this many input values of each
  output channel (default: one scale per output channel)"""
  merge: bool = False
  """with checkpointing.save: write the base with the adapter merged in,
  instead of the adapter"""

  def __post_init__(self):
    for field in ("targets", "target_parameters"):  # PEFT's JSON lists of names
      if isinstance(getattr(self, field), list):
        object.__setattr__(self, field, tuple(getattr(self, field)))

  @property
  def scale(self) -> float:
    """The adapters' factor: ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA)."""
    if self.rank is None:
      raise TypeError("LoraConfig.scale needs a rank (rank=None: no adapters)")
    return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

  def matches(self, path: str) -> bool:
    """Check whether the module at dotted ``path`` is a target (PEFT's rule).

    Args:
      path: the module's dotted path.

    Returns:
      Whether the module is a target.
    """
    return _matches(self.targets, path)

  def matches_parameter(self, path: str) -> bool:
    """Check whether the parameter at dotted ``path`` is a target (PEFT's rule).

    Args:
      path: the parameter's dotted path (its module's, then its name).

    Returns:
      Whether ``target_parameters`` names it.
    """
    return _matches(self.target_parameters, path)


def _matches(targets: Union[str, tuple[str, ...]], path: str) -> bool:
  """PEFT's rule: a regex matched in full, or names that are the path or end it."""
  if isinstance(targets, str):
    return re.fullmatch(targets, path) is not None
  return any(path == t or path.endswith("." + t) for t in targets)


def check_lora_config(
  config: LoraConfig, *, name: Callable[[str], str] = lambda field: f"LoRA {field}"
) -> None:
  """Check that :func:`apply_lora` can build ``config``.

  Args:
    config: the adapters' settings.
    name: how a message names a field (the run config says ``lora.rank``).

  Raises:
    ValueError: a rank that is not an integer >= 1, an alpha that is not a
      positive number, targets that are not a regular expression, or no
      targets at all.
    TypeError: targets that are neither a string nor a tuple of names.

  >>> check_lora_config(LoraConfig(rank=0))
  Traceback (most recent call last):
  ...
  ValueError: LoRA rank must be an integer >= 1, got 0
  """
  if not isinstance(config, LoraConfig):
    raise TypeError(f"expected a LoraConfig, got {type(config).__name__}")
  rank, alpha = config.rank, config.alpha
  if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
    raise ValueError(f"{name('rank')} must be an integer >= 1, got {rank!r}")
  if (
    isinstance(alpha, bool)
    or not isinstance(alpha, (int, float))
    or not (math.isfinite(alpha) and alpha > 0)
  ):
    raise ValueError(f"{name('alpha')} must be a positive number, got {alpha!r}")
  for field in ("targets", "target_parameters"):
    value = getattr(config, field)
    if isinstance(value, str):
      try:
        re.compile(value)
      except re.error as e:
        raise ValueError(f"{name(field)} {value!r} is not a regular expression: {e}") from None
    elif not (isinstance(value, tuple) and all(isinstance(t, str) and t for t in value)):
      raise TypeError(
        f"{name(field)} must be a regex string or a tuple of names ((): none), got {value!r}"
      )
  if config.base_dtype not in ("float32", "bfloat16", *QUANTIZED_DTYPES):
    raise ValueError(
      f"{name('base_dtype')} must be one of float32, bfloat16, {', '.join(QUANTIZED_DTYPES)}; "
      f"got {config.base_dtype!r}"
    )
  group = config.group_size
  if group is not None:
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
      raise ValueError(f"{name('group_size')} must be an integer >= 1, got {group!r}")
    if config.base_dtype not in QUANTIZED_DTYPES:
      raise ValueError(
        f"{name('group_size')} sets a quantized base's scales; {name('base_dtype')} "
        f"{config.base_dtype} is not quantized ({', '.join(QUANTIZED_DTYPES)} are)"
      )
  if config.targets == () and config.target_parameters == ():
    raise ValueError(
      f"{name('targets')} and {name('target_parameters')} are both empty: nothing to adapt"
    )


def _peft_init(key, shape, dtype=jnp.float32):
  """PEFT's ``A``: ``kaiming_uniform_(a=sqrt(5))`` of the [r, I] weight,
  i.e. uniform in ``±1/sqrt(I)``; here [I, r]. Always float32."""
  del dtype
  bound = 1.0 / math.sqrt(math.prod(shape[:-1]))
  return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


def _zeros(key, shape, dtype=jnp.float32):
  del key, dtype
  return jnp.zeros(shape, jnp.float32)


def _provider(adapted: list[str], frozen: list[str], settings: LoraConfig):
  """qwix's LoRA provider, with PEFT's numerics: float32 adapters whose sum
  with the base projection is cast back to the base output's dtype; under a
  quantized base, the ``adapted`` and ``frozen`` projections that
  :data:`QUANTIZED_MODULES` names are quantized too."""

  class PeftNumerics(qwix.LoraProvider):
    def einsum(self, einsum_str, *operands, **kwargs):
      dtype = kwargs.get("preferred_element_type") or jnp.result_type(*operands)
      return super().einsum(einsum_str, *operands, **kwargs).astype(dtype)

    def dot_general(
      self,
      lhs,
      rhs,
      dimension_numbers,
      precision=None,
      preferred_element_type=None,
      out_sharding=None,
    ):
      dtype = preferred_element_type or jnp.result_type(lhs, rhs)
      return (
        super()
        .dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding)
        .astype(dtype)
      )

  # qwix divides alpha by the rank; rsLoRA divides by its square root.
  assert settings.rank is not None  # check_lora_config passed it
  alpha = settings.alpha * (math.sqrt(settings.rank) if settings.use_rslora else 1.0)
  quantized = settings.base_dtype in QUANTIZED_DTYPES
  weight_qtype = qtype(settings.base_dtype) if quantized else None
  tile_size = settings.group_size if quantized else None

  def adapters(paths: list[str], quantize: bool) -> qwix.LoraRule:
    return qwix.LoraRule(
      module_path=_paths(paths),
      rank=settings.rank,
      alpha=alpha,
      lora_a_initializer=_peft_init,
      lora_b_initializer=_zeros,
      weight_qtype=weight_qtype if quantize else None,
      tile_size=tile_size if quantize else None,
    )

  in_base = [p for p in adapted if quantized and re.fullmatch(QUANTIZED_MODULES, p)]
  plain = sorted(set(adapted) - set(in_base))
  rules: list[qwix.QuantizationRule] = []
  if in_base:
    rules.append(adapters(in_base, quantize=True))
  if plain:
    rules.append(adapters(plain, quantize=False))
  if frozen:
    rules.append(
      qwix.QuantizationRule(
        module_path=_paths(frozen), weight_qtype=weight_qtype, tile_size=tile_size
      )
    )
  return PeftNumerics(rules)


def _paths(paths: list[str]) -> str:
  """qwix's module_path regex of exactly these dotted module paths."""
  return "|".join(re.escape(p.replace(".", "/")) for p in paths)


def module_paths(model: nnx.Module) -> dict[str, Any]:
  """Return {dotted path: module} of every submodule of ``model`` (not the root)."""
  return {".".join(str(p) for p in path): m for path, m in nnx.iter_modules(model) if path}


def adapted_modules(model: nnx.Module) -> dict[str, nnx.Module]:
  """Find every module that holds adapters (see :func:`apply_lora`'s example).

  Args:
    model: the model.

  Returns:
    {dotted module path: module} of every module that holds adapters.
  """
  return {
    path: m
    for path, m in module_paths(model).items()
    if any(isinstance(v, nnx.LoRAParam) for v in vars(m).values())
  }


def adapter_pairs(module: nnx.Module) -> dict[str, tuple[nnx.LoRAParam, nnx.LoRAParam]]:
  """Return {base parameter name: (A, B)} of one adapted module."""
  pairs = {}
  for name, value in vars(module).items():
    if isinstance(value, nnx.LoRAParam) and name.endswith("_lora_a"):
      base = name[: -len("_lora_a")]
      pairs[base] = (value, getattr(module, base + "_lora_b"))
  return pairs


def _example_inputs(model):
  """The model's own example inputs (its ``example_inputs()`` method: a
  Gemma 4 makes a one-row, 8-token batch)."""
  make = getattr(model, "example_inputs", None)
  if callable(make):
    return make()
  raise TypeError(
    f"apply_lora needs example inputs for a {type(model).__name__}: the model "
    f"runs once on them to create its adapters (pass them after the model, or "
    f"give the model an example_inputs() method returning (args, kwargs))"
  )


def apply_lora(
  model: _Model,
  config: LoraConfig,
  *example_inputs: Any,
  seed: int = 0,
  method: str | None = None,
  **example_kwargs: Any,
) -> _Model:
  """Add LoRA adapters to a copy of ``model`` on ``config.targets``' projections
  and ``config.target_parameters``' expert tensors.

  qwix runs the model once on ``example_inputs`` (any values of the right
  structure; without them, the model's own ``example_inputs()`` method's
  ``(args, kwargs)``: a Gemma 4 makes an 8-token batch) to create the adapters.
  That pass is one compiled program, cached with the model's structure (the
  forward feeds no output, so only the adapters' init runs); a forward that
  reads its values in Python (``float(x)``, ``if x > 0``) runs it eagerly.
  The adapted model shares the base's arrays. Adapters are float32, ``A``
  seeded by ``seed``; the base keeps its dtype.
  A tensor of ``target_parameters`` ([E, out, in], in a module that lists
  it in ``lora_parameters``: Gemma 4's experts) gains per-expert factors
  ``<name>_lora_a`` [E, in, r] and ``<name>_lora_b`` [E, r, out], which
  the module applies itself.

  Args:
    model: a Flax NNX module without adapters.
    config: the rank, alpha, targets and scaling (``base_dtype`` and
      ``merge`` are the trainer's: not read here).
    *example_inputs, **example_kwargs: what the model runs on once.
    seed: seeds ``A``.
    method: the model method qwix intercepts: default ``hidden_states``
      when the model has one (Gemma 4; its ``__call__`` goes through it),
      else ``__call__``.

  Returns:
    The adapted model; its ``lora_config`` is ``config``.

  Raises ``ValueError`` when the targets match nothing, a target matches a
  module that runs no intercepted product on a parameter of its own (an
  MoE expert tensor, a container module, a weight applied with ``@``), or
  ``target_parameters`` names a tensor its module cannot adapt (or, set
  by the user, none at all).

  Example (any NNX model):
    >>> class Tiny(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.up = nnx.Linear(4, 8, rngs=rngs)
    ...     self.down = nnx.Linear(8, 2, rngs=rngs)
    ...   def __call__(self, x):
    ...     return self.down(jax.nn.relu(self.up(x)))
    >>> base = Tiny(nnx.Rngs(0))
    >>> x = np.ones((3, 4), np.float32)
    >>> model = apply_lora(base, LoraConfig(rank=2, alpha=4.0, targets=("up", "down")), x)
    >>> sorted(adapted_modules(model)), model.up.kernel_lora_a.shape, model.up.kernel_lora_b.shape
    (['down', 'up'], (4, 2), (2, 8))
    >>> bool(jnp.array_equal(model(x), base(x)))        # B starts at zero
    True
    >>> graphdef, adapters, frozen = split_lora(model)
    >>> lora_param_count(model)                          # (4 + 8) * 2 + (8 + 2) * 2
    44
  """
  if not isinstance(config, LoraConfig):
    raise TypeError(
      f"apply_lora's config must be a LoraConfig (LoraConfig(rank=...)), got "
      f"{type(config).__name__}"
    )
  check_lora_config(config)
  settings = config
  if not isinstance(model, nnx.Module):
    raise TypeError(f"apply_lora takes a Flax NNX module, got {type(model).__name__}")
  if adapted_modules(model):
    raise ValueError(
      "the model already has LoRA adapters: merge them (merge_lora) or start from the base model"
    )
  paths = module_paths(model)
  matched = sorted(p for p in paths if settings.matches(p))
  tensors = parameter_targets(model, settings)
  if not matched and not tensors:
    raise ValueError(
      f"LoRA targets {settings.targets!r} match no module of the "
      f"{type(model).__name__}; its modules are e.g. {sorted(paths)[:8]}"
    )
  quantized = settings.base_dtype in QUANTIZED_DTYPES
  frozen = [
    p
    for p in sorted(paths)
    if quantized and re.fullmatch(QUANTIZED_MODULES, p) and p not in matched
  ]
  if quantized:
    _check_group_size(model, settings)
  if matched or frozen:
    adapted = _adapt_modules(
      model, settings, matched, frozen, method, seed, example_inputs, example_kwargs
    )
  else:
    adapted = nnx.clone(model)
  _adapt_parameters(adapted, settings, tensors, seed)
  if quantized:
    assert settings.base_dtype is not None
    quantize_experts(adapted, settings.base_dtype, settings.group_size)
  setattr(adapted, "lora_config", settings)  # read back by adapter_settings
  # qwix types it as any NNX module; it is an instance of a subclass of model's class.
  return cast(_Model, adapted)


def apply_lora_lazily(
  make: Callable[[], _Model],
  config: LoraConfig,
  *example_inputs: Any,
  seed: int = 0,
  method: str | None = None,
  materialize_adapters: bool = True,
  **example_kwargs: Any,
) -> _Model:
  """Add LoRA adapters, as :func:`apply_lora` does, to ``make()``'s model, its base left abstract.

  For a base too large to hold in its checkpoint's dtype beside its
  quantized copy (26B-A4B's bfloat16 is 52 GB): the adapted model is built
  with ``nnx.eval_shape``, so every base weight is a ``jax.ShapeDtypeStruct``
  (a QArray of them where ``config`` quantizes it), for a loader to fill
  (:func:`cpjax.models.gemma4.checkpoint.load_weights` reads a checkpoint
  into it, quantizing tensor by tensor). The adapters are made for real: an
  adapter's first value never depends on its base's (``A`` is random,
  ``B`` zero), so they are those of ``apply_lora(make(), config, seed=seed)``,
  computed by one jitted program whose random base is dead code that XLA
  drops.

  Args:
    make: builds the base model (a random init is fine: it is never made).
    config, *example_inputs, seed, method, **example_kwargs: as
      :func:`apply_lora`.
    materialize_adapters: False leaves the adapters abstract too (a
      memory plan's whole model, traced in seconds at 26B-A4B's size).

  Returns:
    The adapted model: adapters concrete, base abstract.

  Example:
    >>> class Tiny(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.up = nnx.Linear(4, 8, rngs=rngs)
    ...   def __call__(self, x):
    ...     return self.up(x)
    >>> settings = LoraConfig(rank=2, alpha=4.0, targets=("up",))
    >>> x = np.ones((3, 4), np.float32)
    >>> lazy = apply_lora_lazily(lambda: Tiny(nnx.Rngs(0)), settings, x, seed=1)
    >>> type(lazy.up.kernel.get_value()).__name__          # the base: abstract
    'ShapeDtypeStruct'
    >>> eager = apply_lora(Tiny(nnx.Rngs(0)), settings, x, seed=1)
    >>> bool(jnp.array_equal(lazy.up.kernel_lora_a.get_value(), eager.up.kernel_lora_a.get_value()))
    True
  """

  def adapt():
    return apply_lora(make(), config, *example_inputs, seed=seed, method=method, **example_kwargs)

  with linear_tracing():
    model = nnx.eval_shape(adapt)
    if materialize_adapters:
      nnx.update(model, jax.jit(lambda: nnx.state(adapt(), nnx.LoRAParam))())
  return model


def _adapt_modules(
  model, settings: LoraConfig, matched: list[str], frozen: list[str], method, seed, args, kwargs
):
  """qwix's adapters on the ``matched`` modules' projections, and a quantized
  base's ``frozen`` ones quantized (a copy of ``model``)."""
  if method is None:
    method = "hidden_states" if callable(getattr(model, "hidden_states", None)) else "__call__"
  if not args and not kwargs:
    args, kwargs = _example_inputs(model)
  # The creation pass must run the layers in place: a rematerialised layer
  # runs on a copy of its state, and the adapters made there would be lost.
  remat = getattr(model, "remat", None)
  if remat not in (None, "none"):
    setattr(model, "remat", "none")  # the model's own setting, when it has one
  try:
    with _auto_typed(model) as restore:
      key = (settings, tuple(matched), tuple(frozen), method, seed)
      try:
        adapted = _compiled_creation_pass(model, key, args, kwargs)
      except (jax.errors.JAXTypeError, _Unhashable):
        # A forward that reads its values in Python (or example inputs jit
        # cannot key on) runs eagerly, as qwix's own pass does.
        adapted = _creation_pass(model, key, args, kwargs)
      restore(adapted)
  finally:
    if remat not in (None, "none"):
      setattr(model, "remat", remat)
  if remat not in (None, "none"):
    setattr(adapted, "remat", remat)
  missing = sorted(set(matched) - set(adapted_modules(adapted)))
  if missing:
    raise ValueError(
      f"LoRA targets {settings.targets!r} match modules that cannot carry "
      f"adapters (no jnp.einsum / lax.dot_general / jnp.dot on a parameter of "
      f"their own while {method} runs): {missing[:6]}"
      f"{' ...' if len(missing) > 6 else ''}"
    )
  return adapted


def _creation_pass(model: nnx.Module, key: tuple, args: tuple, kwargs: dict) -> nnx.Module:
  """qwix's creation pass: a copy of ``model`` run once on ``args`` and
  ``kwargs``, its adapters made as its targets' products run (``key``:
  settings, matched and frozen paths, method and seed)."""
  settings, matched, frozen, method, seed = key
  adapted = qwix.apply_lora_to_model(
    model,
    _provider(list(matched), list(frozen), settings),
    *args,
    rngs=nnx.Rngs(seed),
    methods=(method,),
    **kwargs,
  )
  assert isinstance(adapted, nnx.Module)  # qwix returns the kind of model it was given
  return adapted


class _Unhashable(Exception):
  """Example inputs with a leaf that is neither an array nor hashable."""


class _Adapted:
  """The adapted model's graph, and which of its leaves are the base's,
  carried out of the compiled pass as a pytree without leaves (so jit keeps
  it with the compiled program: a second pass on the same model is a cache hit).

  ``sources[i]`` is the index among the base's leaves of the adapted
  model's leaf ``i``, or None for a leaf the pass made (an adapter, a
  quantized weight)."""

  def __init__(self, graphdef, treedef, sources: tuple[int | None, ...]):
    self.graphdef, self.treedef, self.sources = graphdef, treedef, sources


jax.tree_util.register_pytree_node(_Adapted, lambda a: ((), a), lambda a, _: a)


@jax.jit(static_argnums=(0, 2, 4), keep_unused=True)
def _creation_program(graphdef, state, key, arrays, inputs):
  """The creation pass traced on ``nnx.merge(graphdef, state)``: returns the
  :class:`_Adapted` structure and the leaves the pass made. The forward the
  pass runs feeds no output, so XLA drops it: what runs is the adapters' init.
  The base stays an input (``keep_unused``), so the program runs on its
  devices and the adapters come out replicated on its mesh, not on one device."""
  treedef, static = inputs
  fill = iter(arrays)
  args, kwargs = jax.tree.unflatten(treedef, [next(fill) if s is _ARRAY else s for s in static])
  base = jax.tree.leaves(state)
  adapted = _creation_pass(nnx.merge(graphdef, state), key, args, kwargs)
  out_graphdef, out_state = nnx.split(adapted)
  leaves, out_treedef = jax.tree.flatten(out_state)
  index = {id(x): i for i, x in enumerate(base)}
  sources = tuple(index.get(id(x)) for x in leaves)
  made = [x for x, s in zip(leaves, sources) if s is None]
  return _Adapted(out_graphdef, out_treedef, sources), made


_ARRAY = object()  # marks an example input's array leaf in the static half


def _compiled_creation_pass(model: nnx.Module, key: tuple, args: tuple, kwargs: dict) -> nnx.Module:
  """:func:`_creation_pass` as one compiled program; the adapted model shares
  ``model``'s arrays wherever the pass kept them.

  Run eagerly, the pass is hundreds of one-operation programs, each
  compiled the first time its shapes are seen (10 s for a 2-layer MoE on
  CPU, and a forward run on the chip); compiled, it is one small program,
  cached with the model's structure."""
  graphdef, state = nnx.split(model)
  leaves, treedef = jax.tree.flatten((args, kwargs))
  is_array = [isinstance(x, (jax.Array, np.ndarray)) for x in leaves]
  static = tuple(_ARRAY if a else x for x, a in zip(leaves, is_array))
  try:
    hash(static)
  except TypeError:
    raise _Unhashable from None
  arrays = [x for x, a in zip(leaves, is_array) if a]
  with linear_tracing():
    adapted, made = _creation_program(graphdef, state, key, arrays, (treedef, static))
  base, fill = jax.tree.leaves(state), iter(made)
  out = [next(fill) if s is None else base[s] for s in adapted.sources]
  return nnx.merge(adapted.graphdef, jax.tree.unflatten(adapted.treedef, out))


def _check_group_size(model: nnx.Module, settings: LoraConfig) -> None:
  """A ``ValueError`` naming ``group_size`` and the first weight whose input
  width it does not divide (a quantized projection's, or an expert tensor's)."""
  group = settings.group_size
  if group is None:
    return
  widths = {
    f"{p}.weight": m.weight.shape[-1]
    for p, m in module_paths(model).items()
    if re.fullmatch(QUANTIZED_MODULES, p) and hasattr(m, "weight")
  }
  widths.update({p: getattr(m, n).shape[-1] for p, (m, n) in _expert_tensors(model).items()})
  for path, width in widths.items():
    if width % group:
      raise ValueError(
        f"LoRA group_size {group} does not divide {path}'s input width {width}: "
        f"give a divisor of every quantized weight's input width, or none (per-channel scales)"
      )


def _expert_tensors(model: nnx.Module) -> dict[str, tuple[nnx.Module, str]]:
  """{path: (module, name)} of every tensor a module lists in ``lora_parameters``."""
  return {
    p: (m, n)
    for p, (m, n) in parameter_paths(model).items()
    if n in getattr(m, "lora_parameters", ())
  }


def parameter_paths(model: nnx.Module) -> dict[str, tuple[nnx.Module, str]]:
  """Return {dotted parameter path: (its module, its name)} of every parameter held
  directly by a submodule of ``model``."""
  out = {}
  for path, module in module_paths(model).items():
    for name, value in vars(module).items():
      if isinstance(value, nnx.Param) and not isinstance(value, nnx.LoRAParam):
        out[f"{path}.{name}"] = (module, name)
  return out


def parameter_targets(model: nnx.Module, settings: LoraConfig) -> list[str]:
  """Find the parameter paths ``target_parameters`` names, each one its module
  can adapt (named in the module's ``lora_parameters``): a ``ValueError``
  names any other, and a setting of the user's that names nothing."""
  found = parameter_paths(model)
  matched = sorted(p for p in found if settings.matches_parameter(p))
  refused = [p for p in matched if found[p][1] not in getattr(found[p][0], "lora_parameters", ())]
  if refused:
    raise ValueError(
      f"LoRA target_parameters {settings.target_parameters!r} name tensors cpjax "
      f"cannot adapt: {refused[:6]}{' ...' if len(refused) > 6 else ''} (it adapts "
      f"the tensors a module lists in lora_parameters, such as an MoE's "
      f"experts.gate_up_proj and experts.down_proj)"
    )
  # The default adapts the experts where there are some; a setting the user
  # wrote must name something.
  if not matched and settings.target_parameters not in ((), DEFAULT_LORA_PARAMETERS):
    adaptable = sorted(p for p, (m, n) in found.items() if n in getattr(m, "lora_parameters", ()))
    raise ValueError(
      f"LoRA target_parameters {settings.target_parameters!r} match no tensor of "
      f"the {type(model).__name__} (those it can adapt: {adaptable[:4] or 'none'})"
    )
  return matched


def _adapt_parameters(model: nnx.Module, settings: LoraConfig, paths: list[str], seed: int):
  """Per-expert factors on each tensor of ``paths`` ([E, out, in]): ``A`` [E, in, r]
  as PEFT draws it (uniform in ``±1/sqrt(in)``), ``B`` [E, r, out] zero, both
  float32 and split over the mesh as their tensor's leading dimension is."""
  assert settings.rank is not None  # check_lora_config passed it
  found = parameter_paths(model)
  key = jax.random.key(seed)
  for i, path in enumerate(paths):
    module, name = found[path]
    weight = getattr(module, name)[...]
    if weight.ndim != 3:
      raise ValueError(
        f"LoRA target_parameters: {path} is {weight.shape}; per-expert adapters "
        f"need an [experts, out, in] tensor"
      )
    e, out, fan_in = weight.shape
    bound = 1.0 / math.sqrt(fan_in)
    a = jax.random.uniform(
      jax.random.fold_in(key, i), (e, fan_in, settings.rank), jnp.float32, -bound, bound
    )
    b = jnp.zeros((e, settings.rank, out), jnp.float32)
    a, b = _placed_like(a, weight), _placed_like(b, weight)
    setattr(module, name + "_lora_a", nnx.LoRAParam(a))
    setattr(module, name + "_lora_b", nnx.LoRAParam(b))
    setattr(module, "lora_scale", settings.scale)


def _placed_like(x: jax.Array, weight: jax.Array) -> jax.Array:
  """``x`` [E, ...] split over the mesh axes that split ``weight``'s leading dimension."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  sharding = getattr(weight, "sharding", None)
  if not isinstance(sharding, NamedSharding):
    return x
  lead = sharding.spec[0] if len(sharding.spec) else None
  return jax.device_put(x, NamedSharding(sharding.mesh, P(lead, *([None] * (x.ndim - 1)))))


def _retyped(model: nnx.Module, retype) -> None:
  """Re-places every array of ``model`` on the mesh ``retype(mesh)`` with the
  same devices and spec (no data moves), in place."""
  from jax.sharding import NamedSharding

  graphdef, state = nnx.split(model)

  def place(x):
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding):
      return x
    mesh = retype(sharding.mesh)
    return x if mesh is sharding.mesh else jax.device_put(x, NamedSharding(mesh, sharding.spec))

  nnx.update(model, jax.tree.map(place, state))


@contextlib.contextmanager
def _auto_typed(model: nnx.Module):
  """The model's arrays typed on all-Auto meshes while the creation pass runs
  eagerly: Explicit sharding has no typing rule for every operation
  (``lax.ragged_dot``, which MoE experts run, raises under it), and the
  pass needs none. Values and placement do not change. Yields
  ``restore(model)``, which types a model's arrays back (the adapted copy's
  too); ``model``'s own are restored on exit."""
  from jax.sharding import AxisType

  explicit = {}  # Auto view -> the mesh it views

  def auto(mesh):
    if all(t == AxisType.Auto for t in mesh.axis_types):
      return mesh
    view = jax.sharding.Mesh(
      mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names)
    )
    explicit[view] = mesh
    return view

  def restore(m):
    _retyped(m, lambda mesh: explicit.get(mesh, mesh))

  _retyped(model, auto)
  try:
    yield restore
  finally:
    restore(model)


def split_lora(model: _Model) -> tuple[nnx.GraphDef[_Model], nnx.State, nnx.State]:
  """Split a model into the adapters to train and the rest.

  Args:
    model: a model with LoRA adapters.

  Returns:
    ``(graphdef, adapters, frozen)``: the adapters to train, and the rest
    (base parameters and buffers) as :func:`cpjax.training.step.make_train_step`'s
    ``frozen``.
  """
  if not adapted_modules(model):
    raise ValueError("the model has no LoRA adapters (apply_lora or load_adapter first)")
  graphdef, adapters, frozen = nnx.split(model, nnx.LoRAParam, ...)
  return graphdef, adapters, frozen


def lora_param_count(model: nnx.Module) -> int:
  """Count the trained adapter values.

  Args:
    model: a model with LoRA adapters.

  Returns:
    The number of trained adapter values.
  """
  return sum(
    int(np.prod(v.shape)) for _, v in nnx.iter_graph(model) if isinstance(v, nnx.LoRAParam)
  )


def adapter_settings(model: nnx.Module) -> LoraConfig:
  """Return the :class:`LoraConfig` an adapted ``model`` carries (a ``ValueError`` if none)."""
  settings = getattr(model, "lora_config", None)
  if not isinstance(settings, LoraConfig):
    raise ValueError("the model has no LoRA settings: build it with apply_lora or load_adapter")
  return settings


def _delta(
  name: str, base: jax.Array, a: jax.Array, b: jax.Array, scale: float, *, per_expert: bool
) -> jax.Array:
  """``scale * A B`` in the base parameter's layout: ``weight`` [O, I] (the
  PyTorch / Hugging Face layout, cpjax's Gemma 4), ``kernel`` [I, O] (Flax),
  or, per expert, a tensor [E, O, I] with ``A`` [E, I, r] and ``B`` [E, r, O]."""
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  if per_expert:
    if base.ndim != 3 or a.ndim != 3 or b.ndim != 3:
      raise ValueError(f"per-expert adapters need [E, out, in] tensors; {name} is {base.shape}")
    delta = jnp.einsum("eir,ero->eoi", a, b, precision=jax.lax.Precision.HIGHEST) * scale
  else:
    if base.ndim != 2 or a.ndim != 2 or b.ndim != 2:
      raise ValueError(f"only 2-D projections can be merged; {name} is {base.shape}")
    delta = jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST) * scale
    if name == "weight":
      delta = delta.T
    elif name != "kernel":
      raise ValueError(
        f"merge_lora knows 'weight' [out, in] and 'kernel' [in, out] parameters, got {name!r}"
      )
  if delta.shape != base.shape:
    raise ValueError(
      f"the adapters of {name} give a {delta.shape} update for a {base.shape} parameter"
    )
  return delta


def _dequantize(model: nnx.Module) -> None:
  """Every weight of a quantized base (qwix's, on a projection or an expert
  tensor) back to a plain parameter of its scale's dtype, in place."""
  for _, module in nnx.iter_modules(model):
    for name, value in list(vars(module).items()):
      # A projection's weight as qwix's PTQ keeps it: its QArray beside how it was made.
      if isinstance(getattr(value, "array", None), qwix.QArray):
        setattr(module, name, nnx.Param(qwix.dequantize(value.array)))
      elif isinstance(value, nnx.Param) and isinstance(value.get_value(), qwix.QArray):
        value.set_value(qwix.dequantize(value.get_value()))


def merge_lora(model: _Model) -> _Model:
  """Merge the adapters into the base model (its own class, no adapters).

  Every adapted parameter becomes ``W + scale * A B``, computed in float32 and
  stored in ``W``'s dtype: what PEFT's ``merge_and_unload`` gives. A quantized
  base's weights are dequantized first (``q * scale``, in the dtype the base
  was quantized from), so the merged model is a plain one transformers loads.

  Args:
    model: a model with LoRA adapters.

  Returns:
    The base model with ``W + scale * A B`` in every adapted parameter.

  >>> class One(nnx.Module):
  ...   def __init__(self, rngs):
  ...     self.proj = nnx.Linear(3, 2, rngs=rngs)
  ...   def __call__(self, x):
  ...     return self.proj(x)
  >>> x = np.arange(6, dtype=np.float32).reshape(2, 3)
  >>> model = apply_lora(One(nnx.Rngs(0)), LoraConfig(rank=1, alpha=2.0, targets=("proj",)), x)
  >>> model.proj.kernel_lora_b.set_value(jnp.ones((1, 2)))
  >>> merged = merge_lora(model)
  >>> type(merged).__name__, sorted(adapted_modules(merged))
  ('One', [])
  >>> bool(jnp.allclose(merged(x), model(x), atol=1e-5))
  True
  """
  settings = adapter_settings(model)
  model = nnx.clone(model)
  _dequantize(model)
  for path, module in adapted_modules(model).items():
    for name, (a, b) in adapter_pairs(module).items():
      base = getattr(module, name)
      per_expert = name in getattr(module, "lora_parameters", ())
      merged = base[...].astype(jnp.float32) + _delta(
        name, base[...], a[...], b[...], settings.scale, per_expert=per_expert
      )
      base.set_value(merged.astype(base[...].dtype))
      for suffix in ("_lora_a", "_lora_b", "_lora_einsum_str"):
        if hasattr(module, name + suffix):
          delattr(module, name + suffix)
  for _, module in nnx.iter_modules(model):
    for attr in ("qwix_path", "qwix_rngs", "disable_quant_stats_update", "lora_scale"):
      if attr in vars(module):
        delattr(module, attr)
  del model.lora_config
  # qwix's subclass of the model's class names that class (a model whose
  # adapters are all per-expert was never qwix's); pyrefly sees only nnx.Module.
  model.__class__ = getattr(model.__class__, "_unquantized_type", model.__class__)
  return model
