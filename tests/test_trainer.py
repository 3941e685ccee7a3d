"""The trainer's pieces against independent references: the learning-rate
schedules against transformers' own, gradient clipping against a numpy
re-derivation, and the validation loss against the single-device model;
the trainer's types."""

import dataclasses
import os

import numpy as np
import pytest

from cpjax.training.run_config import OptimizerConfig, RunConfig, with_values

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "cpjax", "examples", "chat")
QUIET = lambda *_: None  # noqa: E731


@pytest.mark.parametrize(
  "kind,warmup", [("constant", 0), ("constant", 3), ("cosine", 0), ("cosine", 4), ("linear", 2)]
)
def test_schedules_equal_transformers(kind, warmup):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  steps, lr = 12, 3e-3
  ours = OptimizerConfig(lr=lr, steps=steps, warmup_steps=warmup, schedule=kind).lr_schedule()
  make = {
    "constant": transformers.get_constant_schedule_with_warmup,
    "cosine": transformers.get_cosine_schedule_with_warmup,
    "linear": transformers.get_linear_schedule_with_warmup,
  }[kind]
  opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
  sched = make(opt, warmup, **({} if kind == "constant" else {"num_training_steps": steps}))
  theirs = []
  for _ in range(steps):  # the rate each of the run's steps uses
    theirs.append(opt.param_groups[0]["lr"])
    opt.step()
    sched.step()
  # optax evaluates in float32: its error is float32 rounding of the peak rate.
  np.testing.assert_allclose(
    [float(ours(i)) for i in range(steps)], theirs, rtol=1e-6, atol=lr * 1e-6
  )


def test_bad_schedules_are_run_errors():
  from cpjax.training.run_config import RunError

  with pytest.raises(
    RunError, match="optimizer.warmup_steps 5 must be >= 0, and below optimizer.steps 5"
  ):
    OptimizerConfig(steps=5, warmup_steps=5, schedule="cosine").lr_schedule()
  with pytest.raises(RunError, match="optimizer.schedule must be one of"):
    OptimizerConfig(schedule="step").lr_schedule()


def test_clipping_scales_the_gradient_to_max_grad_norm():
  import jax.numpy as jnp
  import optax

  grads = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([[12.0]])}  # global norm 13
  params = {"a": jnp.zeros(2), "b": jnp.ones((1, 1))}
  clipped = OptimizerConfig(lr=0.1, max_grad_norm=1.3).build()
  updates, _ = clipped.update(grads, clipped.init(params), params)
  # numpy: g * min(1, c / |g|), then plain AdamW on the clipped gradient.
  scaled = {k: np.asarray(v) * min(1.0, 1.3 / 13.0) for k, v in grads.items()}
  plain = optax.adamw(0.1, weight_decay=0.01)
  expected, _ = plain.update(scaled, plain.init(params), params)
  for k in grads:
    np.testing.assert_allclose(updates[k], expected[k], rtol=1e-6)
  unclipped = OptimizerConfig(lr=0.1).build()  # max_grad_norm=None
  updates, _ = unclipped.update(grads, unclipped.init(params), params)
  expected, _ = plain.update(grads, plain.init(params), params)
  for k in grads:
    np.testing.assert_allclose(updates[k], expected[k], rtol=1e-6)


def test_validation_loss_is_the_single_device_loss_of_the_fixed_rows():
  import jax

  from cpjax import training
  from cpjax.models import gemma4
  from cpjax.training.trainer import build, eval_rows
  from cpjax.training.trainer.hooks import Validation

  run = with_values(
    RunConfig(),
    {
      "dataset.seq_len": 128,
      "parallel.cp": 4,
      "optimizer.steps": 4,
      "dataset.batch_size": 2,
      "model": "tiny-bidirectional",
      "parity_check": False,
      "dataset.tokenizer": EXAMPLE,
      "eval.rows": 3,
      "eval.every": 2,
      "eval.data": os.path.join(EXAMPLE, "eval.jsonl"),
    },
  )
  trainer = build(run, log=QUIET)
  host = eval_rows(run, trainer.cfg, trainer.rows, QUIET)
  # 3 rows, filled up to whole batches of the step's 2 rows with an empty one
  assert len(host) == 2 and host[1]["attention_mask"][0].any()
  assert not host[1]["attention_mask"][1].any() and (host[1]["labels"][1] == -100).all()
  _, layout = trainer.shard(host[0])
  summary = {}
  hook = Validation(trainer, layout, summary)
  record = {}
  hook(0, {}, record)
  assert "eval_loss" not in record  # step 1: not a validation step
  hook(1, {}, record)
  # The single-device reference reads host copies (the run keeps its frozen
  # state on the mesh, where a one-device jit cannot take it).
  single = jax.jit(training.make_loss_fn(trainer.graphdef, frozen=jax.device_get(trainer.frozen)))
  params = jax.device_get(trainer.state.params)
  sums = [single(params, gemma4.prepare_batch(b, trainer.cfg)) for b in host]
  reference = sum(float(s) for s, _ in sums) / sum(float(n) for _, n in sums)
  assert summary["eval_rows"] == 3
  np.testing.assert_allclose(record["eval_loss"], reference, rtol=2e-6)
  assert summary["eval_losses"] == [(2, record["eval_loss"])]


