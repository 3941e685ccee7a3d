"""Small helpers for the tests."""

import ast
import os
import sys

import jax
import pytest


def cp_mesh(cp: int, *leading: tuple[str, int]):
  """A mesh ending in a ``cp`` axis of size ``cp``, after optional leading axes."""
  names = tuple(n for n, _ in leading) + ("cp",)
  shape = tuple(s for _, s in leading) + (cp,)
  need = 1
  for s in shape:
    need *= s
  if len(jax.devices()) < need:
    pytest.skip(f"needs {need} devices, have {len(jax.devices())}")
  return jax.make_mesh(shape, names, devices=jax.devices()[:need])


def compiled(model, method: str = "__call__"):
  """``model.<method>`` as one jitted program (``nnx.jit``, the model an
  argument: a LoRA model's qwix sets attributes as it runs): called eagerly,
  a Gemma 4 compiles each of its hundreds of operations apart."""
  from flax import nnx

  run = nnx.jit(lambda m, *args: getattr(m, method)(*args))
  return lambda *args: run(model, *args)


def fewest_layers(cfg):
  """A Gemma 4 config cut to the fewest layers that keep its kinds: a sliding
  and a full layer, twice where layers share K/V (layers 2 and 3 reuse the
  K/V of 0 and 1). Compiling a step is about linear in the layers, and what
  a test of the mesh, the experts or the processes checks is in each kind."""
  import dataclasses

  from cpjax.models.gemma4 import config

  t = cfg.text
  types = (config.SLIDING, config.FULL) * (2 if t.num_kv_shared_layers else 1)
  text = dataclasses.replace(
    t,
    num_hidden_layers=len(types),
    layer_types=types,
    num_kv_shared_layers=min(t.num_kv_shared_layers, 2),
  )
  return dataclasses.replace(cfg, text=text)


EXAMPLE_TOKENIZER = os.path.join(
  os.path.dirname(os.path.dirname(__file__)), "cpjax", "examples", "chat"
)


# The layers of the checkpoints below: their fixture models' (make_fixtures.py)
# cut to the fewest that keep each kind, as fewest_layers cuts a preset, with
# one vision layer; the CLI runs on them compile each a few times.
CHECKPOINT_LAYERS = {
  # Layers 2 and 3 reuse the K/V of layers 0 and 1 (sliding, full).
  "ple_kv_sharing": dict(
    layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2
  ),
  "moe_k_eq_v_vision": dict(layer_types=["sliding_attention", "full_attention"]),
  "unified": dict(layer_types=["sliding_attention", "full_attention"]),
}


def _cut(text: dict, name: str) -> dict:
  """A fixture's text config with the layers of CHECKPOINT_LAYERS[name]."""
  cut = CHECKPOINT_LAYERS[name]
  return dict(text, **cut, num_hidden_layers=len(cut["layer_types"]))


def write_transformers_checkpoint(directory: str, kind: str, *, seed: int = 0) -> str:
  """A tiny Gemma 4 as a user downloads one, every file written by
  transformers: ``Gemma4ForConditionalGeneration.save_pretrained`` (config,
  weights, buffers; every persistent tensor random) and
  ``AutoTokenizer.save_pretrained`` of the shipped chat example's tokenizer
  and template. ``kind``: ``"dense"`` (E2B-like: per-layer inputs, K/V
  sharing, clipped vision linears) or ``"moe"`` (26B-A4B-like: 4 experts,
  top-2, k_eq_v, vision). The vocabulary is the tokenizer's (512), with its
  image markers' ids."""
  import sys

  import transformers

  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures", "gemma4"))
  import make_fixtures
  import torch

  name = {"dense": "ple_kv_sharing", "moe": "moe_k_eq_v_vision"}[kind]
  tokenizer = transformers.AutoTokenizer.from_pretrained(EXAMPLE_TOKENIZER)
  spec = make_fixtures.MODELS[name]
  text = dict(spec["text"], vocab_size=len(tokenizer), vocab_size_per_layer_input=len(tokenizer))
  text = _cut(text, name)
  ids = {
    key: tokenizer.convert_tokens_to_ids(token)
    for key, token in (
      ("boi_token_id", "<|image>"),
      ("image_token_id", "<|image|>"),
      ("eoi_token_id", "<image|>"),
    )
  }
  cfg = transformers.Gemma4Config(
    text_config=text,
    vision_config=dict(spec["vision"], num_hidden_layers=1),
    audio_config=None,
    **ids,
  )
  torch.manual_seed(seed)
  model = transformers.Gemma4ForConditionalGeneration(cfg).eval()
  make_fixtures.randomize(model, seed)
  model.save_pretrained(directory)
  tokenizer.save_pretrained(directory)
  return directory


