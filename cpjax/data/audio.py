"""Audio clips as Gemma 4's feature extractors make them, in numpy.

* :func:`log_mel`: E2B and E4B's ``input_features`` (transformers'
  ``Gemma4AudioFeatureExtractor``): log-mel frames of 128 HTK mel bins
  (0 to 8 kHz) from a periodic-Hann STFT of 20 ms frames every 10 ms,
  semicausal (the first frame centred on the first sample), and each
  frame's mask: real when its whole window holds real samples.
* :func:`waveform_frames`: the 12B unified model's (``Gemma4UnifiedAudio
  FeatureExtractor``): the waveform cut into frames of 640 samples (40 ms),
  the last one zero-padded, every frame real.
* :func:`read_audio`: an audio file's samples (WAV, FLAC, OGG: what
  libsndfile reads, through ``soundfile``) in [-1, 1], its channels
  averaged; :func:`read_wav` reads PCM WAV with the standard library alone.
* :class:`AudioProcessor`: which of the two a checkpoint's audio takes (read
  from its processor config), and how many soft tokens a clip yields.

Both extractors take 16 kHz mono audio (a clip at another rate is a
``ValueError`` naming it: resample it first). Unlike transformers' extractor,
whose call cuts a clip at 30 s by default, nothing here shortens a clip: an
hour of speech is 360,000 log-mel frames, 90,000 soft tokens.

Shape letters: ``N`` samples, ``T`` frames, ``F`` mel bins.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import wave

import numpy as np

__all__ = [
  "SAMPLING_RATE",
  "AudioProcessor",
  "log_mel",
  "read_audio",
  "read_wav",
  "waveform_frames",
]

SAMPLING_RATE = 16_000
_FRAME, _HOP = 320, 160  # 20 ms windows every 10 ms
_FFT = 2 ** math.ceil(math.log2(_FRAME))
_MEL_BINS, _MEL_FLOOR, _TOP_HZ = 128, 1e-3, 8000.0
# The extractor pads a clip to a multiple of this many samples (its default
# pad_to_multiple_of), which can add one frame of padding at the end.
_PAD_TO = 128


def _check_rate(sampling_rate: int) -> None:
  if sampling_rate != SAMPLING_RATE:
    raise ValueError(
      f"sampling_rate must be {SAMPLING_RATE} Hz (Gemma 4's feature extractors take "
      f"16 kHz audio; resample the clip first), got {sampling_rate}"
    )


def _waveform(samples: np.ndarray, name: str = "samples") -> np.ndarray:
  samples = np.asarray(samples)
  if samples.ndim != 1 or not np.issubdtype(samples.dtype, np.floating):
    raise ValueError(
      f"{name} must be a 1-D float waveform (mono, in [-1, 1]), got "
      f"{samples.dtype} of shape {samples.shape}"
    )
  return samples


@functools.cache
def _mel_filters() -> np.ndarray:
  """float64[FFT/2 + 1, F]: triangular HTK mel filters, unnormalised (as
  transformers' ``mel_filter_bank(..., norm=None, mel_scale="htk")``)."""
  to_mel = lambda hz: 2595.0 * np.log10(1.0 + hz / 700.0)
  mels = np.linspace(to_mel(0.0), to_mel(_TOP_HZ), _MEL_BINS + 2)
  edges = 700.0 * (10.0 ** (mels / 2595.0) - 1.0)  # Hz: each filter's left, centre, right
  bins = np.linspace(0, SAMPLING_RATE // 2, _FFT // 2 + 1)
  slopes = edges[None, :] - bins[:, None]
  width = np.diff(edges)
  down, up = -slopes[:, :-2] / width[:-1], slopes[:, 2:] / width[1:]
  return np.maximum(0.0, np.minimum(down, up))


def log_mel(
  samples: np.ndarray, *, sampling_rate: int = SAMPLING_RATE
) -> tuple[np.ndarray, np.ndarray]:
  """Compute E2B and E4B's ``input_features`` of one clip.

  Args:
    samples: float[N], mono, 16 kHz.
    sampling_rate: the clip's rate (must be 16000).

  Returns:
    (float32[T, 128] log-mel frames, zero where not real; bool[T] real
    frames): ``T = (N' - 161) // 160 + 1`` with ``N'`` the clip padded to a
    multiple of 128 samples; a frame is real when its window holds no padding.

  >>> features, real = log_mel(np.zeros(16000))
  >>> features.shape, int(real.sum())
  ((99, 128), 99)
  """
  _check_rate(sampling_rate)
  samples = _waveform(samples)
  n = len(samples)
  padded = -(-n // _PAD_TO) * _PAD_TO
  # Semicausal: half a window of zeros in front, so frame 0 is centred on sample 0.
  # float32 throughout the transform, as the extractor computes it.
  wave_ = np.zeros(padded + _FRAME // 2, np.float32)
  wave_[_FRAME // 2 : _FRAME // 2 + n] = samples
  frames = (len(wave_) - (_FRAME + 1)) // _HOP + 1
  if frames <= 0:  # (the extractor pads to 128 samples: 129 are the fewest that frame)
    raise ValueError(f"samples must hold at least {_PAD_TO + 1} samples, got {n}")
  # Each frame's window reads FRAME samples; the extractor tests FRAME + 1 for realness.
  starts = np.arange(frames) * _HOP
  windows = wave_[starts[:, None] + np.arange(_FRAME)[None, :]]
  hann = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(_FRAME) / _FRAME)  # periodic
  spectrum = np.abs(np.fft.rfft(windows * hann.astype(np.float32), n=_FFT, axis=-1))
  features = np.log(spectrum @ _mel_filters() + _MEL_FLOOR).astype(np.float32)
  real = starts + _FRAME < _FRAME // 2 + n  # the window's last sample (FRAME + 1 wide) is real
  return features * real[:, None], real


def waveform_frames(
  samples: np.ndarray, *, sampling_rate: int = SAMPLING_RATE, samples_per_token: int = 640
) -> tuple[np.ndarray, np.ndarray]:
  """Compute the 12B unified model's ``input_features`` of one clip.

  Args:
    samples: float[N], mono, 16 kHz.
    sampling_rate: the clip's rate (must be 16000).
    samples_per_token: the config's ``audio_embed_dim`` (640: 40 ms).

  Returns:
    (float32[ceil(N / samples_per_token), samples_per_token], bool[T] all True).

  >>> frames, real = waveform_frames(np.ones(1000))
  >>> frames.shape, float(frames[1, 359]), float(frames[1, 360]), bool(real.all())
  ((2, 640), 1.0, 0.0, True)
  """
  _check_rate(sampling_rate)
  samples = _waveform(samples)
  tokens = -(-len(samples) // samples_per_token)
  out = np.zeros(tokens * samples_per_token, np.float32)
  out[: len(samples)] = samples
  return out.reshape(tokens, samples_per_token), np.ones(tokens, bool)


def read_wav(path: str | os.PathLike[str]) -> tuple[np.ndarray, int]:
  """Read a PCM WAV file (8, 16, 24 or 32 bits a sample).

  Returns:
    (float32[N] samples in [-1, 1], the channels averaged; the sampling rate).
  """
  with wave.open(os.fspath(path), "rb") as f:
    width, channels, rate = f.getsampwidth(), f.getnchannels(), f.getframerate()
    raw = f.readframes(f.getnframes())
  if width == 1:  # unsigned 8-bit
    values = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
  elif width in (2, 4):
    kind = np.int16 if width == 2 else np.int32
    values = np.frombuffer(raw, kind).astype(np.float32) / float(2 ** (8 * width - 1))
  elif width == 3:  # little-endian 24-bit: widen to 32 bits
    b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
    values = ((b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8).astype(np.float32) / 2**23
  else:
    raise ValueError(f"{path}: {8 * width}-bit WAV samples are not PCM cpjax reads")
  return values.reshape(-1, channels).mean(axis=1), rate


def read_audio(path: str | os.PathLike[str]) -> tuple[np.ndarray, int]:
  """Read an audio file: WAV (any PCM or float encoding), FLAC, OGG or what
  else libsndfile reads.

  Args:
    path: the file.

  Returns:
    (float32[N] samples in [-1, 1], the channels averaged; the sampling rate).

  >>> import tempfile, soundfile
  >>> path = os.path.join(tempfile.mkdtemp(), "a.flac")
  >>> soundfile.write(path, np.full((4, 2), 0.25), 16000)
  >>> samples, rate = read_audio(path)
  >>> samples.tolist(), rate
  ([0.25, 0.25, 0.25, 0.25], 16000)
  """
  import soundfile

  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"audio file {path} does not exist")
  samples, rate = soundfile.read(path, dtype="float32", always_2d=True)
  return samples.mean(axis=1), int(rate)


# transformers' Gemma4AudioFeatureExtractor settings that log_mel computes; a
# checkpoint whose processor config sets one otherwise is refused, naming it.
_LOG_MEL_SETTINGS = {
  "feature_size": _MEL_BINS,
  "sampling_rate": SAMPLING_RATE,
  "frame_length_ms": 1000 * _FRAME / SAMPLING_RATE,
  "hop_length_ms": 1000 * _HOP / SAMPLING_RATE,
  "frame_length": _FRAME,
  "hop_length": _HOP,
  "fft_length": _FFT,
  "min_frequency": 0.0,
  "max_frequency": _TOP_HZ,
  "mel_floor": _MEL_FLOOR,
  "preemphasis": 0.0,
  "fft_overdrive": False,
  "dither": 0.0,
  "input_scale_factor": 1.0,
  "per_bin_mean": None,
  "per_bin_stddev": None,
}
_EXTRACTORS = {
  "Gemma4AudioFeatureExtractor": "log_mel",
  "Gemma4UnifiedAudioFeatureExtractor": "waveform",
}


@dataclasses.dataclass(frozen=True)
class AudioProcessor:
  """The features a checkpoint's audio takes, as its feature extractor makes them.

  Attributes:
    kind: ``"log_mel"`` (E2B and E4B's tower: :func:`log_mel`) or
      ``"waveform"`` (the 12B unified model: :func:`waveform_frames`).
    samples_per_token: the waveform frame (``audio_samples_per_token``).

  >>> proc = AudioProcessor("log_mel")
  >>> features, real = proc.features(np.zeros(16000), 16000)
  >>> features.shape, proc.soft_tokens(real), AudioProcessor("waveform").width
  ((99, 128), 25, 640)
  """

  kind: str = "log_mel"
  samples_per_token: int = 640

  def __post_init__(self):
    if self.kind not in _EXTRACTORS.values():
      raise ValueError(
        f"kind must be one of {sorted(set(_EXTRACTORS.values()))}, got {self.kind!r}"
      )
    n = self.samples_per_token
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise ValueError(f"samples_per_token must be a positive int, got {n!r}")

  @property
  def width(self) -> int:
    """Features of one frame (``input_features``' last axis)."""
    return _MEL_BINS if self.kind == "log_mel" else self.samples_per_token

  def features(self, samples: np.ndarray, sampling_rate: int) -> tuple[np.ndarray, np.ndarray]:
    """Compute one clip's ``input_features`` float32[T, width] and real frames bool[T].

    Args:
      samples: float[N], mono.
      sampling_rate: the clip's rate (16000; another is a ``ValueError``).

    Returns:
      :func:`log_mel`'s or :func:`waveform_frames`' result.
    """
    if self.kind == "log_mel":
      return log_mel(samples, sampling_rate=sampling_rate)
    return waveform_frames(
      samples, sampling_rate=sampling_rate, samples_per_token=self.samples_per_token
    )

  def soft_tokens(self, real: np.ndarray) -> int:
    """Soft tokens (placeholders in the text) of a clip with real frames ``real`` bool[T].

    The tower keeps the real frames that survive its two stride-2
    convolutions (``real[::2][::2]``, as transformers' processor counts
    them); the unified model makes one of each real frame.
    """
    real = np.asarray(real, bool)
    return int(real[::2][::2].sum() if self.kind == "log_mel" else real.sum())

  @classmethod
  def from_checkpoint(cls, path: str | os.PathLike) -> "AudioProcessor | None":
    """Read a checkpoint's audio feature extractor.

    From its processor config's ``feature_extractor`` entry
    (``processor_config.json``, or ``preprocessor_config.json``); without
    one, from ``config.json``: a unified model's (waveform frames of its
    ``audio_embed_dim``) or a model with an ``audio_config`` (log-mel).

    Args:
      path: the checkpoint directory.

    Returns:
      The :class:`AudioProcessor`, or None when the checkpoint takes no audio.

    Raises:
      ValueError: an extractor cpjax does not compute, or settings of
        transformers' extractor other than those :func:`log_mel` computes
        (each named).
    """
    path = os.fspath(path)
    for name in ("processor_config.json", "preprocessor_config.json"):
      raw = _read_json(os.path.join(path, name))
      if raw is None:
        continue
      entry = raw.get("feature_extractor", raw)
      kind = entry.get("feature_extractor_type") if isinstance(entry, dict) else None
      if kind is None:
        continue
      if kind not in _EXTRACTORS:
        raise ValueError(
          f"{name} in {path}: feature_extractor_type {kind!r} is not one cpjax "
          f"computes (expected one of {sorted(_EXTRACTORS)})"
        )
      if _EXTRACTORS[kind] == "waveform":
        if entry.get("sampling_rate", SAMPLING_RATE) != SAMPLING_RATE:
          _check_rate(entry["sampling_rate"])
        return cls("waveform", entry.get("audio_samples_per_token", 640))
      for key, want in _LOG_MEL_SETTINGS.items():
        if key in entry and entry[key] != want:
          raise ValueError(
            f"{name} in {path}: the feature extractor's {key} is {entry[key]!r}; "
            f"cpjax computes Gemma 4's log-mel features with {key} = {want!r}"
          )
      return cls("log_mel")
    config = _read_json(os.path.join(path, "config.json")) or {}
    if config.get("model_type") == "gemma4_unified":
      return cls("waveform", (config.get("audio_config") or {}).get("audio_embed_dim", 640))
    if config.get("audio_config"):
      return cls("log_mel")
    return None


def _read_json(file: str) -> dict | None:
  if not os.path.isfile(file):
    return None
  with open(file, encoding="utf-8") as f:
    return json.load(f)
