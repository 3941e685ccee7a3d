"""LoRA adapters on a Flax NNX model (with qwix), saved and loaded as PEFT does.

A frozen base weight ``W`` of a targeted projection gains two trained
factors: ``A`` [I, r] (fan-in) and ``B`` [r, O] (fan-out, zero at first), and
the projection computes ``y = x W + (x A B) * alpha / r`` (``alpha /
sqrt(r)`` with rsLoRA). qwix (Google's LoRA and quantization library for
NNX, which tunix builds on) intercepts the projections' ``jnp.einsum`` /
``lax.dot_general`` / ``jnp.dot`` while the model's method runs and adds
the adapters there; they are ``nnx.LoRAParam`` variables of the projection's
module, named ``<param>_lora_a`` / ``<param>_lora_b``, so

    graphdef, adapters, frozen = split_lora(model)

gives what :func:`cpjax.training.step.make_train_step` trains (``adapters``, with
their optimizer state) and what it only reads (``frozen=frozen``: the base,
in whatever dtype it was stored, and the buffers).

As PEFT computes it: the adapters are float32 whatever the base's dtype,
their term is added in float32 and the sum is cast back to the base
projection's output dtype; ``A`` starts as PEFT's default
(``kaiming_uniform(a=sqrt(5))``: uniform in ``±1/sqrt(I)``), ``B`` at zero,
so a fresh adapter leaves the model's outputs exactly unchanged.

PEFT's files (:func:`save_adapter`, :func:`load_adapter`):
``adapter_config.json`` and ``adapter_model.safetensors`` with keys
``base_model.model.<module>.lora_A.weight`` [r, I] and ``...lora_B.weight``
[O, r], where ``<module>`` is the module's dotted path in the model: for
:class:`cpjax.models.gemma4.Gemma4` the Hugging Face module name, so
``peft.PeftModel.from_pretrained`` reads cpjax's adapters and cpjax reads
PEFT's.

Targets are PEFT's ``target_modules``: a regular expression matched in full
against each module's dotted path, or a list of names (a module matches
when its path is the name or ends with ``.name``). Only modules that run an
intercepted product on a parameter of their own can carry adapters; a
target that matches anything else is an error, never silently skipped.
Gemma 4's MoE experts (``lax.ragged_dot`` on 3-D tensors, which PEFT
reaches only through ``target_parameters``) are never targets.

Shape letters: ``I`` a projection's input width, ``O`` its output width,
``r`` the rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["ADAPTER_CONFIG_FILE", "ADAPTER_WEIGHTS_FILE", "DEFAULT_LORA_TARGETS", "LoraSettings",
           "adapted_modules", "apply_lora", "load_adapter", "lora_param_count", "merge_lora",
           "read_adapter_config", "save_adapter", "split_lora"]

# The attention and MLP projections of Gemma 4's text decoder, by the names
# PEFT users know (q_proj ... down_proj). Restricted to the language model:
# the vision tower's projections share the names but are clipped linears
# (``q_proj.linear`` holds the weight), and PEFT cannot adapt those wrappers.
DEFAULT_LORA_TARGETS = (r".*language_model\.layers\.\d+\."
                        r"(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)")
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


@dataclasses.dataclass(frozen=True)
class LoraSettings:
  """What a LoRA model was built with (kept on the model as ``lora_settings``).

  Attributes:
    rank: ``r``.
    alpha: ``lora_alpha``; the adapters' term is scaled by ``alpha / r``
      (``alpha / sqrt(r)`` with ``use_rslora``).
    targets: PEFT's ``target_modules`` (a regex string or a tuple of names).
    use_rslora: rank-stabilised scaling.
  """
  rank: int
  alpha: float = 8.0
  targets: str | tuple[str, ...] = DEFAULT_LORA_TARGETS
  use_rslora: bool = False

  def __post_init__(self):
    if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
      raise ValueError(f"LoRA rank must be an integer >= 1, got {self.rank!r}")
    if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not (
        math.isfinite(self.alpha) and self.alpha > 0):
      raise ValueError(f"LoRA alpha must be a positive number, got {self.alpha!r}")
    if isinstance(self.targets, str):
      try:
        re.compile(self.targets)
      except re.error as e:
        raise ValueError(f"LoRA targets {self.targets!r} is not a regular expression: {e}"
                         ) from None
    elif not (isinstance(self.targets, tuple) and self.targets
              and all(isinstance(t, str) and t for t in self.targets)):
      raise TypeError(f"LoRA targets must be a regex string or a non-empty tuple of module "
                      f"names, got {self.targets!r}")

  @property
  def scale(self) -> float:
    """The adapters' factor: ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA)."""
    return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

  def matches(self, path: str) -> bool:
    """Whether the module at dotted ``path`` is a target (PEFT's rule)."""
    if isinstance(self.targets, str):
      return re.fullmatch(self.targets, path) is not None
    return any(path == t or path.endswith("." + t) for t in self.targets)


