"""Gemma 4 configs and checkpoints: config.json in both styles, presets,
strict streaming loads, bit-exact round trips, batch validation; and, when
torch and transformers are installed, transformers itself loading what
cpjax saves."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cpjax.models import gemma4
from cpjax.models.gemma4.checkpoint import checkpoint_keys

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "gemma4")


def states_equal(a, b):
  ka, kb = checkpoint_keys(a), checkpoint_keys(b)
  assert sorted(ka) == sorted(kb)
  for key in ka:
    x, y = np.asarray(ka[key].get_value()), np.asarray(kb[key].get_value())
    assert x.dtype == y.dtype and x.shape == y.shape, key
    np.testing.assert_array_equal(
      x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8), err_msg=key
    )


def test_hub_style_and_saved_style_configs_agree():
  """moe_k_eq_v_vision's config.json is in the Hub's style (global_head_dim,
  num_global_key_value_heads); to_hf writes transformers 5.24's
  per_layer_config; both read back to the same config."""
  hub = gemma4.Gemma4Config.from_hf(os.path.join(FIXTURES, "moe_k_eq_v_vision"))
  assert (
    "per_layer_config"
    not in json.load(open(os.path.join(FIXTURES, "moe_k_eq_v_vision", "config.json")))[
      "text_config"
    ]
  )
  assert (hub.text.global_head_dim, hub.text.num_global_key_value_heads) == (32, 1)
  assert gemma4.Gemma4Config.from_hf(hub.to_hf()) == hub
  saved = gemma4.Gemma4Config.from_hf(os.path.join(FIXTURES, "ple_kv_sharing"))
  assert gemma4.Gemma4Config.from_hf(saved.to_hf()) == saved


def test_hub_style_kv_override_needs_k_eq_v():
  """transformers applies num_global_key_value_heads only with attention_k_eq_v."""
  text = {
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "num_global_key_value_heads": 1,
    "global_head_dim": 64,
  }
  off = gemma4.Gemma4Config.from_hf({"model_type": "gemma4_text", **text})
  on = gemma4.Gemma4Config.from_hf({"model_type": "gemma4_text", **text, "attention_k_eq_v": True})
  assert off.text.kv_heads(1) == 2 and on.text.kv_heads(1) == 1
  assert off.vision is None


@pytest.mark.parametrize(
  "name,stores,hidden",
  [("e2b", (13, 14), 1536), ("e4b", (22, 23), 2560), ("a4b", (), 2816), ("31b", (), 5376)],
)
def test_published_presets(name, stores, hidden):
  cfg = gemma4.Gemma4Config.preset(name)
  t = cfg.text
  assert t.hidden_size == hidden and t.final_logit_softcapping == 30.0
  assert tuple(i for i, m in enumerate(t.kv_sharing_modes) if m == "store") == stores
  assert t.layer_types[-1] == "full_attention"
  # Proportional RoPE on full layers: 64 of 256 frequency pairs rotate.
  full = t.layer_types.index("full_attention")
  assert int(np.count_nonzero(t.rope_inv_freq(full))) == 64
  assert gemma4.Gemma4Config.from_hf(cfg.to_hf()).text == t


def test_bad_configs_are_value_errors():
  with pytest.raises(ValueError, match="hidden_activation"):
    gemma4.Gemma4Config.from_hf({"model_type": "gemma4_text", "hidden_activation": "relu"})
  with pytest.raises(ValueError, match="model_type"):
    gemma4.Gemma4Config.from_hf({"model_type": "llama"})
  with pytest.raises(ValueError, match="num_attention_heads"):
    gemma4.Gemma4TextConfig(num_attention_heads=6, num_key_value_heads=4)
  with pytest.raises(KeyError, match="unknown Gemma 4 preset"):
    gemma4.Gemma4Config.preset("7b")


@pytest.fixture
def checkpoint_copy(tmp_path):
  path = tmp_path / "ckpt"
  shutil.copytree(os.path.join(FIXTURES, "moe_k_eq_v_vision"), path)
  return path


def _edit(path, fn):
  from safetensors.numpy import load_file, save_file

  file = os.path.join(path, "model.safetensors")
  tensors = fn(load_file(file))
  save_file(tensors, file, metadata={"format": "pt"})


def test_missing_unexpected_and_misshapen_keys_are_errors(checkpoint_copy):
  key = "model.language_model.layers.0.mlp.up_proj.weight"
  _edit(checkpoint_copy, lambda t: {**t, key: t[key][:, :-1]})
  with pytest.raises(ValueError, match=r"layers\.0\.mlp\.up_proj\.weight.*\[48, 63\].*\[48, 64\]"):
    gemma4.Gemma4.from_pretrained(checkpoint_copy)
  _edit(checkpoint_copy, lambda t: {k: v for k, v in t.items() if k != key})
  with pytest.raises(ValueError, match=r"missing keys \['model\.language_model\.layers\.0\.mlp"):
    gemma4.Gemma4.from_pretrained(checkpoint_copy)
  _edit(
    checkpoint_copy,
    lambda t: {
      **t,
      key: np.zeros((48, 64), np.float32),
      "model.extra.weight": np.zeros(2, np.float32),
    },
  )
  with pytest.raises(ValueError, match=r"unexpected keys \['model\.extra\.weight'\]"):
    gemma4.Gemma4.from_pretrained(checkpoint_copy)


def test_audio_weights_are_skipped_where_the_config_has_no_audio(checkpoint_copy):
  """A checkpoint whose config.json has no audio_config but whose files hold
  audio tower weights (transformers skips them too): they load as nothing,
  and everything else loads as before."""
  before = gemma4.Gemma4.from_pretrained(checkpoint_copy)
  _edit(
    checkpoint_copy,
    lambda t: {
      **t,
      "model.audio_tower.layers.0.weight": np.ones(3, np.float32),
      "model.embed_audio.embedding_projection.weight": np.ones((2, 2), np.float32),
    },
  )
  states_equal(before, gemma4.Gemma4.from_pretrained(checkpoint_copy))


def test_reuse_layer_kv_weights_are_ignored_as_transformers_does():
  from safetensors import safe_open

  path = os.path.join(FIXTURES, "ple_kv_sharing")
  with safe_open(os.path.join(path, "model.safetensors"), framework="numpy") as f:
    assert "model.language_model.layers.4.self_attn.k_proj.weight" in f.keys()
  model = gemma4.Gemma4.from_pretrained(path)
  assert "model.language_model.layers.4.self_attn.k_proj.weight" not in checkpoint_keys(model)


def test_save_load_round_trip_is_bit_exact(tmp_path):
  for dtype in (jnp.float32, jnp.bfloat16):
    model = gemma4.Gemma4.from_pretrained(os.path.join(FIXTURES, "ple_kv_sharing"), dtype=dtype)
    model.save_pretrained(tmp_path / str(dtype.dtype))
    states_equal(model, gemma4.Gemma4.from_pretrained(tmp_path / str(dtype.dtype), dtype=dtype))


def test_sharded_save_with_index_and_placement_on_a_mesh(tmp_path):
  model = gemma4.Gemma4(gemma4.Gemma4Config.preset("tiny"), rngs=nnx.Rngs(3))
  files = model.save_pretrained(tmp_path, max_shard_bytes=100_000)
  assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").exists()
  mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
  spec = lambda key, shape: jax.P("fsdp") if len(shape) == 2 and shape[0] % 4 == 0 else jax.P()
  loaded = gemma4.Gemma4.from_pretrained(tmp_path, mesh=mesh, sharding=spec)
  states_equal(model, loaded)
  emb = checkpoint_keys(loaded)["model.language_model.embed_tokens.weight"].get_value()
  assert emb.sharding.spec == jax.P("fsdp")
  # Buffers too (layer_scalar), and every tensor without a sharding rule: a
  # jitted program over the mesh refuses an array committed to one device.
  keep_buffers = lambda key, shape: spec(key, shape) if "layer_scalar" not in key else None
  for how in (keep_buffers, None):
    again = gemma4.Gemma4.from_pretrained(tmp_path, mesh=mesh, sharding=how)
    for key, var in checkpoint_keys(again).items():
      assert var.get_value().sharding.mesh == mesh, key
  assert not isinstance(
    checkpoint_keys(loaded)["model.language_model.layers.0.layer_scalar"], nnx.Param
  )


@pytest.mark.parametrize("chunk_bytes, host_writes", [(1 << 30, True), (4096, True), (4096, False)])
def test_each_device_reads_its_block_in_chunks(tmp_path, monkeypatch, chunk_bytes, host_writes):
  """Chunked reads (4 KiB: many chunks per table), sharded over two
  axes and replicated, give the file's tensors bit for bit, each device
  holding only its block; a float32 file loads as bfloat16 like numpy's cast.
  Chunks land by a copy into the CPU buffer's memory, or by the donated
  dynamic_update_slice that accelerators use."""
  from safetensors.numpy import load_file

  from cpjax.models.gemma4 import checkpoint

  monkeypatch.setattr(checkpoint, "CHUNK_BYTES", chunk_bytes)
  monkeypatch.setattr(checkpoint, "CPU_HOST_WRITES", host_writes)
  path = os.path.join(FIXTURES, "ple_kv_sharing")
  stored = load_file(os.path.join(path, "model.safetensors"))
  mesh = jax.make_mesh((2, 2), ("fsdp", "tp"), devices=jax.devices()[:4])
  spec = lambda key, shape: (
    jax.P("tp", "fsdp") if len(shape) == 2 and shape[0] % 2 == 0 and shape[1] % 2 == 0 else jax.P()
  )
  bits = lambda x: np.asarray(x).reshape(-1).view(np.uint8)
  for dtype in (jnp.float32, jnp.bfloat16):
    model = gemma4.Gemma4.from_pretrained(path, mesh=mesh, sharding=spec, dtype=dtype)
    for key, var in checkpoint_keys(model).items():
      value, want = var.get_value(), stored[key].astype(dtype)
      np.testing.assert_array_equal(bits(value), bits(want), err_msg=key)
      assert value.sharding.spec == spec(key, want.shape), key
      for shard in value.addressable_shards:
        np.testing.assert_array_equal(bits(shard.data), bits(want[shard.index]), err_msg=key)


def test_prepare_batch_validates_images_before_compute():
  cfg = gemma4.Gemma4Config.preset("tiny")
  batch = gemma4.synthetic_batch(np.random.default_rng(0), cfg, batch_size=2, seq_len=40)
  gemma4.prepare_batch(batch, cfg)  # consistent: fine
  short = dict(batch, input_ids=batch["input_ids"].copy())
  short["input_ids"][0, np.flatnonzero(batch["input_ids"][0] == cfg.image_token_id)[0]] = 5
  with pytest.raises(ValueError, match=r"input_ids hold 7 image tokens .* yield 8 soft tokens"):
    gemma4.prepare_batch(short, cfg)
  with pytest.raises(KeyError, match="image_position_ids"):
    gemma4.prepare_batch({k: v for k, v in batch.items() if k != "image_position_ids"}, cfg)
  with pytest.raises(ValueError, match=r"pixel_values must be \[N, P, 3 \* patch_size\*\*2 = 48\]"):
    gemma4.prepare_batch(dict(batch, pixel_values=batch["pixel_values"][..., :40]), cfg)
  with pytest.raises(ValueError, match="'input_features' is not supported"):
    gemma4.prepare_batch(dict(batch, input_features=np.zeros((1, 10, 128))), cfg)


def test_packed_documents_from_position_ids_as_transformers_reads_them():
  out = gemma4.prepare_batch(
    {"input_ids": np.ones((1, 6), np.int32), "position_ids": np.array([[0, 1, 2, 0, 1, 0]])}
  )
  assert np.asarray(out["_packed_seq_ids"]).tolist() == [[1, 1, 1, 2, 2, 3]]


def test_fine_tune_a_checkpoint_on_chat_jsonl_with_images(tmp_path):
  """A checkpoint as users download it: config.json and weights, the
  tokenizer, its chat template and processor_config.json, with the image,
  audio and control ids ordinary vocabulary rows. ``cpjax train
  --checkpoint DIR --data chat.jsonl``: the conversations' images come from
  files and ride with their documents through packing into image slots, in
  training rows and in the validation rows. Synthetic text never draws a special id
  (it once did: prepare_batch then counted more image tokens than images)."""
  import dataclasses

  from PIL import Image

  from cpjax.data.tokenizer import CheckpointTokenizer
  from cpjax.training.run_config import RunConfig, with_values
  from cpjax.training.trainer import train
  from tests.data.make_chat_example import MARKERS, SPECIAL_TOKENS, gemma_style_tokenizer

  gemma_style_tokenizer(
    str(tmp_path),
    ["what is in the picture", "a red one"] * 5,
    vocab_size=400,
    config=MARKERS,
    special_tokens=(*SPECIAL_TOKENS, "<|audio>", "<|audio|>", "<audio|>"),
  )
  tok = CheckpointTokenizer(tmp_path)
  ids = {key: tok.token_id(value) for key, value in MARKERS.items()}
  tiny = gemma4.Gemma4Config.preset("tiny")
  cfg = dataclasses.replace(
    tiny,
    image_token_id=ids["image_token"],
    boi_token_id=ids["boi_token"],
    eoi_token_id=ids["eoi_token"],
    audio_token_id=ids["audio_token"],
    boa_token_id=ids["boa_token"],
    eoa_token_index=ids["eoa_token"],
    video_token_id=4,
  )
  assert max(cfg.special_token_ids) < cfg.text.vocab_size
  gemma4.Gemma4(cfg, rngs=nnx.Rngs(0)).save_pretrained(tmp_path)
  with open(tmp_path / "processor_config.json", "w") as f:
    json.dump(
      {
        "image_processor": {
          "patch_size": cfg.vision.patch_size,
          "max_soft_tokens": 70,
          "pooling_kernel_size": cfg.vision.pooling_kernel_size,
        }
      },
      f,
    )
  rng = np.random.default_rng(0)
  for name, size in (("a.png", (60, 100)), ("b.png", (40, 40))):
    Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(tmp_path / name)
  lines = [
    {
      "messages": [
        {
          "role": "user",
          "content": [{"type": "image", "image": name}, {"type": "text", "text": "what is in"}],
        },
        {"role": "assistant", "content": "a red one"},
      ]
    }
    for name in ("a.png", "b.png", "b.png", "a.png")
  ] + [{"text": "a red one"}]
  (tmp_path / "chat.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
  batch = gemma4.synthetic_batch(np.random.default_rng(0), cfg, batch_size=4, seq_len=256)
  text = batch["input_ids"][(batch["mm_token_type_ids"] == 0) & (batch["attention_mask"] == 1)]
  assert not np.isin(text, cfg.special_token_ids).any()
  run = with_values(
    RunConfig(),
    {
      "checkpoint": str(tmp_path),
      "dataset.path": str(tmp_path / "chat.jsonl"),
      "dataset.seq_len": 128,
      "parallel.cp": 2,
      "optimizer.steps": 2,
      "dataset.batch_size": 2,
      "parity_check": False,
      "eval.data": str(tmp_path / "chat.jsonl"),
      "eval.rows": 3,
    },
  )
  summary = train(with_values(run, {"eval.data": None}), log=lambda *a: None)
  assert len(summary["losses"]) == 2 and np.isfinite(summary["losses"]).all()
  # The validation rows: 3 rows and an empty one, whose image slots are all
  # padding; every row's placeholders are its slots' soft tokens.
  from cpjax.models.gemma4.vision import soft_token_counts
  from cpjax.training.trainer import eval_rows

  rows = eval_rows(run, cfg, 2, lambda *a: None)
  assert len(rows) == 2 and not rows[1]["attention_mask"][1].any()
  slots = rows[1]["pixel_values"].shape[0] // 2
  assert (rows[1]["image_position_ids"][slots:] == -1).all()
  for batch in rows:
    gemma4.prepare_batch(batch, cfg)  # checks placeholders against soft tokens
    for r in range(2):
      soft = soft_token_counts(batch["image_position_ids"][r * slots : (r + 1) * slots], 3).sum()
      assert soft == (batch["input_ids"][r] == cfg.image_token_id).sum()
