"""LoRA adapters in PEFT's file format: ``adapter_config.json`` and
``adapter_model.safetensors``, written and read.

Keys are ``base_model.model.<module>.lora_A.weight`` [r, I] and
``...lora_B.weight`` [O, r], float32, where ``<module>`` is the module's
dotted path in the model (for :class:`cpjax.models.gemma4.Gemma4`, the
Hugging Face module name), so ``peft.PeftModel.from_pretrained`` reads
cpjax's adapters and cpjax reads PEFT's.

Per-expert adapters (``target_parameters``) are PEFT's ``ParamWrapper``:
one wrapper a tensor, nested in the order the module defines its tensors,
so the last adapted tensor's factors are ``<module>.lora_A.weight`` and
each earlier one's a ``.base_layer`` deeper; ``lora_A`` [r * E, I] holds
expert ``e``'s rows ``e * r ... e * r + r - 1``, ``lora_B`` [O, r * E]
its columns ``k * E + e`` (PEFT reshapes them to [E, r, I] and [O, r, E]).

Shape letters: ``I`` a projection's input width, ``O`` its output width,
``r`` the rank, ``E`` experts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cpjax.training.lora.adapters import (
  LoraConfig,
  adapted_modules,
  adapter_pairs,
  adapter_settings,
  apply_lora,
  module_paths,
  parameter_targets,
)

__all__ = [
  "ADAPTER_CONFIG_FILE",
  "ADAPTER_WEIGHTS_FILE",
  "load_adapter",
  "read_adapter_config",
  "save_adapter",
]

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
# A model's own class, which loading an adapter keeps (as apply_lora does).
_Model = TypeVar("_Model", bound=nnx.Module)


def save_adapter(
  model: nnx.Module, path: str | os.PathLike[str], *, base_model_name_or_path: str | None = None
) -> list[str]:
  """Write the adapters as PEFT does: ``adapter_config.json`` and
  ``adapter_model.safetensors`` (float32) in directory ``path``; returns the
  file paths. ``peft.PeftModel.from_pretrained(base, path)`` loads them onto
  the Hugging Face model whose module names are this model's paths."""
  from safetensors.numpy import save_file

  settings = adapter_settings(model)
  tensors, adapted_tensors = {}, []
  for module_path, module in adapted_modules(model).items():
    pairs = adapter_pairs(module)
    per_expert = [n for n in getattr(module, "lora_parameters", ()) if n in pairs]
    if per_expert:
      for key, name in _wrapper_keys(module_path, per_expert).items():
        a, b = (np.asarray(f[...], np.float32) for f in pairs.pop(name))
        tensors[key + ".lora_A.weight"], tensors[key + ".lora_B.weight"] = _to_peft(a, b)
        adapted_tensors.append(f"{module_path}.{name}")
      if pairs:
        raise ValueError(
          f"PEFT adapts a module's projection or its tensors, not both; {module_path} "
          f"has {sorted(pairs)} beside {per_expert}"
        )
      continue
    if len(pairs) != 1:
      raise ValueError(
        f"PEFT stores one adapter pair per module; {module_path} has {sorted(pairs)}"
      )
    ((a, b),) = pairs.values()
    if a.ndim != 2 or b.ndim != 2:
      raise ValueError(
        f"PEFT's LoRA is on 2-D projections; {module_path} has A {a.shape}, B {b.shape}"
      )
    key = _PEFT_PREFIX + module_path
    tensors[key + ".lora_A.weight"] = np.ascontiguousarray(np.asarray(a[...], np.float32).T)
    tensors[key + ".lora_B.weight"] = np.ascontiguousarray(np.asarray(b[...], np.float32).T)
  config = {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "base_model_name_or_path": base_model_name_or_path,
    "r": settings.rank,
    "lora_alpha": settings.alpha,
    "target_modules": (
      settings.targets if isinstance(settings.targets, str) else list(settings.targets)
    ),
    # PEFT matches these by name, never as a regex: the tensors adapted.
    "target_parameters": sorted(adapted_tensors) or None,
    "lora_dropout": 0.0,
    "bias": "none",
    "fan_in_fan_out": False,
    "use_rslora": settings.use_rslora,
    "use_dora": False,
    "init_lora_weights": True,
    "inference_mode": True,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layers_to_transform": None,
    "layers_pattern": None,
    "revision": None,
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
  "lora_bias": (False, "LoRA biases (lora_bias)"),
}


