"""The four published Gemma 4 sizes, from their config.json files as the Hub
ships them (tests/fixtures/gemma4/published, see its README): each reads as
its preset, and cpjax's parameter tree is transformers' own at full size
(transformers builds it on the meta device, so no memory is spent)."""

import json
import os
import re

import pytest
from flax import nnx

from cpjax import parallel
from cpjax.models import gemma4
from cpjax.models.gemma4.checkpoint import checkpoint_keys

PUBLISHED = os.path.join(os.path.dirname(__file__), "fixtures", "gemma4", "published")
SIZES = ["e2b", "e4b", "a4b", "31b"]


def published(name: str) -> dict:
  with open(os.path.join(PUBLISHED, name, "config.json")) as f:
    return json.load(f)


@pytest.mark.parametrize("name", SIZES)
def test_published_config_reads_as_its_preset(name):
  raw = published(name)
  assert raw["vision_config"]["rope_parameters"]["rope_type"] == "default"  # as shipped
  assert (raw["audio_config"] is not None) == (name in ("e2b", "e4b"))
  cfg = gemma4.Gemma4Config.from_hf(os.path.join(PUBLISHED, name))
  assert cfg == gemma4.Gemma4Config.preset(name)
  assert cfg.has_audio == (cfg.audio is not None) == (name in ("e2b", "e4b"))
  assert gemma4.Gemma4Config.from_hf(cfg.to_hf()) == cfg


def test_published_keys_that_change_the_mathematics_are_errors():
  """An unknown key, or a known key with a value cpjax does not implement,
  names itself; a bookkeeping key is ignored."""
  raw = published("e2b")
  assert gemma4.Gemma4Config.from_hf(
    {**raw, "transformers_version": "9.9"}
  ) == gemma4.Gemma4Config.preset("e2b")
  cases = [
    (
      ("text_config", "sliding_window_pattern"),
      6,
      r"text_config has keys cpjax does not "
      r"know: \['sliding_window_pattern'\]",
    ),
    (("text_config", "attention_dropout"), 0.1, r"text_config\.attention_dropout must be 0\.0"),
    (("text_config", "attention_bias"), True, r"text_config\.attention_bias must be False"),
    (("vision_config", "hidden_activation"), "gelu", r"vision_config\.hidden_activation"),
    (("vision_config", "global_head_dim"), 128, r"vision_config\.global_head_dim \(128\)"),
    ((None, "eoa_token_id"), 7, r"eoa_token_id \(7\) and eoa_token_index \(258883\)"),
    (("text_config", "expert_intermediate_size"), 700, r"expert_intermediate_size \(700\)"),
  ]
  for (part, key), value, match in cases:
    bad = json.loads(json.dumps(published("a4b" if "expert" in key else "e2b")))
    (bad if part is None else bad[part])[key] = value
    with pytest.raises(ValueError, match=match):
      gemma4.Gemma4Config.from_hf(bad)
  bad = published("e2b")
  bad["vision_config"]["rope_parameters"]["rope_type"] = "linear"
  with pytest.raises(
    ValueError,
    match=r"vision_config\.rope_parameters\.rope_type must be one "
    r"of \['default', 'axial'\], got 'linear'",
  ):
    gemma4.Gemma4Config.from_hf(bad)
  bad = published("e2b")
  bad["text_config"]["rope_parameters"]["full_attention"]["factor"] = 8.0
  with pytest.raises(ValueError, match=r"full_attention\.factor must be 1\.0"):
    gemma4.Gemma4Config.from_hf(bad)


@pytest.mark.parametrize("name", SIZES)
def test_parameter_tree_is_transformers_at_full_size(name):
  """Keys and shapes of every tensor (E2B and E4B's audio tower included)
  equal transformers' state dict, except what cpjax skips on purpose: K/V of
  the K/V-sharing reuse layers (transformers creates them, never uses them)
  and the tied head."""
  torch = pytest.importorskip("torch", reason="needs torch")
  transformers = pytest.importorskip("transformers", reason="needs transformers")
  hf_cfg = transformers.Gemma4Config.from_pretrained(os.path.join(PUBLISHED, name))
  with torch.device("meta"):
    hf = transformers.Gemma4ForConditionalGeneration(hf_cfg)
  theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
  reuse = [i for i, m in enumerate(hf_cfg.text_config.kv_sharing_modes) if m == "reuse"]
  shared = re.compile(
    r"model\.language_model\.layers\.(%s)\.self_attn\.(k_proj|v_proj|k_norm|"
    r"v_norm)\." % "|".join(map(str, reuse or [-1]))
  )
  skipped = {k for k in theirs if shared.match(k) or k == "lm_head.weight"}
  assert any(k.startswith("model.audio_tower.") for k in theirs) == (name in ("e2b", "e4b"))
  assert bool(reuse) == (name in ("e2b", "e4b"))

  cfg = gemma4.Gemma4Config.from_hf(os.path.join(PUBLISHED, name))
  model = parallel.abstract_model(lambda: gemma4.Gemma4(cfg, rngs=nnx.Rngs(0)))
  ours = {k: tuple(v.get_value().shape) for k, v in checkpoint_keys(model).items()}
  want = {k: s for k, s in theirs.items() if k not in skipped}
  assert sorted(set(ours) - set(want)) == [] and sorted(set(want) - set(ours)) == []
  assert {k: s for k, s in ours.items() if s != want[k]} == {}


@pytest.mark.parametrize("name", ["e2b", "a4b"])
def test_synthetic_rows_never_forge_a_special_token(name):
  """At the real vocabulary, random text never draws a placeholder or a
  control id: image tokens appear exactly in the image spans."""
  import numpy as np

  cfg = gemma4.Gemma4Config.preset(name)
  assert {258880, 258881, 258884, 255999, 258882, 0, 1, 2} <= set(cfg.special_token_ids)
  batch = gemma4.synthetic_batch(
    np.random.default_rng(0), cfg, batch_size=8, seq_len=65536, max_docs=6
  )
  ids, types = batch["input_ids"], batch["mm_token_type_ids"]
  real = batch["attention_mask"] == 1
  np.testing.assert_array_equal(ids == cfg.image_token_id, types == 1)
  assert not np.isin(ids[real & (types == 0)], cfg.special_token_ids).any()
  assert ids.max() < cfg.text.vocab_size
  gemma4.prepare_batch(batch, cfg)  # its image-token count check passes
