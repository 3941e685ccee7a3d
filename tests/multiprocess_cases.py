"""The computations the multi-process test runs, identically in 1 and 2 processes."""

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cpjax
from cpjax import training
from cpjax.models import gemma4
from tests.helpers import fewest_layers

# tiny-moe cut to one sliding and one full layer: every kind of layer it has
# (MoE beside the MLP, k_eq_v on the full layer, vision groups on the sliding
# one) at half the compile time of its four layers.
CFG = fewest_layers(gemma4.Gemma4Config.preset("tiny-moe"))


def new_model() -> gemma4.Gemma4:
  """The model at seed 0, initialised by one compiled program (eagerly, each
  process would compile its initialisers one by one)."""
  return nnx.jit(lambda: gemma4.Gemma4(CFG, rngs=nnx.Rngs(0)))()


def _global(mesh, x, spec):
  """A global array from a host value every process holds in full."""
  x = np.asarray(x)
  sharding = NamedSharding(mesh, spec)
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def crossing_devices() -> list:
  """The 8 devices ordered so that an (fsdp 2, cp 4) mesh crosses the process
  boundary on both axes: rows (0, 1 | 4, 5) and (6, 7 | 2, 3) of 2 processes
  x 4 devices. One process of 8 devices takes the same order."""
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  return [devices[i] for i in (0, 1, 4, 5, 6, 7, 2, 3)]


def run_fsdp(ckpt_dir) -> dict:
  """Three momentum-SGD steps of a tiny Gemma 4 (MoE, k_eq_v, vision groups)
  on an (fsdp 2, cp 4) mesh, saving after step 1, then steps 2 and 3 again
  from the restored checkpoint.

  Across 2 processes both axes span them (:func:`crossing_devices`): a
  process holds half of every parameter and of the optimizer state, and the
  ring passes K/V between processes.
  """
  from cpjax import parallel
  from cpjax.training.checkpointing import TrainCheckpointer

  mesh = parallel.make_mesh(fsdp=2, cp=4, devices=crossing_devices())
  model = new_model()
  sharder = model.prepare_model_inputs_for_cp(layout="load_balanced")["cp_sharder"]
  graphdef, params, buffers = nnx.split(model, nnx.Param, ...)
  specs = parallel.param_specs(params, mesh, rule=gemma4.partition_rule(CFG, tp=1))
  params = parallel.shard_params(params, mesh, specs)
  opt = optax.sgd(0.1, momentum=0.9)  # Adam's sign-like first steps would hide grad parity
  opt_state = parallel.shard_like_params(opt.init(params), params)
  batches = []
  for i in range(3):
    b = gemma4.synthetic_batch(np.random.default_rng(20 + i), CFG, batch_size=2, seq_len=60)
    batches.append(sharder.shard_batch(b, mesh, batch_axis="fsdp"))
  step = training.make_train_step(graphdef, opt, mesh=mesh, layout=batches[0][1], frozen=buffers)
  ckpt = TrainCheckpointer(ckpt_dir)
  out = {}
  for i, (b, _) in enumerate(batches):
    params, opt_state, metrics = step(params, opt_state, b)
    out[f"fsdp/loss{i}"] = metrics["loss"]
    if i == 0:
      ckpt.maybe_save(
        1, params=params, opt_state=opt_state, data_state={"next": 1}, run={}, force=True
      )
      ckpt.wait()
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    out["fsdp_params" + jax.tree_util.keystr(path)] = leaf
  first, restored = ckpt.restore(params_like=params, opt_state_like=opt_state)
  ckpt.close()
  assert first == 1 and restored["data_state"] == {"next": 1}, (first, restored["data_state"])
  params, opt_state = restored["params"], restored["opt_state"]
  for i in range(restored["data_state"]["next"], 3):
    params, opt_state, metrics = step(params, opt_state, batches[i][0])
    out[f"resumed/loss{i}"] = metrics["loss"]
  out.update(_lora_step(mesh, specs, batches[0]))
  return out


