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

Tensors a module runs itself are PEFT's ``target_parameters`` (a regex or
names, matched the same way against ``<module path>.<tensor name>``): Gemma
4's MoE experts, [E, out, in] tensors run by a grouped matmul, which list
them in ``lora_parameters``. Each expert ``e`` gains its own factors ``A_e``
[I, r] and ``B_e`` [r, O], stored as ``<tensor>_lora_a`` [E, I, r] and
``<tensor>_lora_b`` [E, r, O] and applied by the experts on every path,
placed with their experts over ``ep``; PEFT's files hold them as its
``ParamWrapper`` does (:mod:`~cpjax.training.lora.peft_format`). By default
both expert tensors of an MoE are adapted; ``target_parameters=()`` leaves
them frozen.

A quantized frozen base (QLoRA: ``base_dtype`` int8, int4, nf4 or float8_e4m3fn, with
``group_size``) is :mod:`~cpjax.training.lora.quantize`: qwix quantizes the
decoder's projections as they run in the creation pass, and the experts'
tensors are quantized beside them; the adapters stay float32. A base read
from a checkpoint is quantized as it is read, tensor by tensor
(:func:`apply_lora_lazily`, then the checkpoint's ``load_weights``), so its
bfloat16 is never whole in memory.

Shape letters: ``I`` a projection's input width, ``O`` its output width,
``r`` the rank, ``E`` experts.

The adapters are :mod:`~cpjax.training.lora.adapters`, PEFT's files
:mod:`~cpjax.training.lora.peft_format`, a quantized base
:mod:`~cpjax.training.lora.quantize`; their names are re-exported here.
"""

from cpjax.training.lora.adapters import DEFAULT_LORA_PARAMETERS as DEFAULT_LORA_PARAMETERS
from cpjax.training.lora.adapters import DEFAULT_LORA_TARGETS as DEFAULT_LORA_TARGETS
from cpjax.training.lora.adapters import LoraConfig as LoraConfig
from cpjax.training.lora.adapters import adapted_modules as adapted_modules
from cpjax.training.lora.adapters import apply_lora as apply_lora
from cpjax.training.lora.adapters import apply_lora_lazily as apply_lora_lazily
from cpjax.training.lora.adapters import check_lora_config as check_lora_config
from cpjax.training.lora.adapters import lora_param_count as lora_param_count
from cpjax.training.lora.adapters import merge_lora as merge_lora
from cpjax.training.lora.adapters import split_lora as split_lora
from cpjax.training.lora.peft_format import ADAPTER_CONFIG_FILE as ADAPTER_CONFIG_FILE
from cpjax.training.lora.peft_format import ADAPTER_WEIGHTS_FILE as ADAPTER_WEIGHTS_FILE
from cpjax.training.lora.peft_format import load_adapter as load_adapter
from cpjax.training.lora.peft_format import read_adapter_config as read_adapter_config
from cpjax.training.lora.peft_format import save_adapter as save_adapter
from cpjax.training.lora.quantize import QUANTIZED_DTYPES as QUANTIZED_DTYPES

__all__ = [
  "ADAPTER_CONFIG_FILE",
  "ADAPTER_WEIGHTS_FILE",
  "DEFAULT_LORA_PARAMETERS",
  "DEFAULT_LORA_TARGETS",
  "LoraConfig",
  "QUANTIZED_DTYPES",
  "adapted_modules",
  "apply_lora",
  "apply_lora_lazily",
  "check_lora_config",
  "load_adapter",
  "lora_param_count",
  "merge_lora",
  "read_adapter_config",
  "save_adapter",
  "split_lora",
]
