"""Conversations with audio files -> documents -> packed rows: the tokens,
features and masks of transformers' Gemma 4 processors (E2B / E4B's log-mel,
the 12B's waveform frames); the clips ride with their documents through
packing; ``prepare-data`` counts them; bad clips are reported by line."""

import json
import os
import shutil

import numpy as np
import pytest

from cpjax.data import corpus
from cpjax.data.audio import AudioProcessor, read_audio, read_wav
from cpjax.data.records import BadRecord, encode_record, prepare_data
from cpjax.data.tokenizer import CheckpointTokenizer
from tests.data.make_audio_example import CLIPS
from tests.helpers import AUDIO_EXAMPLE

EXAMPLE = os.path.join(AUDIO_EXAMPLE, "audio_chat.jsonl")
EXTRACTORS = {
  "log_mel": "Gemma4AudioFeatureExtractor",
  "waveform": "Gemma4UnifiedAudioFeatureExtractor",
}


def _tokenizer(directory: str, kind: str) -> str:
  """A Gemma-style tokenizer with Gemma 4's image and audio markers, and the
  processor config of ``kind``'s feature extractor."""
  from tests.data.make_chat_example import MARKERS, SPECIAL_TOKENS, gemma_style_tokenizer

  gemma_style_tokenizer(
    directory,
    ["what do you hear", "a rising tone", "and now"] * 5,
    vocab_size=400,
    config=MARKERS,
    special_tokens=(*SPECIAL_TOKENS, "<|audio>", "<|audio|>", "<audio|>"),
  )
  with open(os.path.join(directory, "processor_config.json"), "w") as f:
    json.dump({"feature_extractor": {"feature_extractor_type": EXTRACTORS[kind]}}, f)
  return directory


@pytest.fixture(scope="module", params=["log_mel", "waveform"])
def checkpoint(request, tmp_path_factory):
  d = _tokenizer(str(tmp_path_factory.mktemp(request.param)), request.param)
  for name in ("rising.wav", "falling.flac"):
    shutil.copy(os.path.join(AUDIO_EXAMPLE, name), d)
  # 3,001 samples: the log-mel clip's last frame reads padding (not real).
  import soundfile

  clip = 0.2 * np.sin(np.arange(3001) / 7.0)
  soundfile.write(os.path.join(d, "short.wav"), clip, 16000, subtype="PCM_16")
  return d


CONVERSATION = [
  {
    "role": "user",
    "content": [
      {"type": "audio", "audio": "rising.wav"},
      {"type": "text", "text": "what do you hear"},
    ],
  },
  {"role": "assistant", "content": "a rising tone"},
  {
    "role": "user",
    "content": [
      {"type": "text", "text": "and now"},
      {"type": "audio", "path": "short.wav"},
      {"type": "audio", "audio": "falling.flac"},
    ],
  },
  {"role": "assistant", "content": "a falling tone"},
]


def _processor(checkpoint: str, monkeypatch):
  """transformers' Gemma 4 processor of the checkpoint's kind (its video
  processor, which needs torchvision, left out: no video reaches it)."""
  transformers = pytest.importorskip("transformers")
  from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

  kind = AudioProcessor.from_checkpoint(checkpoint).kind
  if kind == "log_mel":
    from transformers.models.gemma4.feature_extraction_gemma4 import (
      Gemma4AudioFeatureExtractor as Extractor,
    )

    cls = transformers.Gemma4Processor
  else:
    from transformers.models.gemma4_unified.feature_extraction_gemma4_unified import (
      Gemma4UnifiedAudioFeatureExtractor as Extractor,
    )

    cls = transformers.Gemma4UnifiedProcessor
  check = cls.check_argument_for_proper_class
  monkeypatch.setattr(
    cls,
    "check_argument_for_proper_class",
    lambda self, name, arg: (
      None if name in ("video_processor", "image_processor") else check(self, name, arg)
    ),
  )
  return cls(
    feature_extractor=Extractor(),
    video_processor=None,
    image_processor=Gemma4ImageProcessorPil(),
    tokenizer=transformers.AutoTokenizer.from_pretrained(checkpoint),
    chat_template=CheckpointTokenizer(checkpoint).chat_template,
  )