def _peft_init(key, shape, dtype=jnp.float32):
  """PEFT's ``A``: ``kaiming_uniform_(a=sqrt(5))`` of the [r, I] weight,
  i.e. uniform in ``±1/sqrt(I)``; here [I, r]. Always float32."""
  del dtype
  bound = 1.0 / math.sqrt(math.prod(shape[:-1]))
  return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


def _zeros(key, shape, dtype=jnp.float32):
  del key, dtype
  return jnp.zeros(shape, jnp.float32)


def _provider(module_path: str, settings: LoraSettings):
  """qwix's LoRA provider, with PEFT's numerics: float32 adapters whose sum
  with the base projection is cast back to the base output's dtype."""
  import qwix

  class PeftNumerics(qwix.LoraProvider):
    def einsum(self, einsum_str, *operands, **kwargs):
      dtype = kwargs.get("preferred_element_type") or jnp.result_type(*operands)
      return super().einsum(einsum_str, *operands, **kwargs).astype(dtype)

    def dot_general(self, lhs, rhs, dimension_numbers, precision=None,
                    preferred_element_type=None, out_sharding=None):
      dtype = preferred_element_type or jnp.result_type(lhs, rhs)
      return super().dot_general(lhs, rhs, dimension_numbers, precision,
                                 preferred_element_type, out_sharding).astype(dtype)

  # qwix divides alpha by the rank; rsLoRA divides by its square root.
  alpha = settings.alpha * (math.sqrt(settings.rank) if settings.use_rslora else 1.0)
  return PeftNumerics(module_path=module_path, rank=settings.rank, alpha=alpha,
                      lora_a_initializer=_peft_init, lora_b_initializer=_zeros)


def _module_paths(model) -> dict[str, Any]:
  """{dotted path: module} of every submodule of ``model`` (not the root)."""
  return {".".join(str(p) for p in path): m for path, m in nnx.iter_modules(model) if path}


def adapted_modules(model) -> dict[str, nnx.Module]:
  """{dotted module path: module} of every module that holds adapters
  (see :func:`apply_lora`'s example)."""
  return {path: m for path, m in _module_paths(model).items()
          if any(isinstance(v, nnx.LoRAParam) for v in vars(m).values())}


def _adapter_pairs(module) -> dict[str, tuple[nnx.LoRAParam, nnx.LoRAParam]]:
  """{base parameter name: (A, B)} of one adapted module."""
  pairs = {}
  for name, value in vars(module).items():
    if isinstance(value, nnx.LoRAParam) and name.endswith("_lora_a"):
      base = name[:-len("_lora_a")]
      pairs[base] = (value, getattr(module, base + "_lora_b"))
  return pairs


def _example_inputs(model):
  """The model's own example inputs (its ``example_inputs()`` method: a
  Gemma 4 makes a one-row, 8-token batch)."""
  make = getattr(model, "example_inputs", None)
  if callable(make):
    return make()
  raise TypeError(f"apply_lora needs example inputs for a {type(model).__name__}: the model "
                  f"runs once on them to create its adapters (pass them after the model, or "
                  f"give the model an example_inputs() method returning (args, kwargs))")


