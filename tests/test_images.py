"""Images from files: cpjax.data.images against transformers' Gemma 4 image
processor, a conversation with images against Gemma4Processor's
apply_chat_template, and images riding with their documents through packing."""

import json
import os

import numpy as np
import pytest
from PIL import Image

from cpjax.data import corpus
from cpjax.data.images import ImageProcessor, pixel_values
from cpjax.data.records import encode_record, prepare_data
from cpjax.data.tokenizer import CheckpointTokenizer
from tests.data.make_chat_example import MARKERS, SPECIAL_TOKENS, gemma_style_tokenizer

RNG = np.random.default_rng(0)
TEXTS = ["what is in the picture", "a red square and a blue one", "hello world"] * 5


def noise(h, w, mode="RGB"):
  channels = {"RGB": 3, "RGBA": 4, "L": None}[mode]
  shape = (h, w) if channels is None else (h, w, channels)
  return Image.fromarray(RNG.integers(0, 256, shape, dtype=np.uint8), mode)


def test_pixels_equal_transformers_image_processor():
  pytest.importorskip("transformers")
  from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

  palette = noise(64, 80, "L").convert("P")
  palette.info["transparency"] = 3
  images = [
    noise(100, 300),
    noise(480, 640),
    noise(37, 1000),
    noise(1000, 20),
    noise(50, 50),
    noise(144, 432),
    noise(64, 80, "RGBA"),
    noise(64, 80, "L"),
    palette,
  ]
  for max_soft_tokens in (70, 280):
    ours = ImageProcessor(max_soft_tokens=max_soft_tokens)(images)
    theirs = Gemma4ImageProcessorPil(max_soft_tokens=max_soft_tokens)(images, return_tensors="np")
    for key in ("pixel_values", "image_position_ids", "num_soft_tokens_per_image"):
      np.testing.assert_array_equal(np.asarray(ours[key]), np.asarray(theirs[key]), err_msg=key)
  # The corpus stores uint8 patches; the float pixels come back bit for bit.
  patches, _ = ImageProcessor(max_soft_tokens=280).patches(images[0])  # the last `ours`
  assert patches.dtype == np.uint8
  np.testing.assert_array_equal(pixel_values(patches), ours["pixel_values"][0][: len(patches)])


def test_bad_image_settings_are_named_errors():
  with pytest.raises(
    ValueError,
    match=r"max_soft_tokens must be one of \(70, 140, 280, 560, "
    r"1120\), got 100",
  ):
    ImageProcessor(max_soft_tokens=100)
  with pytest.raises(ValueError, match="patch_size must be a positive int, got 0"):
    ImageProcessor(patch_size=0)
  with pytest.raises(TypeError, match="image must be a PIL image"):
    ImageProcessor().patches(np.zeros((4, 4, 3)))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("ckpt"))
  gemma_style_tokenizer(
    d,
    TEXTS,
    vocab_size=400,
    config=MARKERS,
    special_tokens=(*SPECIAL_TOKENS, "<|audio>", "<|audio|>", "<audio|>"),
  )
  with open(os.path.join(d, "processor_config.json"), "w") as f:
    json.dump(
      {
        "image_processor": {"patch_size": 16, "max_soft_tokens": 70, "pooling_kernel_size": 3},
        "image_seq_length": 70,
      },
      f,
    )
  noise(100, 300).save(os.path.join(d, "wide.png"))
  # A JPEG stored sideways with an EXIF orientation (6: rotate 90 degrees).
  exif = Image.Exif()
  exif[0x0112] = 6
  noise(90, 160).save(os.path.join(d, "turned.jpg"), exif=exif)
  return d


CONVERSATION = [
  {
    "role": "user",
    "content": [
      {"type": "image", "image": "wide.png"},
      {"type": "text", "text": "what is in the picture"},
    ],
  },
  {"role": "assistant", "content": "a red square"},
  {
    "role": "user",
    "content": [{"type": "text", "text": "and here"}, {"type": "image", "path": "turned.jpg"}],
  },
  {"role": "assistant", "content": "a blue one"},
]


