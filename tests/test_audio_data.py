"""Audio clips as Gemma 4's feature extractors make them (cpjax.data.audio):
bit for bit transformers' ``Gemma4AudioFeatureExtractor`` (log-mel frames and
their mask) and ``Gemma4UnifiedAudioFeatureExtractor`` (waveform frames) on
clips of several lengths, longer than its 30 s cut included; WAV files read
back as written; a clip at another rate is refused."""

import wave

import numpy as np
import pytest

from cpjax.data import audio

# 1025: its last frame's window reads the padding to 1152 samples (not real).
LENGTHS = [1000, 1025, 16000, 16001, 33333]


def _clip(n: int, seed: int = 0) -> np.ndarray:
  return (np.random.default_rng(seed).standard_normal(n) * 0.1).astype(np.float32)


@pytest.mark.parametrize("n", LENGTHS)
def test_log_mel_is_transformers_feature_extractor(n):
  fe = pytest.importorskip("transformers.models.gemma4.feature_extraction_gemma4")
  want = fe.Gemma4AudioFeatureExtractor()([_clip(n)], return_tensors="np")
  features, real = audio.log_mel(_clip(n))
  np.testing.assert_array_equal(features, want["input_features"][0])
  np.testing.assert_array_equal(real, want["input_features_mask"][0])
  assert real.all() == (n != 1025)


def test_a_clip_past_transformers_30_s_cut_is_kept_whole():
  """transformers' call cuts at 480,000 samples by default; cpjax keeps every
  frame, and the first 30 s are transformers' frames."""
  fe = pytest.importorskip("transformers.models.gemma4.feature_extraction_gemma4")
  clip = _clip(16000 * 31)
  cut = fe.Gemma4AudioFeatureExtractor()([clip], return_tensors="np")["input_features"][0]
  features, real = audio.log_mel(clip)
  assert len(features) == 3099 and len(cut) == 2999 and real.sum() == 3099
  np.testing.assert_array_equal(features[:2998], cut[:2998])  # (its last frame reads the cut)


@pytest.mark.parametrize("n", [1000, 1280, 16001])
def test_waveform_frames_are_the_unified_extractor(n):
  fe = pytest.importorskip("transformers.models.gemma4_unified.feature_extraction_gemma4_unified")
  want = fe.Gemma4UnifiedAudioFeatureExtractor()([_clip(n)], return_tensors="np")
  frames, real = audio.waveform_frames(_clip(n))
  np.testing.assert_array_equal(frames, want["input_features"][0])
  np.testing.assert_array_equal(real, want["input_features_mask"][0])


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_wav_files_read_back_as_written(tmp_path, width):
  """Stereo PCM of each width: the channels' mean, scaled to [-1, 1]."""
  rng = np.random.default_rng(width)
  bits = 8 * width
  ints = rng.integers(-(2 ** (bits - 1)), 2 ** (bits - 1), (50, 2))
  stored = ints + 128 if width == 1 else ints  # 8-bit WAV is unsigned
  raw = b"".join(int(v).to_bytes(width, "little", signed=width > 1) for v in stored.ravel())
  with wave.open(str(tmp_path / "x.wav"), "wb") as f:
    f.setnchannels(2)
    f.setsampwidth(width)
    f.setframerate(16000)
    f.writeframes(raw)
  samples, rate = audio.read_wav(tmp_path / "x.wav")
  assert rate == 16000
  np.testing.assert_allclose(samples, ints.mean(axis=1) / 2 ** (bits - 1), rtol=1e-6, atol=1e-7)


def test_bad_clips_are_refused():
  with pytest.raises(ValueError, match="sampling_rate must be 16000 Hz .* got 44100"):
    audio.log_mel(_clip(1000), sampling_rate=44100)
  with pytest.raises(ValueError, match="sampling_rate must be 16000 Hz .* got 8000"):
    audio.waveform_frames(_clip(1000), sampling_rate=8000)
  with pytest.raises(ValueError, match=r"samples must be a 1-D float waveform .* \(2, 500\)"):
    audio.log_mel(np.zeros((2, 500), np.float32))
  with pytest.raises(ValueError, match="samples must be a 1-D float waveform .* int16"):
    audio.log_mel(np.zeros(500, np.int16))