def test_conversation_with_audio_equals_gemma4_processor(checkpoint, monkeypatch):
  """Three clips (WAV and FLAC, one with a padding frame) in two turns: the
  token ids (each placeholder expanded to its clip's soft tokens between the
  audio markers), each clip's features and real frames are the processor's,
  bit for bit; the loss counts the two answers and never an audio token."""
  processor = _processor(checkpoint, monkeypatch)
  tok = CheckpointTokenizer(checkpoint)
  audio = AudioProcessor.from_checkpoint(checkpoint)
  doc = encode_record({"messages": CONVERSATION}, tok, audio=audio, base_dir=checkpoint)
  # transformers reads the files itself with librosa; the samples are read here
  # (each file's values are tested against what was written below).
  clips = [
    read_audio(os.path.join(checkpoint, f))[0] for f in ("rising.wav", "short.wav", "falling.flac")
  ]
  theirs = processor(text=tok.render(CONVERSATION), audio=clips, return_tensors="np")
  ids = doc["input_ids"]
  np.testing.assert_array_equal(ids, theirs["input_ids"][0])
  audio_id = tok.token_id("<|audio|>")
  np.testing.assert_array_equal(np.where(ids == audio_id, 3, 0), theirs["mm_token_type_ids"][0])
  sizes = doc["audio_sizes"]
  assert len(sizes) == 3
  starts = np.concatenate([[0], np.cumsum(sizes)])
  for i, (lo, hi) in enumerate(zip(starts[:-1], starts[1:])):
    np.testing.assert_array_equal(
      doc["audio_features"][lo:hi], theirs["input_features"][i][: hi - lo]
    )
    np.testing.assert_array_equal(
      doc["audio_mask"][lo:hi], theirs["input_features_mask"][i][: hi - lo]
    )
    assert not theirs["input_features_mask"][i][hi - lo :].any()
  if audio.kind == "log_mel":
    assert doc["audio_mask"][starts[2] - 1] == 0  # short.wav's last frame reads padding
  mask = doc["loss_mask"].astype(bool)
  assert not (mask & (ids == audio_id)).any()
  answers = tok.backend.decode(ids[mask].tolist(), skip_special_tokens=False)
  assert answers == "a rising tone<turn|>\na falling tone<turn|>\n"
  # A clip in an answer: its soft tokens are not the model's to predict.
  spoken = encode_record(
    {
      "messages": [
        {"role": "user", "content": "say it"},
        {"role": "assistant", "content": CONVERSATION[2]["content"]},
      ]
    },
    tok,
    audio=audio,
    base_dir=checkpoint,
  )
  tokens = spoken["input_ids"] == audio_id
  assert tokens.sum() == sum(
    audio.soft_tokens(m)
    for m in np.split(spoken["audio_mask"], np.cumsum(spoken["audio_sizes"])[:-1])
  )
  assert tokens.sum() > 0 and not (spoken["loss_mask"].astype(bool) & tokens).any()
  assert spoken["loss_mask"].sum() > 0


def test_audio_files_read_back_as_written(tmp_path):
  """16-bit WAV and FLAC (lossless) give the written integers / 32768;
  stereo is the channels' mean; WAV reads as the standard library's reader."""
  import soundfile

  ints = np.random.default_rng(0).integers(-(2**15), 2**15, (400, 2)).astype(np.int16)
  for name in ("x.wav", "x.flac"):
    soundfile.write(tmp_path / name, ints, 16000, subtype="PCM_16")
    samples, rate = read_audio(tmp_path / name)
    assert rate == 16000 and samples.dtype == np.float32
    np.testing.assert_allclose(samples, ints.mean(axis=1) / 2**15, rtol=0, atol=1e-7)
  np.testing.assert_array_equal(read_audio(tmp_path / "x.wav")[0], read_wav(tmp_path / "x.wav")[0])
  with pytest.raises(FileNotFoundError, match="audio file .*gone.wav does not exist"):
    read_audio(tmp_path / "gone.wav")