def test_conversation_with_images_equals_gemma4_processor(checkpoint, monkeypatch):
  transformers = pytest.importorskip("transformers")
  from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
  from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

  # Gemma4Processor insists on a video processor, which needs torchvision;
  # images never reach it.
  cls = transformers.Gemma4Processor
  check = cls.check_argument_for_proper_class
  monkeypatch.setattr(
    cls,
    "check_argument_for_proper_class",
    lambda self, name, arg: None if name == "video_processor" else check(self, name, arg),
  )
  with open(os.path.join(checkpoint, "chat_template.jinja")) as f:
    template = f.read()
  processor = cls(
    feature_extractor=Gemma4AudioFeatureExtractor(),
    video_processor=None,
    image_processor=Gemma4ImageProcessorPil(max_soft_tokens=70),
    tokenizer=transformers.AutoTokenizer.from_pretrained(checkpoint),
    chat_template=template,
    image_seq_length=70,
  )
  absolute = json.loads(
    json.dumps(CONVERSATION)
    .replace('"wide.png"', json.dumps(os.path.join(checkpoint, "wide.png")))
    .replace('"turned.jpg"', json.dumps(os.path.join(checkpoint, "turned.jpg")))
  )
  theirs = processor.apply_chat_template(
    absolute, tokenize=True, return_dict=True, return_tensors="np"
  )
  tok = CheckpointTokenizer(checkpoint)
  doc = encode_record(
    {"messages": CONVERSATION},
    tok,
    images=ImageProcessor.from_checkpoint(checkpoint),
    base_dir=checkpoint,
  )
  ids = doc["input_ids"]
  np.testing.assert_array_equal(ids, theirs["input_ids"][0])
  image = ids == tok.token_id("<|image|>")
  np.testing.assert_array_equal(image.astype(int), theirs["mm_token_type_ids"][0])
  # The images: the processor's padded pixels and positions from our patches.
  sizes = doc["image_sizes"]
  real = (theirs["image_position_ids"] != -1).all(-1)
  assert sizes.tolist() == real.sum(1).tolist()
  starts = np.concatenate([[0], np.cumsum(sizes)])
  for i, (lo, hi) in enumerate(zip(starts[:-1], starts[1:])):
    np.testing.assert_array_equal(
      pixel_values(doc["image_patches"][lo:hi]), theirs["pixel_values"][i][: hi - lo]
    )
    np.testing.assert_array_equal(
      doc["image_positions"][lo:hi], theirs["image_position_ids"][i][: hi - lo]
    )
    assert (theirs["image_position_ids"][i][hi - lo :] == -1).all()
  # The loss: the two answers and their ends of turn; never an image token.
  mask = doc["loss_mask"].astype(bool)
  assert not (mask & image).any()
  answers = tok.backend.decode(ids[mask].tolist(), skip_special_tokens=False)
  assert answers == "a red square<turn|>\na blue one<turn|>\n"
  # An image in an answer: its soft tokens are not the model's to predict.
  drawn = encode_record(
    {
      "messages": [
        {"role": "user", "content": "what is in"},
        {"role": "assistant", "content": CONVERSATION[0]["content"]},
      ]
    },
    tok,
    images=ImageProcessor.from_checkpoint(checkpoint),
    base_dir=checkpoint,
  )
  image = drawn["input_ids"] == tok.token_id("<|image|>")
  assert image.sum() == 56 and not (drawn["loss_mask"].astype(bool) & image).any()


def test_images_ride_with_their_documents_through_packing(checkpoint, tmp_path):
  from cpjax.models.gemma4.vision import soft_token_counts

  records = [
    {"messages": CONVERSATION},
    {"text": "hello world"},
    {"messages": CONVERSATION[:2]},
    {"messages": CONVERSATION[2:]},
    {
      "messages": [
        {"role": "user", "content": [{"type": "image", "image": "gone.png"}]},
        {"role": "assistant", "content": "x"},
      ]
    },
  ]
  source = tmp_path / "data.jsonl"
  source.write_text("".join(json.dumps(r) + "\n" for r in records))
  for name in ("wide.png", "turned.jpg"):
    os.symlink(os.path.join(checkpoint, name), tmp_path / name)
  summary = prepare_data(
    source, tmp_path / "corpus", checkpoint=checkpoint, seq_len=256, progress=False
  )
  assert (summary.documents, summary.images, summary.max_images_per_document) == (4, 4, 2)
  assert summary.dropped[0][0] == 5 and "gone.png does not exist" in summary.dropped[0][1]
  info = corpus.corpus_images(str(tmp_path / "corpus"))
  assert info["image_token_id"] == CheckpointTokenizer(checkpoint).token_id("<|image|>")
  tok = CheckpointTokenizer(checkpoint)
  proc = ImageProcessor.from_checkpoint(checkpoint)
  own = {}  # each record's tokens -> its own images' pixels
  for r in records[:4]:
    doc = encode_record(r, tok, images=proc, base_dir=checkpoint)
    cuts = np.cumsum(doc.get("image_sizes", np.zeros(0, int)))[:-1]
    own[tuple(doc["input_ids"].tolist())] = [
      pixel_values(p)
      for p in np.split(doc.get("image_patches", np.zeros((0, 768))), cuts)
      if len(p)
    ]
  batches = list(
    corpus.packed_batches(
      str(tmp_path / "corpus"),
      batch_size=2,
      seq_len=256,
      images_per_row=3,
      shuffle=False,
      num_epochs=1,
      process_index=0,
      process_count=1,
    )
  )
  seen = 0
  for batch in batches:
    assert batch["pixel_values"].shape == (2 * 3, 70 * 9, 768)
    for r in range(2):
      slots = slice(3 * r, 3 * r + 3)
      ids, docs = batch["input_ids"][r], batch["_packed_seq_ids"][r]
      # the row's image tokens are exactly the soft tokens its slots yield
      assert (
        soft_token_counts(batch["image_position_ids"][slots], 3).sum()
        == (ids == info["image_token_id"]).sum()
      )
      want = [p for d in np.unique(docs[docs > 0]) for p in own[tuple(ids[docs == d].tolist())]]
      for i, pixels in enumerate(want):  # in document order, then the empty slots
        np.testing.assert_array_equal(batch["pixel_values"][3 * r + i][: len(pixels)], pixels)
      for i in range(len(want), 3):
        assert (batch["image_position_ids"][3 * r + i] == -1).all()
      seen += len(np.unique(docs[docs > 0]))
  assert seen == 4
  with pytest.raises(ValueError, match=r"images_per_row must be an int >= 2"):
    corpus.packed_rows(
      str(tmp_path / "corpus"), seq_len=256, images_per_row=1, process_index=0, process_count=1
    )
