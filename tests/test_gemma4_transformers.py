"""Live: transformers itself loads what cpjax saves and computes the same
logits. Runs when torch and transformers are importable (CI installs them);
the committed fixtures cover the same ground without them."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpjax.models import gemma4
from cpjax.models.gemma4.checkpoint import checkpoint_keys
from tests.helpers import compiled

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "gemma4")

torch = pytest.importorskip("torch", reason="the live transformers test needs torch")
transformers = pytest.importorskip("transformers", reason="the live test needs transformers")


@pytest.mark.parametrize("name", ["ple_kv_sharing", "moe_k_eq_v_vision", "bidirectional_all"])
def test_transformers_loads_what_cpjax_saves(tmp_path, name):
  """cpjax trains a step's worth of change into the model, saves it, and
  transformers' Gemma4ForConditionalGeneration loads it and computes the
  same logits as cpjax, as close to its own float64 logits as its float32
  logits are."""
  sys.path.insert(0, FIXTURES)
  import make_fixtures

  model = gemma4.Gemma4.from_pretrained(os.path.join(FIXTURES, name))
  # Perturb every tensor so the saved weights are cpjax's, not the fixture's.
  for i, var in enumerate(checkpoint_keys(model).values()):
    noise = jax.random.normal(jax.random.key(i), var.get_value().shape) * 0.01
    var.set_value(var.get_value() + noise * jnp.abs(var.get_value()).mean())
  model.save_pretrained(tmp_path)
  inputs = make_fixtures.batch("images", 7)
  real = inputs["attention_mask"].astype(bool)
  logits = {}
  for dtype in (torch.float64, torch.float32):
    # transformers' grouped-matmul experts have no float64 kernel.
    hf = transformers.Gemma4ForConditionalGeneration.from_pretrained(
      tmp_path, dtype=dtype, experts_implementation="eager"
    ).eval()
    logits[dtype] = make_fixtures.hf_logits(hf, inputs, dtype)
  truth = logits[torch.float64]
  got = np.asarray(compiled(model)(gemma4.prepare_batch(inputs, model.cfg)))
  ours, theirs = np.abs(got - truth)[real], np.abs(logits[torch.float32] - truth)[real]
  # Judged against transformers' float64 run, as a multiple of transformers'
  # own float32 error (measured: max 1.10x / mean 1.06x at most of the three).
  assert ours.max() <= 1.5 * theirs.max() and ours.mean() <= 1.3 * theirs.mean(), (
    ours.max(),
    theirs.max(),
    ours.mean(),
    theirs.mean(),
  )


def test_bfloat16_router_scales_its_input_as_transformers_does():
  """transformers multiplies the router's bfloat16 input by 1/sqrt(D), a
  Python number, in float32 and rounds once; at D = 48, where bfloat16
  cannot hold 1/sqrt(D) (0.14434 rounds to 0.14453), what reaches the
  router's projection is transformers', bit for bit, and so are its choices."""
  import dataclasses

  from flax import nnx

  from cpjax.models.gemma4 import text

  cfg = dataclasses.replace(
    gemma4.Gemma4Config.from_hf(os.path.join(FIXTURES, "moe_k_eq_v_vision")).text,
    hidden_size=48,
  )
  hf_cfg = transformers.Gemma4TextConfig(
    hidden_size=48, num_experts=cfg.num_experts, top_k_experts=cfg.top_k_experts
  )
  torch.manual_seed(0)
  theirs = transformers.models.gemma4.modeling_gemma4.Gemma4TextRouter(hf_cfg)
  with torch.no_grad():
    theirs.proj.weight.normal_(0.0, 48**-0.5)
    theirs.scale.uniform_(0.5, 1.5)
    theirs.per_expert_scale.uniform_(0.5, 1.5)
  theirs = theirs.to(torch.bfloat16).requires_grad_(False)
  x = (torch.randn(64, 48) * 4).to(torch.bfloat16)
  seen = {}
  theirs.proj.register_forward_pre_hook(lambda m, args: seen.update(theirs=args[0]))
  _, their_weights, their_ids = theirs(x)

  ours = text.Router(cfg, rngs=nnx.Rngs(0))
  for name in ("scale", "per_expert_scale"):
    getattr(ours, name).set_value(jnp.asarray(getattr(theirs, name).float().numpy()))
  ours.proj.weight.set_value(jnp.asarray(theirs.proj.weight.float().numpy()))

  class Spy(nnx.Module):  # what reaches the projection
    def __init__(self, proj):
      self.proj = proj

    def __call__(self, z):
      seen["ours"] = z
      return self.proj(z)

  ours.proj = Spy(ours.proj)
  weights, ids = ours(jnp.asarray(x.float().numpy(), jnp.bfloat16))
  z = np.asarray(seen["ours"].astype(jnp.float32))
  np.testing.assert_array_equal(z, seen["theirs"].float().numpy())
  np.testing.assert_array_equal(np.sort(np.asarray(ids), -1), np.sort(their_ids.numpy(), -1))
  np.testing.assert_allclose(np.asarray(weights), their_weights.float().numpy(), rtol=1e-2)