AUDIO_EXAMPLE = os.path.join(
  os.path.dirname(os.path.dirname(__file__)), "cpjax", "examples", "audio_chat"
)


def write_audio_checkpoint(
  directory: str, kind: str, *, seed: int = 0, video_frames: int | None = None
) -> str:
  """A tiny Gemma 4 that takes audio, as a user downloads one, every file
  written by transformers: the model's ``save_pretrained`` (every persistent
  tensor random), ``AutoTokenizer.save_pretrained`` of a Gemma-style
  tokenizer with Gemma 4's image and audio markers (trained on the shipped
  audio example's words) and its chat template, and ``processor_config.json``
  naming the feature extractor. ``kind``: ``"e2b"`` (E2B-like: per-layer
  inputs, K/V sharing, a vision tower and a 2-layer conformer over the
  extractor's 128 log-mel bins) or ``"unified"`` (12B-like: the encoder-free
  embedders, 640-sample waveform frames). The vocabulary is the
  tokenizer's, with its markers' ids. ``video_frames``: the tokenizer has
  Gemma 4's video placeholder too, and the processor config the model's
  video processor sampling that many frames a video (its patches the
  tower's or the embedder's)."""
  import json
  import sys

  import transformers

  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures", "gemma4"))
  import make_fixtures
  import torch

  from tests.data.make_audio_example import records
  from tests.data.make_chat_example import MARKERS, SPECIAL_TOKENS, gemma_style_tokenizer

  texts = [
    part if isinstance(part, str) else part.get("text", "")
    for r in records()
    for m in r.get("messages", [])
    for part in (m["content"] if isinstance(m["content"], list) else [m["content"]])
  ] + [r["text"] for r in records() if "text" in r]
  gemma_style_tokenizer(
    directory,
    texts + ["system user model"],
    vocab_size=400,
    config=MARKERS,
    special_tokens=(
      *SPECIAL_TOKENS,
      "<|audio>",
      "<|audio|>",
      "<audio|>",
      *(("<|video|>",) if video_frames else ()),
    ),
  )
  tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
  ids = {
    key: tokenizer.convert_tokens_to_ids(MARKERS[token])
    for key, token in (
      ("boi_token_id", "boi_token"),
      ("image_token_id", "image_token"),
      ("eoi_token_id", "eoi_token"),
      ("boa_token_id", "boa_token"),
      ("audio_token_id", "audio_token"),
      ("eoa_token_index", "eoa_token"),
    )
  }
  if video_frames:
    ids["video_token_id"] = tokenizer.convert_tokens_to_ids("<|video|>")
  vocab = len(tokenizer)
  if kind == "e2b":
    spec = make_fixtures.MODELS["ple_kv_sharing"]
    cfg = transformers.Gemma4Config(
      text_config=_cut(
        dict(spec["text"], vocab_size=vocab, vocab_size_per_layer_input=vocab), "ple_kv_sharing"
      ),
      vision_config=dict(spec["vision"], num_hidden_layers=1),
      # The tower's first convolution has as many channels as mel bins.
      audio_config=dict(make_fixtures.AUDIO, subsampling_conv_channels=[128, 8]),
      **ids,
    )
    model_class, extractor = (
      transformers.Gemma4ForConditionalGeneration,
      "Gemma4AudioFeatureExtractor",
    )
  elif kind == "unified":
    spec = make_fixtures.UNIFIED
    cfg = transformers.Gemma4UnifiedConfig(
      text_config=_cut(dict(spec["text"], vocab_size=vocab), "unified"),
      vision_config=dict(spec["vision"]),
      audio_config=dict(audio_embed_dim=640),
      **ids,
    )
    model_class = transformers.Gemma4UnifiedForConditionalGeneration
    extractor = "Gemma4UnifiedAudioFeatureExtractor"
  else:
    raise ValueError(f"kind must be 'e2b' or 'unified', got {kind!r}")
  torch.manual_seed(seed)
  model = model_class(cfg).eval()
  make_fixtures.randomize(model, seed)
  model.save_pretrained(directory)
  tokenizer.save_pretrained(directory)
  processors: dict = {
    "feature_extractor": {"feature_extractor_type": extractor, "sampling_rate": 16000}
  }
  if video_frames:
    vision = cfg.vision_config
    processors["video_processor"] = {
      "video_processor_type": "Gemma4UnifiedVideoProcessor"
      if kind == "unified"
      else "Gemma4VideoProcessor",
      "patch_size": vision.patch_size,
      "pooling_kernel_size": vision.pooling_kernel_size,
      "max_soft_tokens": 70,
      "num_frames": video_frames,
    }
  with open(os.path.join(directory, "processor_config.json"), "w") as f:
    json.dump(processors, f)
  return directory


