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
* streaming: each tensor goes straight to its device(s) without a second
  whole host copy. Every device reads only its own shard from the
  safetensors file (a slice, so a sharded table is never read whole), in
  row chunks of at most :data:`CHUNK_BYTES` written into a preallocated
  device buffer in place (a donated ``dynamic_update_slice``; on the CPU
  backend, a copy into the buffer's own memory); the file is
  reopened per chunk, so no mapping of it stays resident. The model is built
  abstractly first, so no random initialisation is ever materialised. Peak
  host memory is the loaded parameters plus about two chunks;
* saving writes ``config.json`` and safetensors shards (with an index when
  there is more than one) that transformers' ``from_pretrained`` loads.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
from collections.abc import Callable
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from cpjax.models.gemma4.config import Gemma4Config
from cpjax.models.gemma4.layers import Buffer

__all__ = ["KeySharding", "checkpoint_keys", "load_pretrained", "save_pretrained"]

# Where a checkpoint tensor goes: sharding(key, shape) gives its PartitionSpec
# on the mesh, or None to replicate it (a buffer).
KeySharding = Callable[[str, tuple[int, ...]], P | None]

# The model load_pretrained builds: a Gemma4 (whose module imports this one).
_Model = TypeVar("_Model", bound=nnx.Module)
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_AUDIO = re.compile(r"^model\.(audio_tower|embed_audio)\.")
_SHARED_KV = re.compile(
  r"^model\.language_model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\."
)


def checkpoint_keys(model: nnx.Module) -> dict[str, nnx.Variable]:
  """Map every parameter and buffer of ``model`` to its checkpoint key.

  Args:
    model: the model.

  Returns:
    {checkpoint key: variable} of every parameter and buffer of ``model``.
  """
  out: dict[str, nnx.Variable] = {}
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


# Bytes of one host read: a tensor larger than this travels in row chunks.
CHUNK_BYTES = 64 << 20
# On the CPU backend, chunks are copied into the buffer's memory (see _host_view).
CPU_HOST_WRITES = True


def _read_slice(file: str, key: str, index: tuple[slice, ...]) -> np.ndarray:
  """``tensor[index]`` read from ``file`` alone (only those bytes are touched)."""
  from safetensors import safe_open

  with safe_open(file, framework="numpy") as f:
    return f.get_slice(key)[index]


@functools.partial(jax.jit, donate_argnums=0)
def _write_rows(buffer, rows, start):
  # Donated: XLA writes into ``buffer`` in place, so the shard never exists twice.
  return jax.lax.dynamic_update_slice_in_dim(buffer, rows, start, axis=0)


def _host_view(buffer: jax.Array) -> np.ndarray:
  """A writable numpy view of a fresh CPU-device buffer (the same memory).

  XLA:CPU runs ``dynamic_update_slice`` on bfloat16 through float32 over the
  WHOLE buffer (float normalisation), so filling a 4.7 GB table chunk by
  chunk would take minutes; on the CPU backend the device memory is host
  memory, so the chunks are copied into it directly. Only for a buffer that
  nothing else has seen yet, after it is ready.
  """
  buffer.block_until_ready()
  size = buffer.size * buffer.dtype.itemsize
  raw = (ctypes.c_char * size).from_address(buffer.unsafe_buffer_pointer())
  # numpy's stubs spell the buffer protocol (on Python 3.11) as a list of types
  # without ctypes arrays, which have it.
  # pyrefly: ignore[no-matching-overload]
  return np.frombuffer(raw, dtype=buffer.dtype).reshape(buffer.shape)


def _load_shard(
  file: str, key: str, index: tuple[slice, ...], shape: tuple[int, ...], dtype, device
) -> jax.Array:
  """The block ``index`` of tensor ``key`` (full ``shape``) on ``device``, as ``dtype``."""
  index = tuple(slice(*s.indices(n)) for s, n in zip(index, shape)) + tuple(
    slice(0, n) for n in shape[len(index) :]
  )
  block = tuple(s.stop - s.start for s in index)
  row_bytes = int(np.prod(block[1:], dtype=np.int64)) * max(np.dtype(dtype).itemsize, 4)
  if not block or block[0] * row_bytes <= CHUNK_BYTES:
    return jax.device_put(np.asarray(_read_slice(file, key, index), dtype), device)
  rows = max(1, CHUNK_BYTES // row_bytes)
  buffer = jnp.zeros(block, dtype, device=device)
  host = _host_view(buffer) if device.platform == "cpu" and CPU_HOST_WRITES else None
  first = index[0].start
  for lo in range(0, block[0], rows):
    hi = min(lo + rows, block[0])
    part = _read_slice(file, key, (slice(first + lo, first + hi), *index[1:]))
    if host is not None:
      host[lo:hi] = part  # casts to dtype as numpy does
    else:
      buffer = _write_rows(buffer, jax.device_put(np.asarray(part, dtype), device), lo)
    del part
  return buffer


def _load_tensor(file: str, key: str, shape: tuple[int, ...], dtype, sharding) -> jax.Array:
  """Tensor ``key`` placed per ``sharding``: each addressable device reads only its block.

  ``jax.make_array_from_callback`` would hold every local block on the host
  at once before placing them; building each device's block in chunks and
  assembling them keeps one chunk in flight. A block that several devices
  hold (a replicated tensor) is read once and copied device to device.
  """
  read: dict = {}
  blocks = []
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    seen = read.get(repr(index))  # slices are unhashable before Python 3.12
    block = (
      _load_shard(file, key, index, shape, dtype, device)
      if seen is None
      else jax.device_put(seen, device)
    )
    read.setdefault(repr(index), block)
    blocks.append(block)
  return jax.make_array_from_single_device_arrays(shape, sharding, blocks)


def load_pretrained(
  cls: Callable[..., _Model],
  path: str | os.PathLike[str],
  *,
  dtype: DTypeLike = jnp.float32,
  mesh: Mesh | None = None,
  sharding: KeySharding | None = None,
  remat: bool | str = False,
) -> _Model:
  """Load ``cls`` (a :class:`Gemma4`) with the weights of the checkpoint in ``path``.

  ``dtype`` is both the parameter and the activation dtype (transformers'
  ``dtype=``). With ``mesh``, every tensor, buffers included, is placed
  there as it is read: as ``sharding(key, shape)`` says (a
  ``PartitionSpec``), or replicated (no ``sharding``, or None for that key).

  Args:
    cls: the model class, a :class:`Gemma4`.
    path: the checkpoint's directory.
    dtype: the parameter and activation dtype.
    mesh: the mesh to place the tensors on, or None.
    sharding: ``sharding(key, shape)``, each tensor's ``PartitionSpec``.
    remat: the model's per-layer rematerialisation.

  Returns:
    The model, with the checkpoint's weights.
  """
  path = os.fspath(path)
  cfg = Gemma4Config.from_hf(path)
  model = nnx.eval_shape(
    lambda: cls(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype, remat=remat)
  )
  wanted = checkpoint_keys(model)
  weight_map = _weight_map(path)
  shapes = _shapes(weight_map)
  missing = sorted(set(wanted) - set(shapes))
  unexpected = sorted(k for k in set(shapes) - set(wanted) if not _ignored(k, cfg))
  if missing or unexpected:
    raise ValueError(
      f"checkpoint {path} does not fit the model its config.json describes: "
      f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''} "
      f"({len(missing)}), unexpected keys {unexpected[:8]}"
      f"{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)})"
    )
  for key, var in wanted.items():
    if shapes[key] != tuple(var.get_value().shape):
      raise ValueError(
        f"checkpoint tensor {key!r} has shape {list(shapes[key])}, the model "
        f"expects {list(var.get_value().shape)}"
      )
  default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  for key, var in wanted.items():
    spec = None if sharding is None or mesh is None else sharding(key, shapes[key])
    target = default if mesh is None else NamedSharding(mesh, P() if spec is None else spec)
    abstract = var.get_value()
    var.set_value(_load_tensor(weight_map[key], key, shapes[key], abstract.dtype, target))
  return model


def save_pretrained(
  model: nnx.Module, path: str | os.PathLike[str], *, max_shard_bytes: int = 4 << 30
) -> list[str]:
  """Write ``config.json`` and the weights of ``model`` in Hugging Face's layout.

  Tensors keep their dtype. Files hold at most ``max_shard_bytes`` each
  (one tensor is never split); more than one file gets an index. Returns the
  files written.
  """
  from safetensors.numpy import save_file

  adapters = [key for key, var in checkpoint_keys(model).items() if isinstance(var, nnx.LoRAParam)]
  if adapters:
    raise ValueError(
      f"the model has LoRA adapters ({adapters[0]} ...), which a Hugging Face "
      f"checkpoint cannot hold: save them with cpjax.training.lora.save_adapter, or "
      f"save cpjax.training.lora.merge_lora(model)"
    )
  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    # A Gemma4, whose module imports this one (so its class is not named here).
    cfg: Gemma4Config = model.cfg  # pyrefly: ignore[missing-attribute]
    json.dump(cfg.to_hf(), f, indent=2, sort_keys=True)
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
  names = (
    [SINGLE_FILE]
    if len(groups) == 1
    else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
  )
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
