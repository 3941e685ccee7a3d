"""The training layer: the step and its loss, LoRA, checkpoints, the plan and the trainer.

It may import the core (:mod:`cpjax.parallel`, :mod:`cpjax.masks`,
:mod:`cpjax.batch`, :mod:`cpjax.attention`), the data pipeline
(:mod:`cpjax.data`) and the models (:mod:`cpjax.models`); only the command
line (:mod:`cpjax.cli`) imports it.

* :mod:`~cpjax.training.step`: ``make_train_step`` / ``make_loss_fn`` for
  any NNX model; :mod:`~cpjax.training.loss`: the cross entropy and its
  exact reduction over the ranks (both re-exported here).
* :mod:`~cpjax.training.lora` (with :mod:`~cpjax.training.lora.peft_format`): LoRA
  adapters and PEFT's file format.
* :mod:`~cpjax.training.checkpointing`: orbax train state, resume.
* :mod:`~cpjax.training.plan`: memory per device, closed form and compiled,
  of a run's :class:`~cpjax.training.plan.StepShape`.
* :mod:`~cpjax.training.run_config` (with its YAML file and command line,
  :mod:`~cpjax.training.run_file`): a run's one config;
  :mod:`~cpjax.training.trainer`: the trainer that runs it (``cpjax train``).

>>> from cpjax import training
>>> training.make_train_step is training.step.make_train_step
True
"""

from cpjax.attention.cp_context import HiddenStates as HiddenStates
from cpjax.attention.cp_context import batch_specs as batch_specs
from cpjax.attention.cp_context import manual_axes as manual_axes
from cpjax.attention.cp_context import state_specs as state_specs
from cpjax.training import loss as loss
from cpjax.training import step as step
from cpjax.training.loss import LOSS_CHUNK_LOGITS as LOSS_CHUNK_LOGITS
from cpjax.training.loss import cross_entropy as cross_entropy
from cpjax.training.loss import cross_entropy_sums as cross_entropy_sums
from cpjax.training.loss import linear_cross_entropy as linear_cross_entropy
from cpjax.training.loss import token_cross_entropy as token_cross_entropy
from cpjax.training.step import TrainStep as TrainStep
from cpjax.training.step import default_forward as default_forward
from cpjax.training.step import make_loss_fn as make_loss_fn
from cpjax.training.step import make_train_step as make_train_step
from cpjax.training.step import stack_microbatches as stack_microbatches

__all__ = [
  "HiddenStates",
  "LOSS_CHUNK_LOGITS",
  "TrainStep",
  "batch_specs",
  "cross_entropy",
  "cross_entropy_sums",
  "default_forward",
  "linear_cross_entropy",
  "make_loss_fn",
  "make_train_step",
  "manual_axes",
  "stack_microbatches",
  "state_specs",
  "token_cross_entropy",
]