def read_adapter_config(path: str | os.PathLike[str]) -> LoraConfig:
  """Read the :class:`LoraConfig` of a PEFT adapter directory's ``adapter_config.json``.

  ``ValueError`` naming the field for what cpjax does not compute (DoRA,
  biases, per-module ranks ...).

  Args:
    path: the PEFT adapter directory.

  Returns:
    The :class:`LoraConfig`.
  """
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
  targets, tensors = config.get("target_modules"), config.get("target_parameters")
  if targets is None and not tensors:
    raise ValueError(f"{file}: target_modules is missing")
  if tensors is not None and not (
    isinstance(tensors, list) and all(isinstance(t, str) and t for t in tensors)
  ):
    raise ValueError(f"{file}: target_parameters must be a list of names, got {tensors!r}")
  return LoraConfig(
    rank=int(config["r"]),
    alpha=float(config.get("lora_alpha", 8)),
    targets=() if targets is None else targets if isinstance(targets, str) else tuple(targets),
    # No target_parameters in the file: no per-expert adapters (not cpjax's default).
    target_parameters=tuple(tensors or ()),
    use_rslora=bool(config.get("use_rslora", False)),
  )


def load_adapter(
  model: _Model, path: str | os.PathLike[str], *example_inputs: Any, **example_kwargs: Any
) -> _Model:
  """Load the PEFT adapter in directory ``path`` into ``model`` (a base model).

  The adapters of exactly the modules the file names, with its rank, alpha
  and scaling. Strict: ``KeyError`` for a file key that is no adapter of a
  module of the model, or an adapted module the file leaves out;
  ``ValueError`` for a wrong shape.

  Args:
    model: a base model.
    path: the PEFT adapter directory.
    *example_inputs, **example_kwargs: example inputs, as :func:`apply_lora`.

  Returns:
    ``model`` with the adapter.
  """
  from safetensors.numpy import load_file

  settings = read_adapter_config(path)
  weights_file = os.path.join(path, ADAPTER_WEIGHTS_FILE)
  if not os.path.isfile(weights_file):
    raise FileNotFoundError(
      f"{path}: no {ADAPTER_WEIGHTS_FILE} (cpjax reads the safetensors form PEFT writes by default)"
    )
  tensors = load_file(weights_file)
  pattern = re.compile(re.escape(_PEFT_PREFIX) + r"(.+?)((?:\.base_layer)*)\.lora_([AB])\.weight")
  found: dict[str, dict[str, np.ndarray]] = {}
  for key, value in tensors.items():
    match = pattern.fullmatch(key)
    if match is None:
      raise KeyError(
        f"{weights_file}: key {key!r} is not a LoRA factor "
        f"('{_PEFT_PREFIX}<module>.lora_A.weight' or '.lora_B.weight')"
      )
    found.setdefault(match.group(1) + match.group(2), {})[match.group(3)] = value
  for key, pair in found.items():
    if set(pair) != {"A", "B"}:
      raise KeyError(f"{weights_file}: {key} has lora_{''.join(pair)} only")
  # The tensors target_parameters names, by their wrappers' keys in the file.
  tensor_paths = parameter_targets(model, settings)
  by_module: dict[str, list[str]] = {}
  for tensor in tensor_paths:
    module_path, _, name = tensor.rpartition(".")
    by_module.setdefault(module_path, []).append(name)
  owners = {p: m for p, m in module_paths(model).items() if p in by_module}
  wrappers = {
    key: (module_path, name)
    for module_path, names in by_module.items()
    for key, name in _wrapper_keys(
      module_path, [n for n in owners[module_path].lora_parameters if n in names], prefix=""
    ).items()
  }
  missing = sorted(f"{m}.{n}" for k, (m, n) in wrappers.items() if k not in found)
  if missing:
    raise KeyError(
      f"{weights_file}: no factors for the tensors target_parameters names: {missing[:6]}"
    )
  modules = {k: v for k, v in found.items() if k not in wrappers}
  unknown = sorted(set(modules) - set(module_paths(model)))
  if unknown:
    raise KeyError(f"{weights_file}: adapters for modules the model does not have: {unknown[:6]}")
  # The file says which modules carry adapters (PEFT skips target matches it
  # cannot adapt); each must also match the config's target_modules.
  stray = sorted(p for p in modules if not settings.matches(p))
  if stray:
    raise ValueError(
      f"{weights_file}: adapters for modules outside target_modules "
      f"{settings.targets!r}: {stray[:6]}"
    )
  exact = "|".join(re.escape(p) for p in sorted(modules)) if modules else ()
  exact_config = dataclasses.replace(settings, targets=exact, target_parameters=tuple(tensor_paths))
  adapted = apply_lora(model, exact_config, *example_inputs, **example_kwargs)
  setattr(adapted, "lora_config", settings)  # read back by adapter_settings
  for module_path, module in adapted_modules(adapted).items():
    pairs = adapter_pairs(module)
    if module_path in modules:
      ((a, b),) = pairs.values()
      want_a, want_b = modules[module_path]["A"].T, modules[module_path]["B"].T
      if want_a.shape != a.shape or want_b.shape != b.shape:
        raise ValueError(
          f"{weights_file}: {module_path} has lora_A {want_a.T.shape} and lora_B "
          f"{want_b.T.shape}; the model's projection needs "
          f"{tuple(reversed(a.shape))} and {tuple(reversed(b.shape))}"
        )
      a.set_value(_like(a, want_a))
      b.set_value(_like(b, want_b))
  for key, (module_path, name) in wrappers.items():
    a, b = adapter_pairs(module_paths(adapted)[module_path])[name]
    e, fan_in, r = a.shape
    out = b.shape[-1]
    factors = found[key]
    if factors["A"].shape != (r * e, fan_in) or factors["B"].shape != (out, r * e):
      raise ValueError(
        f"{weights_file}: {module_path}.{name} has lora_A {factors['A'].shape} and "
        f"lora_B {factors['B'].shape}; its {e} experts need {(r * e, fan_in)} and "
        f"{(out, r * e)}"
      )
    a.set_value(_like(a, factors["A"].reshape(e, r, fan_in).transpose(0, 2, 1)))
    b.set_value(_like(b, factors["B"].reshape(out, r, e).transpose(2, 1, 0)))
  return adapted


def _wrapper_keys(module_path: str, names: list[str], prefix: str = _PEFT_PREFIX) -> dict:
  """{PEFT key of each tensor's wrapper: tensor name}: ``names`` in the order
  the module defines them, the last one outermost."""
  outermost_first = list(reversed(names))
  return {prefix + module_path + ".base_layer" * d: n for d, n in enumerate(outermost_first)}


def _to_peft(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Per-expert ``A`` [E, I, r] and ``B`` [E, r, O] as PEFT's ``lora_A`` [r * E, I]
  (expert-major rows) and ``lora_B`` [O, r * E] (rank-major columns)."""
  e, fan_in, r = a.shape
  return (
    np.ascontiguousarray(a.transpose(0, 2, 1).reshape(e * r, fan_in)),
    np.ascontiguousarray(b.transpose(2, 1, 0).reshape(b.shape[-1], r * e)),
  )


def _like(var, value: np.ndarray) -> jax.Array:
  """``value`` as float32, placed as ``var`` is."""
  out = jnp.asarray(value, jnp.float32)
  sharding = getattr(var[...], "sharding", None)
  return jax.device_put(out, sharding) if sharding is not None else out
