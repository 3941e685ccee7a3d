"""Hugging Face checkpoints: strict, streaming load and bit-exact save.

A :class:`Gemma4` parameter's NNX path is its checkpoint key, so a
checkpoint is read by walking the model's variables and the safetensors
files side by side:

* strict: a missing key, an unexpected key or a wrong shape is a
  ``ValueError`` naming the key (and both shapes), raised after reading the
  file headers only, before any tensor is read. The documented exceptions
  are skipped, as transformers skips them: K/V weights stored for K/V-sharing
  ``reuse`` layers, the audio tower's and embedder's weights when the config
  has no audio, and ``lm_head.weight`` of a model with tied embeddings;
* streaming: each tensor goes straight to its device(s) without a second
  whole host copy. Every device reads only its own shard from the
  safetensors file (a slice, so a sharded table is never read whole), in
  row chunks of at most :data:`CHUNK_BYTES` written into a preallocated
  device buffer in place (a donated ``dynamic_update_slice``; on the CPU
  backend, a copy into the buffer's own memory); the file is
  reopened per chunk, so no mapping of it stays resident. The model is built
  abstractly first, so no random initialisation is ever materialised. Peak
  host memory is the loaded parameters plus about two chunks;
* quantizing: :func:`load_weights` fills a model built abstractly that may
  hold weights quantized by qwix (a LoRA model on an int8 / int4 / nf4
  base): each such tensor is read in bfloat16 onto its devices and
  quantized there before the next is read, so the model never exists whole
  in the checkpoint's dtype;
* saving writes ``config.json`` and safetensors shards (with an index when
  there is more than one) that transformers' ``from_pretrained`` loads.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import os
import re
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from cpjax import parallel
from cpjax.models.gemma4.config import Gemma4Config
from cpjax.models.gemma4.layers import Buffer

__all__ = ["KeySharding", "checkpoint_keys", "load_pretrained", "load_weights", "save_pretrained"]

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
  if _AUDIO.match(key):  # a config without audio_config (one built by hand) skips them
    return cfg.audio is None
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
  cfg = Gemma4Config.from_hf(os.fspath(path))
  model = parallel.abstract_model(
    lambda: cls(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype, remat=remat)
  )
  return load_weights(model, path, mesh=mesh, sharding=sharding)


def _quantized(value: object) -> qwix.QArray | None:
  """The QArray a weight slot holds when qwix keeps it quantized, else None:
  a projection under qwix's PTQ holds ``WithAux(array=QArray, how)`` in
  place of its Param; an expert tensor, a Param whose value is a QArray."""
  array = getattr(value, "array", None)  # qwix's WithAux (not public API: its shape)
  if isinstance(array, qwix.QArray):
    boxed = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    return jax.tree.map(lambda v: v.get_value() if boxed(v) else v, array, is_leaf=boxed)
  if isinstance(value, nnx.Param) and isinstance(value.get_value(), qwix.QArray):
    return value.get_value()
  return None


def _weight_slots(model: nnx.Module) -> dict[str, Any]:
  """{checkpoint key: what ``model`` holds there}: a Param or Buffer, or a
  quantized weight (see :func:`_quantized`). LoRA adapters are not the
  checkpoint's, and a quantized weight's own Params (``key.array.qvalue``)
  are reached through it."""
  slots = {}
  for path, value in nnx.iter_graph(model):
    if _quantized(value) is not None or (
      isinstance(value, (nnx.Param, Buffer)) and not isinstance(value, nnx.LoRAParam)
    ):
      slots[".".join(str(p) for p in path)] = value
  inner = tuple(f"{key}." for key, value in slots.items() if _quantized(value) is not None)
  return {k: v for k, v in slots.items() if not k.startswith(inner)}


def _scheme(q: qwix.QArray) -> tuple:
  """``qwix.quantize``'s arguments that made ``q``, read off its shapes: an
  axis the scales keep whole is per-channel, one they collapse is reduced
  whole, one they split into groups is tiled. Hashable: (qtype, channelwise
  axes, ((axis, tile), ...), scale dtype)."""
  channelwise, tiled = [], []
  for axis, (n, groups) in enumerate(zip(q.qvalue.shape, q.scale.shape)):
    if groups == n:
      channelwise.append(axis)
    elif groups > 1:
      tiled.append((axis, n // groups))
  qtype = q.qvalue.dtype if q.qtype is None else q.qtype
  return qtype, tuple(channelwise), tuple(tiled), q.scale.dtype


@functools.lru_cache(maxsize=64)
def _quantizer(scheme: tuple, shardings) -> Callable:
  """The jitted quantization of one scheme onto ``(values, scales)``
  shardings: compiled once per weight shape, not once per layer."""
  qtype, channelwise, tiled, scale_dtype = scheme

  def quantize(w):
    q = qwix.quantize(
      w, qtype, channelwise_axes=channelwise, tiled_axes=dict(tiled), scale_dtype=scale_dtype
    )
    return q.qvalue, q.scale

  return jax.jit(quantize, out_shardings=shardings)


def _quantize_as(weight: jax.Array, like: qwix.QArray, shardings) -> tuple[jax.Array, jax.Array]:
  """``weight`` quantized as ``like`` was, as (values, scales) placed per ``shardings``."""
  return _quantizer(_scheme(like), shardings)(weight)


def load_weights(
  model: _Model,
  path: str | os.PathLike[str],
  *,
  mesh: Mesh | None = None,
  sharding: KeySharding | None = None,
) -> _Model:
  """Read the checkpoint in ``path`` into ``model``, built abstractly, in place.

  ``model`` comes from ``nnx.eval_shape`` (no weight materialised): a
  :class:`Gemma4`, or one that qwix adapted and quantized abstractly
  (:func:`cpjax.training.lora.apply_lora_lazily`). Each checkpoint tensor is
  read as the module doc says, in the dtype its slot holds; a weight the
  model holds quantized (qwix's QArray) is read in its scales' dtype and
  quantized as its abstract QArray was made, one tensor at a time on its
  own devices: the model never exists whole in the checkpoint's dtype, and
  peak memory is the quantized model plus about one tensor. Variables the
  checkpoint does not hold (LoRA adapters) are left as they are.

  Args:
    model: the abstract model.
    path: the checkpoint's directory.
    mesh: the mesh to place the tensors on, or None.
    sharding: ``sharding(key, shape)``, each tensor's ``PartitionSpec``
      (a quantized weight's values and scales are asked for as
      ``key.qvalue`` and ``key.scale``).

  Returns:
    ``model``, filled.
  """
  path = os.fspath(path)
  cfg: Gemma4Config = model.cfg  # pyrefly: ignore[missing-attribute]
  wanted = _weight_slots(model)
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
  for key, slot in wanted.items():
    q = _quantized(slot)
    expected = tuple((q.qvalue if q is not None else slot.get_value()).shape)
    if shapes[key] != expected:
      raise ValueError(
        f"checkpoint tensor {key!r} has shape {list(shapes[key])}, the model "
        f"expects {list(expected)}"
      )
  default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  # A weight to quantize is read onto an all-Auto view of the mesh (the same
  # devices and split): qwix's NormalFloat flattens it, which Explicit
  # sharding has no typing rule for. Its quantized form goes on the mesh.
  auto = None if mesh is None else Mesh(mesh.devices, mesh.axis_names)

  def target(key: str, shape: tuple[int, ...], on: Mesh | None = mesh):
    if on is None:
      return default
    spec = None if sharding is None else sharding(key, shape)
    return NamedSharding(on, P() if spec is None else spec)

  for key, slot in wanted.items():
    file, shape = weight_map[key], shapes[key]
    q = _quantized(slot)
    if q is None:
      slot.set_value(_load_tensor(file, key, shape, slot.get_value().dtype, target(key, shape)))
      continue
    weight = _load_tensor(file, key, shape, q.scale.dtype, target(f"{key}.qvalue", shape, auto))
    values, scales = _quantize_as(
      weight, q, (target(f"{key}.qvalue", shape), target(f"{key}.scale", q.scale.shape))
    )
    del weight  # the tensor in the checkpoint's dtype lives no longer than this
    if isinstance(slot, nnx.Param):  # an expert tensor
      slot.set_value(dataclasses.replace(q, qvalue=values, scale=scales))
    else:  # qwix's WithAux: its QArray's fields are Params
      slot.array.qvalue.set_value(values)
      slot.array.scale.set_value(scales)
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