# torchvision for transformers' video processor, installed apart from the test
# environment (``pip install --no-deps --target DIR torchvision==0.28.0``, as
# .ci/run does): tests/video_reference.py says why.
TORCHVISION = os.path.join(sys.prefix, "torchvision-cpu")


def write_video(path: str, frames, fps: int) -> str:
  """Encode uint8 [T, H, W, 3] RGB frames as an MP4 (MPEG-4 part 2) at ``fps``."""
  import av

  with av.open(path, "w") as container:
    stream = container.add_stream("mpeg4", rate=fps)
    stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
    for frame in frames:
      container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
    container.mux(stream.encode())
  return path


def fake_slice_compiler(monkeypatch, totals: dict) -> list:
  """Replace the compile of a target by a table of totals per slice; return
  the list its calls are recorded in: (slice, mesh, StepShape, strategies).
  A total of None is a compile refused past the chip's memory."""
  from cpjax.training import plan

  calls = []

  def compiled_plan(cfg, shape, *, target, model, mesh, device_memory):
    shape = plan.StepShape.take(shape, {"mesh": mesh})
    calls.append(
      (target.name, mesh, shape, shape.strategies(cfg.text, device_memory=device_memory))
    )
    total = totals[target.name]  # None: refused past the chip's memory
    refused = dict(collectives={}, refused=True) if total is None else {}
    total = 99 * plan.GiB if total is None else total
    return plan.Plan(
      model,
      shape.seq_len,
      mesh,
      shape.remat,
      shape.dtype,
      0,
      0,
      total,
      total,
      0.0,
      target.name,
      **refused,
    )

  monkeypatch.setattr(plan.search, "compiled_plan", compiled_plan)
  return calls


def public_members(tree: ast.Module) -> list[tuple[ast.stmt, str]]:
  """``(node, owner)`` of a module's top-level statements (owner ``""``) and
  of the bodies of its public classes (owner ``"Class."``): where its public
  functions and methods are defined."""
  members = [(node, "") for node in tree.body]
  members += [
    (m, node.name + ".")
    for node in tree.body
    if isinstance(node, ast.ClassDef) and not node.name.startswith("_")
    for m in node.body
  ]
  return members


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def doc(page: str, section: str | None = None) -> str:
  """The text of a page of the docs (``docs/PAGE``, or ``README.md``), or of
  its section: from the heading ``section`` (any level) to the next heading
  of that level or above (a ``#`` inside a code block is no heading)."""
  path = os.path.join(ROOT, page if page == "README.md" else os.path.join("docs", page))
  with open(path) as f:
    lines = f.read().splitlines(keepends=True)
  if section is None:
    return "".join(lines)
  fenced, level, out = False, None, []
  for line in lines:
    heading = not fenced and line.startswith("#")
    fenced ^= line.startswith("```")
    depth = len(line) - len(line.lstrip("#"))
    if level is None:
      if heading and line[depth:].strip() == section:
        level = depth
    elif heading and line[depth : depth + 1] == " " and depth <= level:
      break
    else:
      out.append(line)
  assert level is not None, f"{page} has no section {section!r}"
  return "".join(out)


