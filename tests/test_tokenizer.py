"""cpjax.data.tokenizer against transformers' AutoTokenizer on the same files, and
the answer mask against transformers' own assistant mask (a template with
``{% generation %}`` tags) and against hand-worked spans."""

import json
import os

import numpy as np
import pytest

from cpjax.data.tokenizer import CheckpointTokenizer
from tests.data.make_chat_example import GEMMA_STYLE_TEMPLATE, gemma_style_tokenizer

CORPUS = [
  "The quick brown fox jumps over the lazy dog.",
  "What is 12 plus 7? 12 plus 7 is 19.",
  "Context parallel training splits each sequence over devices.",
  "system user model assistant hello world how are you today",
] * 10
TEXTS = [
  "hello world",
  "  The quick\nbrown fox ünï 😀 <bos> x<|turn>y",
  "a",
  " ",
  "12 plus 7",
  "a <sep> named only in tokenizer_config.json",
]
CONVERSATIONS = [
  [
    {"role": "user", "content": "What is 12 plus 7?"},
    {"role": "assistant", "content": "12 plus 7 is 19."},
  ],
  [
    {"role": "system", "content": "You are  helpful."},
    {"role": "user", "content": "hello world, how are you? ünï"},
    {"role": "assistant", "content": "The quick brown fox."},
    {"role": "user", "content": [{"type": "text", "text": "the lazy dog"}]},
    {"role": "assistant", "content": " ring attention \n"},
  ],
  [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "😀 <bos>"},
    {"role": "tool", "content": "42"},
    {"role": "assistant", "content": "done"},
  ],
]
# The same template with transformers' {% generation %} tags around what the
# assistant writes (its content and the end of its turn).
TAGGED_TEMPLATE = GEMMA_STYLE_TEMPLATE.replace(
  "{%- if message['content'] is string -%}\n{{ message['content'] | trim }}",
  "{%- if message['content'] is string -%}\n"
  "{%- if message['role'] == 'assistant' -%}{% generation %}{{ message['content'] | trim }}"
  "{{ '<turn|>\\n' }}{% endgeneration %}{%- else -%}{{ message['content'] | trim }}"
  "{%- endif -%}",
).replace(
  "{%- endif -%}\n{{ '<turn|>\\n' }}",
  "{%- endif -%}\n{%- if message['role'] != 'assistant' -%}{{ '<turn|>\\n' }}{%- endif -%}",
)


def _bos_post_processor(directory):
  """Gemma's published tokenizer.json form: the post-processor adds <bos>."""
  from tokenizers import Tokenizer, processors

  path = os.path.join(directory, "tokenizer.json")
  tok = Tokenizer.from_file(path)
  tok.post_processor = processors.TemplateProcessing(
    single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 2)]
  )
  tok.save(path)


@pytest.fixture(scope="module", params=["gemma_bos", "plain_inline_template"])
def checkpoint(request, tmp_path_factory):
  d = str(tmp_path_factory.mktemp(request.param))
  if request.param == "gemma_bos":
    gemma_style_tokenizer(d, CORPUS, vocab_size=400, config={"add_bos_token": False})
    _bos_post_processor(d)
  else:
    # No tokenizer_class, the template inside tokenizer_config.json, extra
    # special tokens as AddedToken dicts (transformers' saved form), and a
    # special token tokenizer.json does not know (transformers adds it).
    gemma_style_tokenizer(
      d,
      CORPUS,
      vocab_size=400,
      config={
        "tokenizer_class": None,
        "chat_template": GEMMA_STYLE_TEMPLATE,
        "boi_token": {"content": "<|image>", "special": True},
        "image_token": "<|image|>",
        "sep_token": "<sep>",
      },
    )
    os.remove(os.path.join(d, "chat_template.jinja"))
  return d


def test_ids_equal_autotokenizer_and_apply_chat_template(checkpoint):
  transformers = pytest.importorskip("transformers")
  hf = transformers.AutoTokenizer.from_pretrained(checkpoint)
  ours = CheckpointTokenizer(checkpoint)
  for text in TEXTS:
    assert ours.encode(text) == hf(text)["input_ids"], text
  for messages in CONVERSATIONS:
    assert ours.render(messages) == hf.apply_chat_template(messages, tokenize=False)
    assert ours.render(messages, add_generation_prompt=True) == hf.apply_chat_template(
      messages, tokenize=False, add_generation_prompt=True
    )
    ids, _ = ours.encode_chat(messages)
    expected = hf.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert ids.dtype == np.int32 and ids.tolist() == expected