def apply_lora(model: nnx.Module, *example_inputs, rank: int, alpha: float = 8.0,
               targets: str | Sequence[str] = DEFAULT_LORA_TARGETS, use_rslora: bool = False,
               seed: int = 0, method: str | None = None, **example_kwargs) -> nnx.Module:
  """A copy of ``model`` with LoRA adapters on the ``targets`` projections.

  qwix runs the model once on ``example_inputs`` (any values of the right
  structure; without them, the model's own ``example_inputs()`` method's
  ``(args, kwargs)``: a Gemma 4 makes an 8-token batch) to create the adapters.
  ``method`` is the model method qwix intercepts: default
  ``hidden_states`` when the model has one (Gemma 4; its ``__call__`` goes
  through it), else ``__call__``. Adapters are float32, ``A`` seeded by
  ``seed``; the base keeps its dtype.

  Raises ``ValueError`` when a target matches no module, or matches a
  module that runs no intercepted product on a parameter of its own (an
  MoE expert tensor, a container module, a weight applied with ``@``).

  Example (any NNX model):
    >>> class Tiny(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.up = nnx.Linear(4, 8, rngs=rngs)
    ...     self.down = nnx.Linear(8, 2, rngs=rngs)
    ...   def __call__(self, x):
    ...     return self.down(jax.nn.relu(self.up(x)))
    >>> base = Tiny(nnx.Rngs(0))
    >>> x = np.ones((3, 4), np.float32)
    >>> model = apply_lora(base, x, rank=2, alpha=4.0, targets=("up", "down"))
    >>> sorted(adapted_modules(model)), model.up.kernel_lora_a.shape, model.up.kernel_lora_b.shape
    (['down', 'up'], (4, 2), (2, 8))
    >>> bool(jnp.array_equal(model(x), base(x)))        # B starts at zero
    True
    >>> graphdef, adapters, frozen = split_lora(model)
    >>> lora_param_count(model)                          # (4 + 8) * 2 + (8 + 2) * 2
    44
  """
  import qwix

  settings = LoraSettings(rank=rank, alpha=float(alpha), use_rslora=bool(use_rslora),
                          targets=targets if isinstance(targets, str) else tuple(targets))
  if not isinstance(model, nnx.Module):
    raise TypeError(f"apply_lora takes a Flax NNX module, got {type(model).__name__}")
  if adapted_modules(model):
    raise ValueError("the model already has LoRA adapters: merge them (merge_lora) or start "
                     "from the base model")
  paths = _module_paths(model)
  matched = sorted(p for p in paths if settings.matches(p))
  if not matched:
    raise ValueError(f"LoRA targets {settings.targets!r} match no module of the "
                     f"{type(model).__name__}; its modules are e.g. {sorted(paths)[:8]}")
  if method is None:
    method = "hidden_states" if callable(getattr(model, "hidden_states", None)) else "__call__"
  if not example_inputs and not example_kwargs:
    example_inputs, example_kwargs = _example_inputs(model)
  module_path = "|".join(re.escape(p.replace(".", "/")) for p in matched)
  # The creation pass must run the layers in place: a rematerialised layer
  # runs on a copy of its state, and the adapters made there would be lost.
  remat = getattr(model, "remat", None)
  if remat not in (None, "none"):
    model.remat = "none"
  try:
    with _auto_typed(model) as restore:
      adapted = qwix.apply_lora_to_model(model, _provider(module_path, settings),
                                         *example_inputs, rngs=nnx.Rngs(seed),
                                         methods=(method,), **example_kwargs)
      restore(adapted)
  finally:
    if remat not in (None, "none"):
      model.remat = remat
  if remat not in (None, "none"):
    adapted.remat = remat
  missing = sorted(set(matched) - set(adapted_modules(adapted)))
  if missing:
    raise ValueError(f"LoRA targets {settings.targets!r} match modules that cannot carry "
                     f"adapters (no jnp.einsum / lax.dot_general / jnp.dot on a parameter of "
                     f"their own while {method} runs): {missing[:6]}"
                     f"{' ...' if len(missing) > 6 else ''}")
  adapted.lora_settings = settings
  return adapted


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

  explicit = {}                 # Auto view -> the mesh it views

  def auto(mesh):
    if all(t == AxisType.Auto for t in mesh.axis_types):
      return mesh
    view = jax.sharding.Mesh(mesh.devices, mesh.axis_names,
                             axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    explicit[view] = mesh
    return view

  def restore(m):
    _retyped(m, lambda mesh: explicit.get(mesh, mesh))

  _retyped(model, auto)
  try:
    yield restore
  finally:
    restore(model)


def split_lora(model: nnx.Module):
  """``(graphdef, adapters, frozen)``: the adapters to train, and the rest
  (base parameters and buffers) as :func:`cpjax.training.step.make_train_step`'s
  ``frozen``."""
  if not adapted_modules(model):
    raise ValueError("the model has no LoRA adapters (apply_lora or load_adapter first)")
  return nnx.split(model, nnx.LoRAParam, ...)


def lora_param_count(model: nnx.Module) -> int:
  """The number of trained adapter values."""
  return sum(int(np.prod(v.shape)) for _, v in nnx.iter_graph(model)
             if isinstance(v, nnx.LoRAParam))


def _settings(model) -> LoraSettings:
  settings = getattr(model, "lora_settings", None)
  if not isinstance(settings, LoraSettings):
    raise ValueError("the model has no LoRA settings: build it with apply_lora or load_adapter")
  return settings


def _delta(name: str, base: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
  """``scale * A B`` in the base parameter's layout: ``weight`` [O, I] (the
  PyTorch / Hugging Face layout, cpjax's Gemma 4) or ``kernel`` [I, O] (Flax)."""
  delta = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST) * scale
  if base.ndim != 2 or a.ndim != 2 or b.ndim != 2:
    raise ValueError(f"only 2-D projections can be merged; {name} is {base.shape}")
  if name == "weight":
    delta = delta.T
  elif name != "kernel":
    raise ValueError(f"merge_lora knows 'weight' [out, in] and 'kernel' [in, out] "
                     f"parameters, got {name!r}")
  if delta.shape != base.shape:
    raise ValueError(f"the adapters of {name} give a {delta.shape} update for a {base.shape} "
                     f"parameter")
  return delta


def merge_lora(model: nnx.Module) -> nnx.Module:
  """The base model (its own class, no adapters) with ``W + scale * A B`` in
  every adapted parameter, computed in float32 and stored in ``W``'s dtype:
  what PEFT's ``merge_and_unload`` gives.

  >>> class One(nnx.Module):
  ...   def __init__(self, rngs):
  ...     self.proj = nnx.Linear(3, 2, rngs=rngs)
  ...   def __call__(self, x):
  ...     return self.proj(x)
  >>> x = np.arange(6, dtype=np.float32).reshape(2, 3)
  >>> model = apply_lora(One(nnx.Rngs(0)), x, rank=1, alpha=2.0, targets=("proj",))
  >>> model.proj.kernel_lora_b.set_value(jnp.ones((1, 2)))
  >>> merged = merge_lora(model)
  >>> type(merged).__name__, sorted(adapted_modules(merged))
  ('One', [])
  >>> bool(jnp.allclose(merged(x), model(x), atol=1e-5))
  True
  """
  settings = _settings(model)
  model = nnx.clone(model)
  for path, module in adapted_modules(model).items():
    for name, (a, b) in _adapter_pairs(module).items():
      base = getattr(module, name)
      merged = base[...].astype(jnp.float32) + _delta(name, base[...], a[...], b[...],
                                                       settings.scale)
      base.set_value(merged.astype(base[...].dtype))
      for suffix in ("_lora_a", "_lora_b", "_lora_einsum_str"):
        if hasattr(module, name + suffix):
          delattr(module, name + suffix)
  for _, module in nnx.iter_modules(model):
    for attr in ("qwix_path", "qwix_rngs", "disable_quant_stats_update"):
      if attr in vars(module):
        delattr(module, attr)
  del model.lora_settings
  model.__class__ = model.__class__._unquantized_type  # qwix's subclass of the model's class
  return model


# ------------------------------------------------------------------ PEFT files
def save_adapter(model: nnx.Module, path, *, base_model_name_or_path: str | None = None
                 ) -> list[str]:
  """Write the adapters as PEFT does: ``adapter_config.json`` and
  ``adapter_model.safetensors`` (float32) in directory ``path``; returns the
  file paths. ``peft.PeftModel.from_pretrained(base, path)`` loads them onto
  the Hugging Face model whose module names are this model's paths."""
  from safetensors.numpy import save_file

  settings = _settings(model)
  tensors = {}
  for module_path, module in adapted_modules(model).items():
    pairs = _adapter_pairs(module)
    if len(pairs) != 1:
      raise ValueError(f"PEFT stores one adapter pair per module; {module_path} has "
                       f"{sorted(pairs)}")
    (a, b), = pairs.values()
    if a.ndim != 2 or b.ndim != 2:
      raise ValueError(f"PEFT's LoRA is on 2-D projections; {module_path} has A {a.shape}, "
                       f"B {b.shape}")
    key = _PEFT_PREFIX + module_path
    tensors[key + ".lora_A.weight"] = np.ascontiguousarray(np.asarray(a[...], np.float32).T)
    tensors[key + ".lora_B.weight"] = np.ascontiguousarray(np.asarray(b[...], np.float32).T)
  config = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM",
      "base_model_name_or_path": base_model_name_or_path,
      "r": settings.rank, "lora_alpha": settings.alpha,
      "target_modules": (settings.targets if isinstance(settings.targets, str)
                         else list(settings.targets)),
      "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
      "use_rslora": settings.use_rslora, "use_dora": False, "init_lora_weights": True,
      "inference_mode": True, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
      "layers_to_transform": None, "layers_pattern": None, "revision": None,
  }
  os.makedirs(path, exist_ok=True)
  files = [os.path.join(path, ADAPTER_CONFIG_FILE), os.path.join(path, ADAPTER_WEIGHTS_FILE)]
  with open(files[0], "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2, sort_keys=True)
  save_file(tensors, files[1], metadata={"format": "pt"})
  return files


# PEFT options whose non-default values change what the adapters compute.
_UNSUPPORTED = {
    "use_dora": (False, "DoRA adapters"),
    "bias": ("none", "trained biases"),
    "fan_in_fan_out": (False, "fan_in_fan_out layers (GPT-2 style Conv1D)"),
    "modules_to_save": (None, "fully trained modules_to_save"),
    "rank_pattern": ({}, "per-module ranks (rank_pattern)"),
    "alpha_pattern": ({}, "per-module alphas (alpha_pattern)"),
    "layers_to_transform": (None, "layers_to_transform"),
    "target_parameters": (None, "target_parameters (adapters on raw parameters such as MoE "
                                "experts)"),
    "lora_bias": (False, "LoRA biases (lora_bias)"),
}


def read_adapter_config(path) -> LoraSettings:
  """The :class:`LoraSettings` of a PEFT adapter directory's
  ``adapter_config.json``; ``ValueError`` naming the field for what cpjax
  does not compute (DoRA, biases, per-module ranks ...)."""
  file = os.path.join(path, ADAPTER_CONFIG_FILE)
  if not os.path.isfile(file):
    raise FileNotFoundError(f"{path} is not a PEFT adapter directory: no {ADAPTER_CONFIG_FILE}")
  with open(file, encoding="utf-8") as f:
    config = json.load(f)
  if config.get("peft_type") != "LORA":
    raise ValueError(f"{file}: peft_type must be 'LORA', got {config.get('peft_type')!r}")
  for key, (default, what) in _UNSUPPORTED.items():
    value = config.get(key, default)
    if value not in (default, None, {}, []) and value != default:
      raise ValueError(f"{file}: {key}={value!r}: cpjax does not support {what}")
  targets = config.get("target_modules")
  if targets is None:
    raise ValueError(f"{file}: target_modules is missing")
  return LoraSettings(rank=int(config["r"]), alpha=float(config.get("lora_alpha", 8)),
                      targets=targets if isinstance(targets, str) else tuple(targets),
                      use_rslora=bool(config.get("use_rslora", False)))


def load_adapter(model: nnx.Module, path, *example_inputs, **example_kwargs) -> nnx.Module:
  """``model`` (a base model) with the PEFT adapter in directory ``path``:
  the adapters of exactly the modules the file names, with its rank, alpha
  and scaling. Strict: ``KeyError`` for a file key that is no adapter of a
  module of the model, or an adapted module the file leaves out;
  ``ValueError`` for a wrong shape. Example inputs as :func:`apply_lora`."""
  from safetensors.numpy import load_file

  settings = read_adapter_config(path)
  weights_file = os.path.join(path, ADAPTER_WEIGHTS_FILE)
  if not os.path.isfile(weights_file):
    raise FileNotFoundError(f"{path}: no {ADAPTER_WEIGHTS_FILE} (cpjax reads the safetensors "
                            f"form PEFT writes by default)")
  tensors = load_file(weights_file)
  pattern = re.compile(re.escape(_PEFT_PREFIX) + r"(.+)\.lora_([AB])\.weight")
  found: dict[str, dict[str, np.ndarray]] = {}
  for key, value in tensors.items():
    match = pattern.fullmatch(key)
    if match is None:
      raise KeyError(f"{weights_file}: key {key!r} is not a LoRA factor "
                     f"('{_PEFT_PREFIX}<module>.lora_A.weight' or '.lora_B.weight')")
    found.setdefault(match.group(1), {})[match.group(2)] = value
  for module_path, pair in found.items():
    if set(pair) != {"A", "B"}:
      raise KeyError(f"{weights_file}: {module_path} has lora_{''.join(pair)} only")
  unknown = sorted(set(found) - set(_module_paths(model)))
  if unknown:
    raise KeyError(f"{weights_file}: adapters for modules the model does not have: "
                   f"{unknown[:6]}")
  # The file says which modules carry adapters (PEFT skips target matches it
  # cannot adapt); each must also match the config's target_modules.
  stray = sorted(p for p in found if not settings.matches(p))
  if stray:
    raise ValueError(f"{weights_file}: adapters for modules outside target_modules "
                     f"{settings.targets!r}: {stray[:6]}")
  exact = "|".join(re.escape(p) for p in sorted(found))
  adapted = apply_lora(model, *example_inputs, rank=settings.rank, alpha=settings.alpha,
                       targets=exact, use_rslora=settings.use_rslora, **example_kwargs)
  adapted.lora_settings = settings
  for module_path, module in adapted_modules(adapted).items():
    (a, b), = _adapter_pairs(module).values()
    want_a, want_b = found[module_path]["A"].T, found[module_path]["B"].T
    if want_a.shape != a.shape or want_b.shape != b.shape:
      raise ValueError(f"{weights_file}: {module_path} has lora_A {want_a.T.shape} and lora_B "
                       f"{want_b.T.shape}; the model's projection needs "
                       f"{tuple(reversed(a.shape))} and {tuple(reversed(b.shape))}")
    a.set_value(_like(a, want_a))
    b.set_value(_like(b, want_b))
  return adapted


def _like(var, value: np.ndarray) -> jax.Array:
  """``value`` as float32, placed as ``var`` is."""
  out = jnp.asarray(value, jnp.float32)
  sharding = getattr(var[...], "sharding", None)
  return jax.device_put(out, sharding) if sharding is not None else out