def code_blocks(text: str, language: str) -> list[str]:
  """The fenced code blocks of ``language`` in markdown ``text``."""
  import re

  return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def transformers_logits(model, rows: dict, float64_scope=None) -> dict:
  """{torch.float64: ..., torch.float32: ...}: a transformers model's logits
  of ``rows`` (numpy inputs; float32 arrays cast to the run's dtype) in
  float64 (inside ``float64_scope(model)`` if given) and in float32."""
  import contextlib

  import numpy as np
  import torch

  logits = {}
  for dtype in (torch.float64, torch.float32):
    inputs = {
      k: torch.tensor(v, dtype=dtype if v.dtype == np.float32 else None) for k, v in rows.items()
    }
    scope = contextlib.nullcontext()
    if dtype == torch.float64 and float64_scope is not None:
      scope = float64_scope(model)
    with torch.no_grad(), scope:
      logits[dtype] = model.to(dtype)(**inputs).logits.double().numpy()
  return logits


def assert_cp_gradient_equals_one_device(model, batch, prefixes: tuple, least: int) -> None:
  """The mean text loss's gradient under cp = 4 (load-balanced) equals the
  one-device gradient on every parameter (within 1e-4 of each tensor's
  largest), and the ``least`` or more trainable tensors whose checkpoint
  keys start with ``prefixes`` each get a finite, nonzero one."""
  import chex
  import numpy as np
  from flax import nnx

  from cpjax import parallel, training
  from cpjax.models.gemma4.checkpoint import checkpoint_keys

  graphdef, params, buffers = nnx.split(model, nnx.Param, ...)

  def objective(loss):
    return lambda p, b: (lambda s, n: s / n)(*loss(p, b))

  want = jax.jit(jax.grad(objective(training.make_loss_fn(graphdef, frozen=buffers))))(
    params, batch
  )
  mesh = parallel.make_mesh(cp=4, devices=jax.devices()[:4])
  sharder = model.prepare_model_inputs_for_cp(layout="load_balanced")["cp_sharder"]
  sharded, layout = sharder.shard_batch(batch, mesh)
  loss = training.make_loss_fn(graphdef, mesh=mesh, layout=layout, frozen=buffers)
  with jax.set_mesh(mesh):
    on_mesh = jax.device_put(params, jax.NamedSharding(mesh, jax.P()))
    got = jax.jit(jax.grad(objective(loss)))(on_mesh, sharded)

  def close(where, a, b):
    chex.assert_trees_all_close(
      a, b, rtol=0, atol=1e-4 * float(np.max(np.abs(b))), custom_message=jax.tree_util.keystr(where)
    )

  jax.tree_util.tree_map_with_path(close, got, want)
  reached = {
    k: v
    for k, v in checkpoint_keys(nnx.merge(graphdef, want, buffers)).items()
    if k.startswith(prefixes) and isinstance(v, nnx.Param)
  }
  assert len(reached) >= least, sorted(reached)
  for key, g in reached.items():
    g = np.asarray(g.get_value())
    assert np.all(np.isfinite(g)) and np.any(g != 0), key


def assert_within_transformers_error(got, logits: dict, real, times: float = 5.0) -> None:
  """``got`` within ``times`` transformers' own float32 error of its float64
  logits, on the ``real`` tokens (the issues' bar for precision)."""
  import numpy as np
  import torch

  theirs = np.abs(logits[torch.float32] - logits[torch.float64])[real].max()
  ours = np.abs(np.asarray(got, np.float64) - logits[torch.float64])[real].max()
  assert ours <= times * theirs, (ours, theirs)