@pytest.mark.parametrize("which", ["validation", "checkpoint"])
def test_a_failing_hook_saves_the_run_and_names_itself(tmp_path, monkeypatch, which):
  """A hook fails after step 2 of 3. The validation hook: the state after
  step 2 is in --state-dir and its weights in --save before the error, which
  names the hook and the step. The checkpoint hook itself: no second try at
  the state, the weights still saved."""
  from flax import nnx

  from cpjax.models import gemma4
  from cpjax.training import trainer
  from cpjax.training.checkpointing import TrainCheckpointer
  from cpjax.training.trainer import hooks

  hook = {"validation": hooks.Validation, "checkpoint": hooks.Checkpoints}[which]
  real = hook.__call__

  def failing(self, i, metrics, record):
    if i == 1:
      raise OSError("the disk is full")
    real(self, i, metrics, record)

  monkeypatch.setattr(hook, "__call__", failing)
  run = with_values(
    RunConfig(),
    {
      "dataset.seq_len": 64,
      "parallel.cp": 2,
      "optimizer.steps": 3,
      "dataset.batch_size": 2,
      "parity_check": False,
      "dataset.tokenizer": EXAMPLE,
      "eval.rows": 2,
      "eval.every": 1,
      "eval.data": os.path.join(EXAMPLE, "eval.jsonl"),
      "checkpointing.state_dir": str(tmp_path / "state"),
      "checkpointing.save": str(tmp_path / "out"),
    },
  )
  state = r"the train state after step 2 is in .*state; " if which == "validation" else ""
  with pytest.raises(
    RuntimeError,
    match=rf"the {which} hook failed after step 2: OSError: "
    rf"the disk is full \({state}the weights after step 2 "
    rf"are in .*out\)",
  ):
    trainer.train(run, log=QUIET)
  assert TrainCheckpointer(run.checkpointing.state_dir).latest_step() == (
    2 if which == "validation" else None
  )
  saved = gemma4.Gemma4.from_pretrained(run.checkpointing.save)  # a whole checkpoint, trained
  initial = gemma4.Gemma4(saved.cfg, rngs=nnx.Rngs(run.seed))
  assert not np.array_equal(
    saved.model.language_model.embed_tokens.weight[...],
    initial.model.language_model.embed_tokens.weight[...],
  )


def test_the_trainer_and_its_state_are_typed_and_the_state_is_a_pytree():
  """Every field of the Trainer and its TrainState has a type (none Any); the
  state is a pytree whose step rides along static."""
  import jax

  from cpjax.training.trainer import Trainer, TrainState

  for cls in (Trainer, TrainState):
    hints = cls.__annotations__  # as written (the modules postpone evaluation)
    assert sorted(hints) == sorted(f.name for f in dataclasses.fields(cls)), cls
    assert not [name for name, hint in hints.items() if "Any" in str(hint)], cls
  state = TrainState({"w": np.ones(2, np.float32)}, (np.zeros(3, np.float32),), step=5)
  assert len(jax.tree.leaves(state)) == 2
  doubled = jax.tree.map(lambda x: 2 * x, state)
  assert isinstance(doubled, TrainState) and doubled.step == 5
  np.testing.assert_array_equal(doubled.params["w"], [2.0, 2.0])
  assert jax.device_get(state).step == 5


def test_train_takes_a_run_config_and_fit_a_fresh_trainer():
  """Bad input is refused before any compute: a dict for a run, a run that
  does not check, a trainer that has trained already."""
  from cpjax.training.run_config import RunError
  from cpjax.training.trainer import TrainState, build, fit, train

  with pytest.raises(TypeError, match="train takes a RunConfig, got dict"):
    train({"model": "tiny"})
  with pytest.raises(TypeError, match="build takes a RunConfig, got dict"):
    build({"model": "tiny"})
  with pytest.raises(RunError, match="dataset.seq_len must be >= 32, got 16"):
    build(with_values(RunConfig(), {"dataset.seq_len": 16}))
  run = with_values(RunConfig(), {"parallel.cp": 2, "dataset.seq_len": 64, "parity_check": False})
  trainer = build(run, log=QUIET)
  trainer.state = TrainState(trainer.state.params, trainer.state.opt_state, step=1)
  with pytest.raises(RunError, match="fit starts from a trainer at step 0 .* after step 1"):
    fit(trainer)


@pytest.mark.parametrize("data", [None, "chat.jsonl"])
def test_a_checkpoint_trained_without_data_is_said_loudly(data):
  """`cpjax train --checkpoint DIR` without --data trains on synthetic rows: the
  opening lines say so in a WARNING line naming --data; with data, no warning."""
  import types

  import jax

  from cpjax.models.gemma4 import Gemma4Config
  from cpjax.training.trainer.loop import describe

  run = with_values(
    RunConfig(),
    {"checkpoint": "gemma-4-E2B-it", "dataset.path": data, "parallel.strategy": "ring"},
  )
  lines = []
  describe(
    types.SimpleNamespace(
      run=run,
      log=lines.append,
      mesh=jax.make_mesh((8,), ("cp",)),
      cfg=Gemma4Config.preset("tiny"),
      description="Gemma 4 checkpoint gemma-4-E2B-it",
    )
  )
  warned = [line for line in lines if line.startswith("WARNING: no --data: gemma-4-E2B-it")]
  assert len(warned) == (data is None), lines
