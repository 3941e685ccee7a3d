"""Generate the small shipped chat example: cpjax/examples/chat/.

    python tests/data/make_chat_example.py

Writes a Gemma-style tokenizer (``tokenizer.json``: byte-fallback BPE,
spaces as "▁", Gemma's special-token ids; ``tokenizer_config.json``;
``chat_template.jinja``: Gemma 4's turn format) trained on the data it
ships with, and ``train.jsonl`` / ``eval.jsonl``: arithmetic conversations
(a learnable signal: the answer follows from the question) and a few plain
text documents. 512 tokens in all, the tiny Gemma 4 preset's vocabulary.
The tests build their own tokenizers with :func:`gemma_style_tokenizer`.
"""

import json
import os

import numpy as np

# Gemma's first ids (pad 0, eos 1, bos 2, unk 3, mask 4), then Gemma 4's turn
# and image markers.
SPECIAL_TOKENS = (
  "<pad>",
  "<eos>",
  "<bos>",
  "<unk>",
  "<mask>",
  "<|turn>",
  "<turn|>",
  "<|image>",
  "<|image|>",
  "<image|>",
)

# Gemma 4's tokenizer config names its image and audio markers; transformers'
# processor wants all of them.
MARKERS = {
  "boi_token": "<|image>",
  "image_token": "<|image|>",
  "eoi_token": "<image|>",
  "boa_token": "<|audio>",
  "audio_token": "<|audio|>",
  "eoa_token": "<audio|>",
}

# Gemma 4's conversation format: bos, then `<|turn>ROLE\n...<turn|>\n` per
# message (the assistant's turns are "model"), images as `<|image|>`, audio
# clips as `<|audio|>`, videos as `<|video|>`.
GEMMA_STYLE_TEMPLATE = """{{ bos_token }}
{%- for message in messages -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{{ '<|turn>' + role + '\\n' }}
{%- if message['content'] is string -%}
{{ message['content'] | trim }}
{%- else -%}
{%- for part in message['content'] -%}
{%- if part['type'] == 'image' -%}{{ '\\n\\n<|image|>\\n\\n' }}
{%- elif part['type'] == 'audio' -%}{{ '<|audio|>' }}
{%- elif part['type'] == 'video' -%}{{ '\\n\\n<|video|>\\n\\n' }}
{%- elif part['type'] == 'text' -%}{{ part['text'] | trim }}{%- endif -%}
{%- endfor -%}
{%- endif -%}
{{ '<turn|>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|turn>model\\n' }}{%- endif -%}
"""


def gemma_style_tokenizer(
  directory: str,
  texts,
  *,
  vocab_size: int = 512,
  template: str = GEMMA_STYLE_TEMPLATE,
  config: dict | None = None,
  special_tokens=SPECIAL_TOKENS,
) -> str:
  """Write a Gemma-style tokenizer trained on ``texts`` into ``directory``
  (``special_tokens`` take the first ids)."""
  from tokenizers import Tokenizer, decoders, models, normalizers, trainers

  os.makedirs(directory, exist_ok=True)
  tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
  tok.normalizer = normalizers.Replace(" ", "▁")
  tok.decoder = decoders.Sequence(
    [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
  )
  byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size, special_tokens=[*special_tokens, *byte_tokens], show_progress=False
  )
  tok.train_from_iterator(texts, trainer)
  tok.save(os.path.join(directory, "tokenizer.json"), pretty=False)
  config = {
    "tokenizer_class": "GemmaTokenizer",
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "pad_token": "<pad>",
    "unk_token": "<unk>",
    "mask_token": "<mask>",
    "padding_side": "left",
    **(config or {}),
  }
  with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=1)
  with open(os.path.join(directory, "chat_template.jinja"), "w", encoding="utf-8") as f:
    f.write(template)
  return directory


def conversation(rng) -> dict:
  a, b = (int(x) for x in rng.integers(1, 50, 2))
  messages = [
    {"role": "user", "content": f"What is {a} plus {b}?"},
    {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
  ]
  if rng.random() < 0.3:
    messages.insert(0, {"role": "system", "content": "You add numbers."})
  total = a + b
  for _ in range(int(rng.integers(0, 3))):
    c = int(rng.integers(1, 20))
    messages += [
      {"role": "user", "content": [{"type": "text", "text": f"And plus {c}?"}]},
      {"role": "assistant", "content": f"{total} plus {c} is {total + c}."},
    ]
    total += c
  return {"messages": messages}


def text_document(rng) -> dict:
  start = int(rng.integers(1, 60))
  return {"text": "Counting: " + " ".join(str(start + i) for i in range(int(rng.integers(5, 30))))}


def records(n: int, seed: int) -> list[dict]:
  rng = np.random.default_rng(seed)
  return [text_document(rng) if rng.random() < 0.1 else conversation(rng) for _ in range(n)]


def texts_of(recs) -> list[str]:
  out = []
  for r in recs:
    if "text" in r:
      out.append(r["text"])
      continue
    for m in r["messages"]:
      c = m["content"]
      out.append(c if isinstance(c, str) else " ".join(p["text"] for p in c))
  return out + ["system user model"]


if __name__ == "__main__":
  out = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "cpjax", "examples", "chat"
  )
  out = os.path.normpath(out)
  train, evaluation = records(400, seed=0), records(40, seed=1)
  gemma_style_tokenizer(out, texts_of(train))
  for name, recs in (("train.jsonl", train), ("eval.jsonl", evaluation)):
    with open(os.path.join(out, name), "w", encoding="utf-8") as f:
      for r in recs:
        f.write(json.dumps(r) + "\n")
  print(out, len(train), "train and", len(evaluation), "eval records")
