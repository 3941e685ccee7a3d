"""Hugging Face checkpoints: strict, streaming load and bit-exact save.

A :class:`Gemma4` parameter's NNX path is its checkpoint key, so a
checkpoint is read by walking the model's variables and the safetensors
files side by side:

* strict: a missing key, an unexpected key or a wrong shape is a
  ``ValueError`` naming the key (and both shapes), raised after reading the
  file headers only, before any tensor is read. The documented exceptions
  are skipped, as transformers skips them: K/V weights stored for K/V-sharing
  ``reuse`` layers, the audio tower (not ported), and ``lm_head.weight`` of
  a model with tied embeddings;
* streaming: tensors are read one at a time (each from a freshly opened
  file, so no mapping of a whole file stays resident), converted to the
  target dtype, placed, and dropped; the model is built abstractly first,
  so no random initialisation is ever materialised;
* saving writes ``config.json`` and safetensors shards (with an index when
  there is more than one) that transformers' ``from_pretrained`` loads.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cpjax.models.gemma4.config import Gemma4Config
from cpjax.models.gemma4.layers import Buffer

__all__ = ["load_pretrained", "save_pretrained", "checkpoint_keys"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_AUDIO = re.compile(r"^model\.(audio_tower|embed_audio)\.")
_SHARED_KV = re.compile(r"^model\.language_model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")


def checkpoint_keys(model) -> dict[str, nnx.Variable]:
  """{checkpoint key: variable} of every parameter and buffer of ``model``."""
  out = {}
  for path, var in nnx.iter_graph(model):
    if isinstance(var, (nnx.Param, Buffer)):
      out[".".join(str(p) for p in path)] = var
  return out


def _ignored(key: str, cfg: Gemma4Config) -> bool:
  """Keys a checkpoint may carry that the model does not use (see module doc)."""
  if _AUDIO.match(key):
    return True
  if key == "lm_head.weight" and cfg.text.tie_word_embeddings:
    return True
  shared = _SHARED_KV.match(key)
  if shared:
    layer = int(shared.group(1))
    return layer < cfg.text.num_hidden_layers and cfg.text.kv_sharing_modes[layer] == "reuse"
  return False


def _weight_map(path: str) -> dict[str, str]:
  """{key: safetensors file} of a checkpoint directory."""
  from safetensors import safe_open

  index = os.path.join(path, INDEX_FILE)
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    return {k: os.path.join(path, v) for k, v in weight_map.items()}
  single = os.path.join(path, SINGLE_FILE)
  if not os.path.exists(single):
    raise FileNotFoundError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}")
  with safe_open(single, framework="numpy") as f:
    return {k: single for k in f.keys()}


def _shapes(weight_map: dict[str, str]) -> dict[str, tuple[int, ...]]:
  from safetensors import safe_open

  shapes = {}
  for file in sorted(set(weight_map.values())):
    with safe_open(file, framework="numpy") as f:
      for key in f.keys():
        if weight_map.get(key) == file:
          shapes[key] = tuple(f.get_slice(key).get_shape())
  return shapes


def _read(file: str, key: str) -> np.ndarray:
  from safetensors import safe_open

  with safe_open(file, framework="numpy") as f:
    return f.get_tensor(key)


def load_pretrained(cls, path, *, dtype=jnp.float32, mesh: Mesh | None = None,
                    sharding: Callable[[str, tuple[int, ...]], P] | None = None,
                    remat: bool | str = False):
  """``cls`` (a :class:`Gemma4`) with the weights of the checkpoint in ``path``.

  ``dtype`` is both the parameter and the activation dtype (transformers'
  ``dtype=``). With ``mesh``, every tensor is placed there as it is read:
  replicated, or as ``sharding(key, shape)`` says (a ``PartitionSpec``).
  """
  path = os.fspath(path)
  cfg = Gemma4Config.from_hf(path)
  model = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype,
                                     remat=remat))
  wanted = checkpoint_keys(model)
  weight_map = _weight_map(path)
  shapes = _shapes(weight_map)
  missing = sorted(set(wanted) - set(shapes))
  unexpected = sorted(k for k in set(shapes) - set(wanted) if not _ignored(k, cfg))
  if missing or unexpected:
    raise ValueError(f"checkpoint {path} does not fit the model its config.json describes: "
                     f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                     f"({len(missing)}), unexpected keys {unexpected[:8]}"
                     f"{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)})")
  for key, var in wanted.items():
    if shapes[key] != tuple(var.get_value().shape):
      raise ValueError(f"checkpoint tensor {key!r} has shape {list(shapes[key])}, the model "
                       f"expects {list(var.get_value().shape)}")
  for key, var in wanted.items():
    host = _read(weight_map[key], key).astype(var.get_value().dtype)
    if mesh is not None:
      spec = P() if sharding is None else sharding(key, host.shape)
      value = jax.device_put(host, NamedSharding(mesh, spec))
    else:
      value = jnp.asarray(host)
    del host
    var.set_value(value)
  return model


def save_pretrained(model, path, *, max_shard_bytes: int = 4 << 30) -> list[str]:
  """Write ``config.json`` and the weights of ``model`` in Hugging Face's layout.

  Tensors keep their dtype. Files hold at most ``max_shard_bytes`` each
  (one tensor is never split); more than one file gets an index. Returns the
  files written.
  """
  from safetensors.numpy import save_file

  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(model.cfg.to_hf(), f, indent=2, sort_keys=True)
  keys = checkpoint_keys(model)
  groups: list[list[str]] = [[]]
  size = 0
  for key, var in keys.items():
    nbytes = var.get_value().size * var.get_value().dtype.itemsize
    if groups[-1] and size + nbytes > max_shard_bytes:
      groups.append([])
      size = 0
    groups[-1].append(key)
    size += nbytes
  names = ([SINGLE_FILE] if len(groups) == 1 else
           [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
  weight_map, total = {}, 0
  for name, group in zip(names, groups):
    tensors = {k: np.asarray(jax.device_get(keys[k].get_value())) for k in group}
    save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
    total += sum(t.nbytes for t in tensors.values())
    weight_map.update({k: name for k in group})
    del tensors
  if len(names) > 1:
    with open(os.path.join(path, INDEX_FILE), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  return [os.path.join(path, n) for n in names]