def _lora_step(mesh, specs, sharded) -> dict:
  """One SGD step of LoRA adapters (cpjax.training.lora) on the same mesh: the frozen
  base sharded as the parameters were, the adapters too, and the MoE's
  experts split over cp (ep=4: tokens cross the processes to them)."""
  from cpjax import parallel
  from cpjax.training import lora

  # The adapters made by one compiled creation pass (apply_lora's runs the
  # model op by op), then the base's values: every factor is set below.
  model = lora.apply_lora_lazily(
    lambda: gemma4.Gemma4(CFG, rngs=nnx.Rngs(0)), lora.LoraConfig(rank=4, alpha=8.0)
  )
  nnx.update(model, nnx.state(new_model()))
  for i, (_, var) in enumerate(nnx.iter_graph(model)):  # B away from zero: A gets gradients
    if isinstance(var, nnx.LoRAParam):
      var.set_value(jax.random.normal(jax.random.key(i), var.shape) * 0.05)
  graphdef, adapters, frozen = lora.split_lora(model)
  experts = parallel.expert_axes(mesh, 4)
  rule = gemma4.partition_rule(CFG, tp=1, expert_axes=experts)
  start = jax.device_get(adapters)
  adapters = parallel.shard_params(adapters, mesh, parallel.param_specs(adapters, mesh, rule=rule))
  frozen = parallel.shard_params(frozen, mesh, parallel.param_specs(frozen, mesh, rule=rule))
  opt = optax.sgd(0.1)
  step = training.make_train_step(
    graphdef, opt, mesh=mesh, layout=sharded[1], frozen=frozen, expert_axes=experts
  )
  new, _, metrics = step(adapters, opt.init(adapters), sharded[0])
  out = {"lora/loss": metrics["loss"]}
  for (path, leaf), first in zip(jax.tree_util.tree_leaves_with_path(new), jax.tree.leaves(start)):
    out["lora_update" + jax.tree_util.keystr(path)] = leaf - first
  return out


def run_all(mesh) -> dict:
  """Shard a batch, ring attention forward and backward.

  Returns fully replicated or sharded global arrays (gather them to compare).
  """
  out = {}
  rng = np.random.default_rng(0)
  batch = gemma4.synthetic_batch(rng, CFG, batch_size=2, seq_len=60)
  sharded, layout = cpjax.shard_batch(batch, mesh, layout="load_balanced")
  for key in ("labels", "position_ids", "_packed_seq_ids", "padding_mask"):
    out[f"shard/{key}"] = sharded[key]

  # Ring attention on the sharded document ids, forward and backward.
  s = layout.padded_seq_len
  q, k, v = (rng.standard_normal((2, s, 4, 8)).astype(np.float32) for _ in range(3))
  spec = P(None, "cp")
  q, k, v = (_global(mesh, x, spec) for x in (q, k, v))

  def attend(q, k, v, doc_ids, pad):
    return cpjax.ring_attention(
      q, k, v, layout=layout, document_ids=doc_ids, padding_mask=pad, sliding_window=12
    )

  f = jax.shard_map(attend, mesh=mesh, in_specs=spec, out_specs=spec)

  @jax.jit
  def forward_and_grads(q, k, v, doc_ids, pad):
    """The output and the gradient of sum(out^2) (one program: a compile)."""
    out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, doc_ids, pad), q, k, v)
    return out, vjp(2 * out)

  # Global arrays of a multi-process mesh must be arguments, never closed over.
  doc_ids, pad = sharded["_packed_seq_ids"], sharded["padding_mask"]
  with jax.set_mesh(mesh):
    out["ring/out"], grads = forward_and_grads(q, k, v, doc_ids, pad)
  for name, g in zip("qkv", grads):
    out[f"ring/d{name}"] = g

  return out
