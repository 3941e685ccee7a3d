"""E2B and E4B's audio tower (transformers' ``Gemma4AudioModel``; the published
configs' parameter trees are test_gemma4_published's). On a tiny random
E2B-like checkpoint transformers saved, with an image and two clips (one
padded) in the same rows: cpjax's logits on one device and under CP equal
transformers' float64 logits within 5x transformers' own float32 error; the
loss's gradient under CP equals one device's and reaches every tensor of the
tower; cpjax's save loads back into transformers; clips that disagree with
their placeholders are refused."""

import contextlib
import os
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cpjax import parallel
from cpjax.models import gemma4

torch = pytest.importorskip("torch", reason="transformers' audio tower needs torch")
transformers = pytest.importorskip("transformers", reason="the reference is transformers'")

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "gemma4")
sys.path.insert(0, FIXTURES)
import make_fixtures  # noqa: E402

from tests.helpers import (  # noqa: E402
  assert_cp_gradient_equals_one_device,
  assert_within_transformers_error,
  transformers_logits,
)

TIMES_FLOAT32 = 5.0
AUDIO = 258881
FRAMES = 30  # feature frames a clip slot holds: 8 soft tokens at most


def audio_rows(seed: int = 0) -> dict:
  """Two rows of 48 tokens as the processor lays them out: row 0 holds an
  image of 4 soft tokens and a full clip (30 frames: 8 soft tokens); row 1,
  left-padded by 3, a clip of 19 real frames (5 soft tokens) and text."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(5, 256, (2, 48))
  types = np.zeros((2, 48), np.int64)
  pixels, positions, n_image = make_fixtures._image(rng, 6, 6)
  ids[0, 2] = make_fixtures.BOI
  ids[0, 3 : 3 + n_image], types[0, 3 : 3 + n_image] = make_fixtures.IMAGE, 1
  ids[0, 3 + n_image] = make_fixtures.EOI
  for row, (start, n) in ((0, (20, 8)), (1, (30, 5))):
    ids[row, start : start + n], types[row, start : start + n] = AUDIO, 3
  mask = np.ones((2, 48), np.int64)
  ids[1, :3], mask[1, :3] = 0, 0
  real = np.arange(FRAMES)[None] < np.array([[FRAMES], [19]])
  features = rng.normal(size=(2, FRAMES, 16)).astype(np.float32) * real[..., None]
  return {
    "input_ids": ids,
    "attention_mask": mask,
    "mm_token_type_ids": types,
    "pixel_values": pixels[None],
    "image_position_ids": positions[None],
    "input_features": features,
    "input_features_mask": real,
  }


@contextlib.contextmanager
def _float64_audio_tower(model):
  """transformers' audio tower calls ``.float()`` to compute its attention in
  float32 whatever the model's dtype, and so cannot run in float64. In the
  float64 run ``.float()`` of a float64 tensor stays float64 while the tower
  runs; only the attention's softmax, which transformers asks for in float32
  (``F.softmax(..., dtype=torch.float32)``), rounds to float32 there."""
  upcast = torch.Tensor.float

  def keep(t, *a, **k):
    return t if t.dtype == torch.float64 else upcast(t, *a, **k)

  def enter(*_):
    torch.Tensor.float = keep

  def leave(*_):
    torch.Tensor.float = upcast

  tower = model.model.audio_tower
  hooks = [tower.register_forward_pre_hook(enter), tower.register_forward_hook(leave)]
  try:
    yield
  finally:
    for h in hooks:
      h.remove()
    torch.Tensor.float = upcast


@pytest.fixture(scope="module")
def e2b_audio(tmp_path_factory):
  """(checkpoint directory, transformers' float64 and float32 logits of the rows)."""
  path = str(tmp_path_factory.mktemp("e2b-audio"))
  model = make_fixtures.build_audio(seed=0)
  model.save_pretrained(path)
  return path, transformers_logits(model, audio_rows(), _float64_audio_tower)


def assert_near_transformers(got, logits):
  real = audio_rows()["attention_mask"].astype(bool)
  assert_within_transformers_error(got, logits, real, TIMES_FLOAT32)


def test_logits_equal_transformers_on_one_device(e2b_audio):
  path, logits = e2b_audio
  model = gemma4.Gemma4.from_pretrained(path)
  assert model.cfg.audio.subsampling_conv_channels == (16, 8)
  batch = gemma4.prepare_batch(audio_rows(), model.cfg)
  assert_near_transformers(jax.jit(lambda b: model(b))(batch), logits)


# Suite budget: three in CI (both tower paths, two layouts, both meshes), the
# rest in `make soak`.
@pytest.mark.parametrize(
  "mesh_sizes,layout",
  [
    pytest.param({"cp": 4}, "contiguous", marks=pytest.mark.slow),
    ({"cp": 4}, "load_balanced"),
    pytest.param({"cp": 4}, "document_balanced", marks=pytest.mark.slow),
    ({"fsdp": 2, "cp": 4}, "contiguous"),
    ({"cp": 2}, "load_balanced"),
  ],
  ids=["cp4-contiguous", "cp4-load_balanced", "cp4-document_balanced", "fsdp2-cp4", "cp2"],
)
def test_cp_logits_equal_transformers(e2b_audio, mesh_sizes, layout):
  """Two clips over cp = 4: each clip's frames split over the 4 ranks, which
  pass each other the frames read across their boundaries; over cp = 2: each
  clip whole on one rank. Either way every rank places its own tokens' soft
  tokens."""
  path, logits = e2b_audio
  model = gemma4.Gemma4.from_pretrained(path)
  batch = gemma4.prepare_batch(audio_rows(), model.cfg)
  mesh = parallel.make_mesh(**mesh_sizes, devices=jax.devices()[: np.prod([*mesh_sizes.values()])])
  axis = "fsdp" if "fsdp" in mesh_sizes else None
  got = gemma4.cp_logits(model, batch, mesh, layout=layout, batch_axis=axis)
  chex.assert_shape(got, logits[torch.float64].shape)
  assert_near_transformers(got, logits)


# Suite budget (35 s): `make soak`; CI compares the split tower's parameter
# gradients with the whole clip's below, and the CP logits with transformers'.
@pytest.mark.slow
def test_the_loss_gradient_reaches_the_audio_tower_under_cp(e2b_audio):
  """The text loss's gradient under CP (cp = 4, load-balanced) equals the
  one-device gradient on every parameter, and every trainable tensor of the
  tower and embed_audio gets a finite, nonzero one."""
  path, _ = e2b_audio
  model = gemma4.Gemma4.from_pretrained(path)
  rows = audio_rows()
  ids = rows["input_ids"]
  # Next-token labels on real text tokens (soft-token targets are out of the vocabulary).
  labels = np.where((np.roll(ids, -1, axis=1) < 256) & (rows["attention_mask"] == 1), 0, -100)
  labels = np.where(labels == 0, np.roll(ids, -1, axis=1), -100)
  labels[:, -1] = -100
  batch = gemma4.prepare_batch({**rows, "labels": labels.astype(np.int32)}, model.cfg)
  prefixes = ("model.audio_tower.", "model.embed_audio.")
  assert_cp_gradient_equals_one_device(model, batch, prefixes, least=41)


def test_the_save_loads_back_into_transformers(e2b_audio, tmp_path):
  path, _ = e2b_audio
  model = gemma4.Gemma4.from_pretrained(path)
  model.save_pretrained(tmp_path)
  theirs = transformers.Gemma4ForConditionalGeneration.from_pretrained(path).state_dict()
  back = transformers.Gemma4ForConditionalGeneration.from_pretrained(tmp_path).state_dict()
  audio = [k for k in theirs if k.startswith(("model.audio_tower.", "model.embed_audio."))]
  assert audio and all(torch.equal(theirs[k], back[k]) for k in audio)


def test_clips_that_disagree_with_their_placeholders_are_refused(e2b_audio):
  cfg = gemma4.Gemma4Config.from_hf(e2b_audio[0])
  rows = audio_rows()
  cases = [
    ({"input_features_mask": None}, "input_features_mask is required"),
    ({"input_features": rows["input_features"][..., :8]}, r"\[A, T, 16\] frames of 16 log-mel"),
    (
      {"input_features_mask": np.ones((2, FRAMES), bool)},
      "13 audio tokens .* 16 soft tokens after the audio tower's 4x subsampling",
    ),
  ]
  for change, match in cases:
    with pytest.raises(ValueError, match=match):
      gemma4.prepare_batch({**rows, **change}, cfg)
  text_only = gemma4.Gemma4Config.preset("tiny")
  with pytest.raises(ValueError, match="audio needs the config of a model with an audio tower"):
    gemma4.prepare_batch({**rows, "input_ids": rows["input_ids"] % 256}, text_only)


def test_a_split_clip_is_the_whole_clip_with_halos_longer_than_a_block():
  """The tower's Split mode (a clip's frames in order over cp = 4) against the
  same tower on the whole clip, outputs and parameter gradients, where every
  halo is longer than an attention block (blocks of 2, 5 frames back, 4
  ahead, a light convolution of 5 taps): each rank's run grows to hold them."""
  from cpjax.models.gemma4.audio import AudioTower, Split
  from cpjax.models.gemma4.audio_config import Gemma4AudioConfig

  cfg = Gemma4AudioConfig(
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    subsampling_conv_channels=(8, 4),
    conv_kernel_size=5,
    attention_chunk_size=2,
    attention_context_left=6,
    attention_context_right=4,
    output_proj_dims=12,
  )
  run = Split.quantum(cfg)  # each rank's frames: the least a rank may hold
  assert run == 24  # 6 soft tokens: 3 blocks, enough for 5 frames back
  tower = AudioTower(cfg, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(tower, nnx.Param, ...)
  rng = np.random.default_rng(0)
  feats = rng.normal(size=(2, 4 * run, 8)).astype(np.float32)
  mask = np.arange(4 * run)[None] < np.array([[4 * run], [41]])
  weights = rng.normal(size=(2, run, 12)).astype(np.float32)
  real = mask[:, ::2][:, ::2]

  def whole(p):
    out, _ = nnx.merge(graphdef, p, rest)(feats, mask, jnp.float32)
    return out, jnp.sum(jnp.where(real[..., None], out * weights, 0))

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("cp",))
  spec = jax.P(None, "cp")

  def split(p):
    def local(f, m, w, r):
      out, _ = nnx.merge(graphdef, p, rest)(f, m, jnp.float32, split=Split("cp", 4))
      return out, jax.lax.psum(jnp.sum(jnp.where(r[..., None], out * w, 0)), "cp")

    run = jax.shard_map(
      local, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, jax.P()), check_vma=False
    )
    return run(feats, mask, weights, real)

  want_grad = jax.jit(jax.grad(lambda p: whole(p)[1]))(params)
  got = jax.jit(split)(params)[0]
  got_grad = jax.jit(jax.grad(lambda p: split(p)[1]))(params)
  want = jax.jit(whole)(params)[0]
  chex.assert_trees_all_close(np.asarray(got)[real], np.asarray(want)[real], atol=1e-5)
  # Each leaf to 1e-4 of its largest entry (the ranks sum in another order).
  for (path, g), w in zip(
    jax.tree_util.tree_leaves_with_path(got_grad), jax.tree.leaves(want_grad)
  ):
    scale = float(np.max(np.abs(w)))
    assert scale > 0, jax.tree_util.keystr(path)
    chex.assert_trees_all_close(
      g, w, rtol=0, atol=1e-4 * scale, custom_message=jax.tree_util.keystr(path)
    )
