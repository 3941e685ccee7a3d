"""Training state split over every token axis (fsdp x cp, the default):
parameters, their gradients and the optimizer state, each decoder layer's
weights gathered where it runs, inside its remat scope; and the choice to keep
the state whole over cp (``state_axes=("fsdp",)``). The meshes of
tests/test_parallel.py run the default without remat; here the remat scope,
the whole-over-cp choice, and what a device holds."""

import jax
import numpy as np
import pytest

from cpjax import parallel
from tests import test_parallel as tp


@pytest.mark.parametrize(
  "shape,state_axes,remat",
  [
    ({"cp": 8}, parallel.STATE_AXES, "full"),  # gathered inside each layer's remat scope
    ({"cp": 4}, ("fsdp",), "none"),  # whole over cp: no gathers
  ],
  ids=["cp8-split-remat", "cp4-whole"],
)
def test_the_step_equals_the_single_device_step(shape, state_axes, remat):
  _, _, _, params, _, _ = tp.setup("tiny")
  want_loss, want = tp.single_device_step("tiny")
  loss, new, step, placed, _ = tp.mesh_step("tiny", shape, state_axes=state_axes, remat=remat)
  assert abs(loss - want_loss) <= 1e-6 * want_loss
  tp.assert_same_update(new, want, params)
  assert tp.shardings(new) == tp.shardings(placed)  # the update keeps the state's split
  split = [s for s in tp.shardings(placed) if "cp" in jax.tree.leaves(tuple(s.spec))]
  assert bool(split) == ("cp" in state_axes), len(split)


def _param_bytes(step, params) -> int:
  """Per-device bytes of the parameters the compiled ``step`` takes."""
  return sum(
    int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize
    for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(step.input_shardings[0]))
  )


def test_a_cp_rank_holds_what_an_fsdp_rank_holds():
  """Per-device parameter bytes the compiled step takes on cp=8 within 2% of
  what fsdp=8 places per device; whole over cp, 8 times as much. (The moments
  follow the parameters: tests/test_parallel.py.)"""
  cfg, _, _, params, _, _ = tp.setup("tiny")
  step = tp.mesh_step("tiny", {"cp": 8})[2]

  def placed(shape, state_axes=parallel.STATE_AXES):
    mesh = parallel.make_mesh(**shape)
    specs = parallel.param_specs(
      params, mesh, rule=tp.partition_rule(cfg, tp=1), state_axes=state_axes
    )
    return parallel.bytes_per_device(parallel.shard_params(params, mesh, specs))

  fsdp8, cp8 = placed({"fsdp": 8}), _param_bytes(step, params)
  assert cp8 <= 1.02 * fsdp8, (cp8, fsdp8)
  assert cp8 == placed({"cp": 8})
  assert placed({"cp": 8}, ("fsdp",)) == parallel.bytes_per_device(params)


@pytest.mark.parametrize("state_axes", [(), ("cp",), ("fsdp", "tp"), "fsdp"])
def test_state_axes_must_name_the_token_axes(state_axes):
  with pytest.raises(ValueError, match="state_axes must be"):
    parallel.param_specs({"w": np.ones((4, 4))}, parallel.make_mesh(cp=2), state_axes=state_axes)


@pytest.mark.parametrize(
  "shard_state,lora_rank", [("fsdp+cp", None), ("fsdp", None), ("fsdp+cp", 4)]
)
def test_cpjax_train_places_the_state_as_shard_state_says(shard_state, lora_rank):
  """`cpjax train --shard-state` (parallel.shard_state): the trainer's trained
  state and its Adam moments, and under LoRA the frozen base, split over cp
  or whole over it; per device, 1/8 of the state or all of it on cp=8."""
  from cpjax.training.run_config import LoraConfig, ParallelConfig, RunConfig
  from cpjax.training.trainer import build

  run = RunConfig(
    model="tiny",
    parallel=ParallelConfig(cp=8, shard_state=shard_state),
    lora=LoraConfig(rank=lora_rank),
    parity_check=False,
  )
  trainer = build(run)
  over_cp = shard_state == "fsdp+cp"
  trees = {"params": trainer.state.params, "moments": trainer.state.opt_state}
  if lora_rank is not None:
    trees["frozen base"] = trainer.frozen
  for name, tree in trees.items():
    arrays = [x for x in jax.tree.leaves(tree) if getattr(x, "size", 0) > 1]
    whole = sum(x.nbytes for x in arrays)
    held = parallel.bytes_per_device(arrays)
    # Leaves no dimension of which 8 divides stay whole (a few scalars and
    # odd widths): within 2% of an eighth.
    assert held == (pytest.approx(whole / 8, rel=0.02) if over_cp else whole), (name, held, whole)
