"""The loss against an independent reference: optax's integer-label cross
entropy and a float64 numpy formula, on random soft-capped logits with
ignored labels; and the CP reduction against the same numbers."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from cpjax import train
from tests.helpers import cp_mesh

B, L, V, CAP = 2, 12, 37, 30.0


def soft_capped_logits(seed: int) -> np.ndarray:
  """Gemma's soft cap on wide random logits: cap * tanh(x / cap)."""
  x = np.random.default_rng(seed).normal(0.0, 20.0, (B, L, V)).astype(np.float32)
  return (CAP * np.tanh(x / CAP)).astype(np.float32)


def labels_with_ignored(seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed + 1)
  labels = rng.integers(0, V, (B, L)).astype(np.int32)
  labels[rng.random((B, L)) < 0.3] = -100
  labels[0, 0], labels[1, -1] = -100, V - 1          # an ignored token and the last class
  return labels


def numpy_loss(logits: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
  """float64: sum over counted tokens of logsumexp(z) - z[label], and the count."""
  z = logits.astype(np.float64)
  top = z.max(-1, keepdims=True)
  lse = (top + np.log(np.exp(z - top).sum(-1, keepdims=True)))[..., 0]
  valid = labels != -100
  picked = np.take_along_axis(z, np.where(valid, labels, 0)[..., None], -1)[..., 0]
  return float(np.sum(np.where(valid, lse - picked, 0.0))), float(valid.sum())


@pytest.mark.parametrize("seed", [0, 1])
def test_token_cross_entropy_equals_optax_and_numpy(seed):
  logits, labels = soft_capped_logits(seed), labels_with_ignored(seed)
  ce_sum, count = train.token_cross_entropy(logits, labels)
  want_sum, want_count = numpy_loss(logits, labels)
  assert float(count) == want_count
  np.testing.assert_allclose(float(ce_sum), want_sum, rtol=2e-6)
  valid = labels != -100
  per_token = optax.softmax_cross_entropy_with_integer_labels(logits, np.where(valid, labels, 0))
  np.testing.assert_allclose(float(ce_sum), float(jnp.sum(jnp.where(valid, per_token, 0.0))),
                             rtol=2e-6)

  # Gradient w.r.t. the logits: (softmax - one_hot) / count on counted tokens, 0 elsewhere.
  grad = jax.grad(lambda z: train.token_cross_entropy(z, labels)[0] / count)(logits)
  z = logits.astype(np.float64)
  soft = np.exp(z - z.max(-1, keepdims=True))
  soft /= soft.sum(-1, keepdims=True)
  want = (soft - np.eye(V)[np.where(valid, labels, 0)]) * valid[..., None] / want_count
  np.testing.assert_allclose(np.asarray(grad), want, atol=2e-7)
  assert np.all(np.asarray(grad)[~valid] == 0.0)


def test_ignore_index_is_honoured():
  logits, labels = soft_capped_logits(2), labels_with_ignored(2)
  other = np.where(labels == -100, 7, labels)          # 7 is a class id, -100 a real label now
  relabelled = np.where(labels == -100, -1, labels)
  got = train.token_cross_entropy(logits, relabelled, ignore_index=-1)
  chex.assert_trees_all_close(got, train.token_cross_entropy(logits, labels), rtol=1e-7)
  assert float(train.token_cross_entropy(logits, other)[1]) == B * L


@pytest.mark.parametrize("cp", [2, 4])
def test_cross_entropy_sums_over_cp_equal_the_whole_row(cp):
  """Each rank holds L/cp tokens; the psum-ed sums are the numpy sums of the row."""
  mesh = cp_mesh(cp)
  logits, labels = soft_capped_logits(3), labels_with_ignored(3)
  f = jax.jit(jax.shard_map(lambda z, y: train.cross_entropy_sums(z, y), mesh=mesh,
                            in_specs=P(None, "cp"), out_specs=P()))
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "cp")))
  ce_sum, count = f(put(logits), put(labels))
  want_sum, want_count = numpy_loss(logits, labels)
  assert float(count) == want_count
  np.testing.assert_allclose(float(ce_sum), want_sum, rtol=2e-6)