def test_clips_ride_with_their_documents_through_packing(checkpoint, tmp_path):
  """The shipped example (30 clips in 24 conversations, a text): each row's
  clip slots hold its own documents' clips in order, then padding; its audio
  tokens are its slots' soft tokens, marked 3 in mm_token_type_ids; the
  model's batch checks accept it; prepare-data counts clips and tokens."""
  import dataclasses

  from cpjax.models import gemma4
  from cpjax.models.gemma4.audio_config import Gemma4AudioConfig
  from cpjax.models.gemma4.unified_config import Gemma4UnifiedAudioConfig

  summary = prepare_data(
    EXAMPLE, tmp_path / "corpus", checkpoint=checkpoint, seq_len=128, progress=False
  )
  with open(EXAMPLE) as f:
    records = [json.loads(line) for line in f]
  files = [
    p["audio"]
    for r in records
    for m in r.get("messages", [])
    if isinstance(m["content"], list)
    for p in m["content"]
    if p["type"] == "audio"
  ]
  assert (summary.documents, summary.audio_clips, summary.max_audio_clips_per_document) == (
    25,
    30,
    2,
  )
  # Every clip is 8,000 samples: 13 soft tokens either way (the log-mel's 50
  # frames, 49 real, keep 13 after two stride-2 steps; ceil(8000 / 640) = 13).
  assert summary.audio_tokens == 13 * len(files) == 390
  tok = CheckpointTokenizer(checkpoint)
  proc = AudioProcessor.from_checkpoint(checkpoint)
  assert summary.max_audio_frames == (50 if proc.kind == "log_mel" else 13)
  assert "30 audio clips (390 tokens)" in summary.lines()[0]
  own = {}  # each record's tokens -> its own clips' features
  for r in records:
    doc = encode_record(r, tok, audio=proc, base_dir=AUDIO_EXAMPLE)
    cuts = np.cumsum(doc.get("audio_sizes", np.zeros(0, int)))[:-1]
    own[tuple(doc["input_ids"].tolist())] = (
      np.split(doc.get("audio_features", np.zeros((0, proc.width), np.float32)), cuts)
      if "audio_sizes" in doc
      else []
    )
  batches = corpus.packed_batches(
    str(tmp_path / "corpus"),
    batch_size=2,
    seq_len=128,
    audio_clips_per_row=4,
    shuffle=False,
    num_epochs=1,
    process_index=0,
    process_count=1,
  )
  if proc.kind == "log_mel":  # a tower over the extractor's 128 mel bins
    cfg = dataclasses.replace(gemma4.Gemma4Config.preset("tiny"), audio=Gemma4AudioConfig())
  else:
    cfg = dataclasses.replace(
      gemma4.Gemma4Config.preset("tiny-unified"), audio=Gemma4UnifiedAudioConfig(640)
    )
  cfg = dataclasses.replace(
    cfg,
    audio_token_id=tok.token_id("<|audio|>"),
    boa_token_id=tok.token_id("<|audio>"),
    eoa_token_index=tok.token_id("<audio|>"),
  )
  seen = 0
  for batch in batches:
    assert batch["input_features"].shape == (2 * 4, summary.max_audio_frames, proc.width)
    for r in range(2):
      ids, docs = batch["input_ids"][r], batch["_packed_seq_ids"][r]
      slots, real = (
        batch["input_features"][4 * r : 4 * r + 4],
        batch["input_features_mask"][4 * r : 4 * r + 4],
      )
      audio = ids == tok.token_id("<|audio|>")
      assert sum(proc.soft_tokens(m) for m in real) == audio.sum()
      np.testing.assert_array_equal(batch["mm_token_type_ids"][r], np.where(audio, 3, 0))
      want = [c for d in np.unique(docs[docs > 0]) for c in own[tuple(ids[docs == d].tolist())]]
      for i, clip in enumerate(want):
        np.testing.assert_array_equal(slots[i][: len(clip)], clip)
        assert not real[i][len(clip) :].any()
      assert not real[len(want) :].any() and not slots[len(want) :].any()
      seen += len(np.unique(docs[docs > 0]))
    gemma4.prepare_batch(batch, cfg)  # placeholders against real frames, widths
  assert seen == 25
  with pytest.raises(ValueError, match=r"audio_clips_per_row must be an int >= 2"):
    corpus.packed_rows(
      str(tmp_path / "corpus"), seq_len=128, audio_clips_per_row=1, process_index=0, process_count=1
    )


