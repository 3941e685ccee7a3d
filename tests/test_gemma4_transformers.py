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

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "gemma4")

torch = pytest.importorskip("torch", reason="the live transformers test needs torch")
transformers = pytest.importorskip("transformers", reason="the live test needs transformers")


@pytest.mark.parametrize("name", ["ple_kv_sharing", "moe_k_eq_v_vision", "bidirectional_all"])
def test_transformers_loads_what_cpjax_saves(tmp_path, name):
  """cpjax trains a step's worth of change into the model, saves it, and
  transformers' Gemma4ForConditionalGeneration loads it and computes the
  same logits as cpjax."""
  sys.path.insert(0, FIXTURES)
  import make_fixtures

  model = gemma4.Gemma4.from_pretrained(os.path.join(FIXTURES, name))
  # Perturb every tensor so the saved weights are cpjax's, not the fixture's.
  for i, var in enumerate(checkpoint_keys(model).values()):
    noise = jax.random.normal(jax.random.key(i), var.get_value().shape) * 0.01
    var.set_value(var.get_value() + noise * jnp.abs(var.get_value()).mean())
  model.save_pretrained(tmp_path)
  hf = transformers.Gemma4ForConditionalGeneration.from_pretrained(
      tmp_path, dtype=torch.float32).eval()
  kind = "images"
  inputs = make_fixtures.batch(kind, 7)
  want = make_fixtures.hf_logits(hf, inputs, torch.float32)
  got = np.asarray(model(gemma4.prepare_batch(inputs, model.cfg)))
  real = inputs["attention_mask"].astype(bool)
  assert np.abs(got - want)[real].max() <= 1e-4