# Templates that mark the assistant's text themselves, each tried as
# transformers reads it: the tags around the content and the end-of-turn
# marker; around the content alone (the end of turn is then context); on
# lines of their own, where trim_blocks removes the newline after each tag
# and the newline inside the block stays; and with whitespace control.
TAGGED_TEMPLATES = {
  "content_and_end_of_turn": TAGGED_TEMPLATE,
  "content_only": TAGGED_TEMPLATE.replace(
    "{{ '<turn|>\\n' }}{% endgeneration %}", "{% endgeneration %}{{ '<turn|>\\n' }}"
  ),
  "block_lines": """{{ bos_token }}
{% for message in messages %}
{% if message['role'] == 'assistant' %}
<|turn>model
{% generation %}
{{ message['content'] if message['content'] is string else message['content'][0]['text'] }}<turn|>
{% endgeneration %}
{% else %}
<|turn>{{ message['role'] }}
{{ message['content'] if message['content'] is string else message['content'][0]['text'] }}<turn|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|turn>model
{% endif %}""",
  "plus_control": TAGGED_TEMPLATE.replace("{% generation %}", "{%+ generation %}"),
  "whitespace_control": "{{ bos_token }}{%- for m in messages -%}"
  "{{ '<|turn>' + m['role'] + '\\n' }}"
  "{%- if m['role'] == 'assistant' %} {%- generation -%} "
  "{{ m['content'] | trim }}<turn|> {%- endgeneration -%}"
  "{% else %}{{ m['content'] if m['content'] is string "
  "else m['content'][0]['text'] }}<turn|>{% endif %}\n"
  "{%- endfor -%}",
}


def _with_template(checkpoint, directory, template):
  os.makedirs(directory, exist_ok=True)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    with (
      open(os.path.join(checkpoint, name)) as src,
      open(os.path.join(directory, name), "w") as dst,
    ):
      dst.write(src.read())
  with open(os.path.join(directory, "chat_template.jinja"), "w") as f:
    f.write(template)
  return str(directory)


