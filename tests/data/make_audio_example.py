"""Generate the small shipped audio example: cpjax/examples/audio_chat/.

    python tests/data/make_audio_example.py

Writes four half-second synthetic clips at 16 kHz (a rising and a falling
sweep, a steady tone, noise; two as 16-bit WAV, two as FLAC) and
``audio_chat.jsonl``: conversations that ask what a clip holds and answer it
(a signal the model can learn from the audio alone), some with two clips,
and a plain text document. Any checkpoint that takes audio reads it with
its own tokenizer, chat template and feature extractor (``cpjax train
--checkpoint DIR --data cpjax/examples/audio_chat/audio_chat.jsonl``).
"""

import json
import os

import numpy as np

RATE = 16_000
OUT = os.path.join(os.path.dirname(__file__), "..", "..", "cpjax", "examples", "audio_chat")

# name -> (file, answer)
CLIPS = {
  "rising": ("rising.wav", "a rising tone"),
  "falling": ("falling.flac", "a falling tone"),
  "steady": ("steady.wav", "a steady tone"),
  "noise": ("noise.flac", "noise"),
}


def clip(name: str, seconds: float = 0.5) -> np.ndarray:
  t = np.arange(int(RATE * seconds)) / RATE
  if name == "noise":
    return 0.3 * np.random.default_rng(0).standard_normal(t.size).clip(-3, 3) / 3
  start, end = {"rising": (300, 1500), "falling": (1500, 300), "steady": (660, 660)}[name]
  # A linear sweep: the phase integrates the frequency.
  phase = 2 * np.pi * (start * t + (end - start) * t**2 / (2 * seconds))
  return 0.5 * np.sin(phase)


def records(n: int = 24, seed: int = 0) -> list[dict]:
  rng = np.random.default_rng(seed)
  names = list(CLIPS)
  out = []
  for i in range(n):
    a = names[int(rng.integers(len(names)))]
    messages = [
      {
        "role": "user",
        "content": [
          {"type": "audio", "audio": CLIPS[a][0]},
          {"type": "text", "text": "What do you hear?"},
        ],
      },
      {"role": "assistant", "content": f"I hear {CLIPS[a][1]}."},
    ]
    if i % 4 == 3:  # a second clip in the same conversation
      b = names[int(rng.integers(len(names)))]
      messages += [
        {
          "role": "user",
          "content": [
            {"type": "text", "text": "And now?"},
            {"type": "audio", "audio": CLIPS[b][0]},
          ],
        },
        {"role": "assistant", "content": f"Now {CLIPS[b][1]}."},
      ]
    out.append({"messages": messages})
  out.append({"text": "A rising tone goes up; a falling tone goes down; noise has no pitch."})
  return out


def main() -> None:
  import soundfile

  os.makedirs(OUT, exist_ok=True)
  for name, (file, _) in CLIPS.items():
    soundfile.write(os.path.join(OUT, file), clip(name), RATE, subtype="PCM_16")
  with open(os.path.join(OUT, "audio_chat.jsonl"), "w", encoding="utf-8") as f:
    for record in records():
      f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
  main()