def test_bad_clips_are_dropped_and_reported_by_line(checkpoint, tmp_path):
  import soundfile

  for name in ("rising.wav", "short.wav"):
    shutil.copy(os.path.join(checkpoint, name), tmp_path)
  soundfile.write(tmp_path / "slow.wav", np.zeros(4000), 8000, subtype="PCM_16")
  (tmp_path / "junk.wav").write_bytes(b"not audio at all")

  def asking(*parts):
    return {
      "messages": [
        {"role": "user", "content": [*parts, {"type": "text", "text": "what do you hear"}]},
        {"role": "assistant", "content": "a tone"},
      ]
    }

  lines = [
    asking({"type": "audio", "audio": "rising.wav"}),  # 1 ok
    asking({"type": "audio", "audio": "slow.wav"}),  # 2 another rate
    asking({"type": "audio", "audio": "gone.flac"}),  # 3 missing
    asking({"type": "audio", "audio": "junk.wav"}),  # 4 unreadable
    asking({"type": "audio"}),  # 5 no file
    asking({"type": "audio", "url": "https://example.org/a.wav"}),  # 6 remote
    asking(*[{"type": "audio", "audio": "rising.wav"}] * 3),  # 7 longer than the row
  ]
  (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
  summary = prepare_data(
    tmp_path / "in.jsonl", tmp_path / "out", checkpoint=checkpoint, seq_len=40, progress=False
  )
  reasons = dict(summary.dropped)
  assert summary.documents == 1 and sorted(reasons) == [2, 3, 4, 5, 6, 7]
  assert "slow.wav: sampling_rate must be 16000 Hz" in reasons[2] and "got 8000" in reasons[2]
  assert "audio " in reasons[3] and "gone.flac does not exist" in reasons[3]
  assert "junk.wav cannot be read" in reasons[4]
  assert "an audio part names its file under one of ['audio', 'path', 'url']" in reasons[5]
  assert "is remote" in reasons[6]
  assert "tokens with audio clips, longer than the row of 40 (never truncated" in reasons[7]
  # truncation never cuts a clip's tokens either
  cut = prepare_data(
    tmp_path / "in.jsonl",
    tmp_path / "out2",
    checkpoint=checkpoint,
    seq_len=40,
    truncate=True,
    progress=False,
  )
  assert dict(cut.dropped)[7] == reasons[7]


def test_audio_a_checkpoint_cannot_take_is_refused(tmp_path):
  """A tokenizer without audio markers, a checkpoint without audio, an
  extractor with settings cpjax does not compute: each named."""
  from tests.data.make_chat_example import gemma_style_tokenizer

  shutil.copy(os.path.join(AUDIO_EXAMPLE, "rising.wav"), tmp_path)
  record = {
    "messages": [
      {"role": "user", "content": [{"type": "audio", "audio": "rising.wav"}]},
      {"role": "assistant", "content": "a tone"},
    ]
  }
  plain = gemma_style_tokenizer(str(tmp_path / "plain"), ["a tone"] * 5, vocab_size=300)
  assert AudioProcessor.from_checkpoint(plain) is None
  with pytest.raises(BadRecord, match=r"1 audio clip\(s\), but the checkpoint takes no audio"):
    encode_record(record, CheckpointTokenizer(plain), base_dir=str(tmp_path))
  with pytest.raises(BadRecord, match=r"renders 0 audio placeholders \(None\) for 1 audio inputs"):
    encode_record(
      record, CheckpointTokenizer(plain), audio=AudioProcessor(), base_dir=str(tmp_path)
    )
  odd = _tokenizer(str(tmp_path / "odd"), "log_mel")
  with open(os.path.join(odd, "processor_config.json"), "w") as f:
    json.dump(
      {
        "feature_extractor": {
          "feature_extractor_type": EXTRACTORS["log_mel"],
          "frame_length_ms": 25.0,
        }
      },
      f,
    )
  with pytest.raises(
    ValueError, match=r"frame_length_ms is 25.0; cpjax computes .* frame_length_ms = 20.0"
  ):
    AudioProcessor.from_checkpoint(odd)
  with open(os.path.join(odd, "processor_config.json"), "w") as f:
    json.dump({"feature_extractor": {"feature_extractor_type": "WhisperFeatureExtractor"}}, f)
  with pytest.raises(ValueError, match="'WhisperFeatureExtractor' is not one cpjax computes"):
    AudioProcessor.from_checkpoint(odd)


def test_the_example_clips_are_what_their_answers_say():
  """The shipped clips: half a second at 16 kHz each; the sweeps' spectral
  centroid (power-weighted mean frequency) rises or falls from one half to
  the other, the tone's sits at 660 Hz, the noise's spectrum is flat."""
  hz = np.fft.rfftfreq(4000, 1 / 16000)
  for name, (file, _) in CLIPS.items():
    samples, rate = read_audio(os.path.join(AUDIO_EXAMPLE, file))
    assert rate == 16000 and len(samples) == 8000
    power = [np.abs(np.fft.rfft(h)) ** 2 for h in np.split(samples, 2)]
    centroid = [float((hz * p).sum() / p.sum()) for p in power]
    if name == "rising":  # 300 -> 900 Hz, then 900 -> 1500 Hz
      assert abs(centroid[0] - 600) < 60 and abs(centroid[1] - 1200) < 60
    elif name == "falling":
      assert abs(centroid[0] - 1200) < 60 and abs(centroid[1] - 600) < 60
    elif name == "steady":
      assert abs(centroid[0] - 660) < 5 and abs(centroid[1] - 660) < 5
    else:
      assert abs(centroid[0] - 4000) < 200  # white: the mean of 0 to 8 kHz


def test_a_document_with_bad_audio_arrays_is_refused(tmp_path):
  """write_documents checks a document's audio arrays before writing it."""
  good = {
    "input_ids": np.array([1, 2]),
    "audio_features": np.zeros((3, 4), np.float32),
    "audio_mask": np.array([1, 1, 0], np.uint8),
    "audio_sizes": np.array([2, 1]),
  }
  assert corpus.write_documents(tmp_path / "ok.array_record", [good]) == 1
  for bad in (
    dict(good, audio_features=np.zeros((3, 4))),  # float64
    dict(good, audio_mask=np.array([1, 2, 0])),
    dict(good, audio_sizes=np.array([2, 2])),
  ):
    with pytest.raises(ValueError, match=r"document 0: audio_features must be float32 \[t, W\]"):
      corpus.write_documents(tmp_path / "bad.array_record", [bad])