def test_answer_mask_equals_transformers_generation_mask(checkpoint, tmp_path):
  """Without tags, the prefix method gives the mask transformers reads off the
  same template with tags around the assistant's content and end of turn."""
  transformers = pytest.importorskip("transformers")
  tagged = _with_template(checkpoint, tmp_path, TAGGED_TEMPLATE)
  hf = transformers.AutoTokenizer.from_pretrained(tagged)
  ours = CheckpointTokenizer(checkpoint)  # the untagged template
  assert not ours.marks_generation
  for messages in CONVERSATIONS:
    out = hf.apply_chat_template(
      messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, answer = ours.encode_chat(messages)
    assert ids.tolist() == out["input_ids"]
    np.testing.assert_array_equal(answer, np.asarray(out["assistant_masks"], bool))


@pytest.mark.parametrize("name", sorted(TAGGED_TEMPLATES))
def test_generation_tags_are_the_answer_as_transformers_reads_them(checkpoint, tmp_path, name):
  transformers = pytest.importorskip("transformers")
  tagged = _with_template(checkpoint, tmp_path, TAGGED_TEMPLATES[name])
  hf = transformers.AutoTokenizer.from_pretrained(tagged)
  ours = CheckpointTokenizer(tagged)
  assert ours.marks_generation
  for messages in CONVERSATIONS:
    assert ours.render(messages) == hf.apply_chat_template(messages, tokenize=False)
    out = hf.apply_chat_template(
      messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, answer = ours.encode_chat(messages)
    assert ids.tolist() == out["input_ids"]
    assert answer.any()
    np.testing.assert_array_equal(answer, np.asarray(out["assistant_masks"], bool))
    prompted = hf.apply_chat_template(
      messages,
      tokenize=True,
      return_dict=True,
      add_generation_prompt=True,
      return_assistant_tokens_mask=True,
    )
    ids, answer = ours.encode_chat(messages, add_generation_prompt=True)
    assert ids.tolist() == prompted["input_ids"]
    np.testing.assert_array_equal(answer, np.asarray(prompted["assistant_masks"], bool))


def test_generation_tags_by_hand(tmp_path):
  """The tokens the blocks cover, decoded, for tags around the content alone
  and for tags whose newline trim_blocks removes."""
  for name, kept in (
    ("content_only", ["The quick brown fox.", "ring attention"]),
    ("block_lines", ["The quick brown fox.<turn|>\n", " ring attention \n<turn|>\n"]),
  ):
    d = gemma_style_tokenizer(
      str(tmp_path / name), CORPUS, vocab_size=400, template=TAGGED_TEMPLATES[name]
    )
    tok = CheckpointTokenizer(d)
    ids, answer = tok.encode_chat(CONVERSATIONS[1])
    cuts = np.flatnonzero(np.diff(answer.astype(int))) + 1
    runs = zip(np.split(ids, cuts), np.split(answer, cuts))
    assert [
      tok.backend.decode(r.tolist(), skip_special_tokens=False) for r, a in runs if a[0]
    ] == kept, name


def test_answer_tokens_are_the_assistant_turns_by_hand(tmp_path):
  d = gemma_style_tokenizer(str(tmp_path), CORPUS, vocab_size=400)
  tok = CheckpointTokenizer(d)
  messages = CONVERSATIONS[1]
  ids, answer = tok.encode_chat(messages)
  # The answer runs, decoded: each assistant message's trimmed content and its end of turn.
  cuts = np.flatnonzero(np.diff(answer.astype(int))) + 1
  runs = zip(np.split(ids, cuts), np.split(answer, cuts))
  kept = [tok.backend.decode(r.tolist(), skip_special_tokens=False) for r, a in runs if a[0]]
  assert kept == ["The quick brown fox.<turn|>\n", "ring attention<turn|>\n"]
  assert not answer[: ids.tolist().index(tok.token_id("<turn|>"))].any()  # system turn: context


def test_bad_conversations_and_checkpoints_are_named_errors(tmp_path):
  d = gemma_style_tokenizer(str(tmp_path / "ok"), CORPUS, vocab_size=400)
  tok = CheckpointTokenizer(d)
  with pytest.raises(ValueError, match=r"message 1 has role 'robot'; expected one of"):
    tok.encode_chat([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])
  with pytest.raises(TypeError, match=r"message 0 \(user\) content must be a string or a list"):
    tok.encode_chat([{"role": "user", "content": 3}])
  with pytest.raises(ValueError, match="messages must be a non-empty list"):
    tok.encode_chat([])
  with pytest.raises(KeyError, match="token '<nope>' is not in the vocabulary"):
    tok.token_id("<nope>")
  with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
    CheckpointTokenizer(str(tmp_path))
  # A template that renders earlier turns differently once later ones follow.
  later = gemma_style_tokenizer(
    str(tmp_path / "later"),
    CORPUS,
    vocab_size=400,
    template="{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %}{% endfor %}",
  )
  with pytest.raises(ValueError, match="message 1: the chat template renders the conversation"):
    CheckpointTokenizer(later).encode_chat(CONVERSATIONS[0] + CONVERSATIONS[0])
  os.remove(os.path.join(later, "chat_template.jinja"))
  with open(os.path.join(later, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": "<bos>"}, f)
  with pytest.raises(ValueError, match="has no chat template"):
    CheckpointTokenizer(later).render(CONVERSATIONS[0])


def test_template_sandbox_answers_as_transformers(checkpoint, tmp_path):
  """dict(), dict.fromkeys() and namespace() render as in transformers; a
  namespace attribute with a leading underscore is refused by both."""
  transformers = pytest.importorskip("transformers")
  import jinja2

  good = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% endfor %}{{ dict(a=ns.n) | tojson }} {{ dict.fromkeys(['x'], 1) | tojson }}"
  )
  bad = "{% set ns = namespace(_hidden=1) %}{{ ns._hidden }}"
  messages = CONVERSATIONS[1]
  for name, template in (("good", good), ("bad", bad)):
    d = _with_template(checkpoint, tmp_path / name, template)
    hf = transformers.AutoTokenizer.from_pretrained(d)
    ours = CheckpointTokenizer(d)
    if name == "good":
      assert (
        ours.render(messages)
        == hf.apply_chat_template(messages, tokenize=False)
        == ('{"a": 5} {"x": 1}')
      )
    else:
      for render in (ours.render, lambda m: hf.apply_chat_template(m, tokenize=False)):
        with pytest.raises(jinja2.exceptions.SecurityError, match="underscore-prefixed"):
          render(messages)
