"""A checkpoint's own tokenizer and chat template, applied as transformers does.

A Hugging Face checkpoint directory holds ``tokenizer.json`` (the
`tokenizers` library's serialization), ``tokenizer_config.json`` (the
special tokens, sometimes the chat
template) and often ``chat_template.jinja``. :class:`CheckpointTokenizer`
reads them with `tokenizers` and jinja2 alone (no torch, no transformers)
and gives the token ids transformers' ``AutoTokenizer`` gives:

* :meth:`~CheckpointTokenizer.encode` is ``tokenizer(text)["input_ids"]``;
* :meth:`~CheckpointTokenizer.render` is ``apply_chat_template(messages,
  tokenize=False)``: the same sandboxed jinja2 environment (``trim_blocks``,
  ``lstrip_blocks``, ``loopcontrols``, the ``{% generation %}`` tag, the
  ``tojson`` filter, ``raise_exception``, ``strftime_now``) fed the special
  tokens by name;
* :meth:`~CheckpointTokenizer.encode_chat` is ``apply_chat_template(messages,
  tokenize=True)`` plus the answer mask: which tokens the assistant wrote.

The answer mask. A template with ``{% generation %}`` ... ``{% endgeneration
%}`` blocks says itself what the assistant writes: the answer spans are the
characters those blocks render, and the mask is transformers'
``apply_chat_template(..., return_assistant_tokens_mask=True)`` (TRL's
``assistant_only_loss`` reads the same). A template without them (Gemma 4's
has none): assistant message ``i`` owns the characters the conversation
gains from ``messages[:i]`` to ``messages[:i + 1]``, less the common prefix
with ``messages[:i]`` rendered with the generation prompt (the turn header
the model is prompted with is context, not answer); the end-of-turn marker
is part of the answer (the model learns to stop), as in TRL's and NeMo's
prompt/completion masks. Either way a token is an answer token when its
characters overlap an answer span.

Shape letters: ``T`` tokens of one document.
"""

from __future__ import annotations

import contextvars
import json
import os
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, cast

import numpy as np

__all__ = ["ANSWER_ROLE", "CheckpointTokenizer", "KNOWN_ROLES"]

# The roles a conversation may use; the assistant's turns are the answers.
ANSWER_ROLE = "assistant"
KNOWN_ROLES = ("system", "developer", "user", ANSWER_ROLE, "tool")
# A template that marks the assistant's text (any whitespace control).
_GENERATION_TAG = re.compile(r"\{%[-+]?\s*generation\s*[-+]?%\}")
# Gemma 4's video placeholder, which its processors add to the tokenizer.
VIDEO_TOKEN = "<|video|>"


def _token_text(value) -> str | None:
  """A special token as tokenizer_config.json writes it: a string or an
  AddedToken dict ``{"content": ...}``."""
  if isinstance(value, Mapping):
    value = value.get("content")
  return value if isinstance(value, str) else None


def _generation_extension():
  """The ``{% generation %}`` ... ``{% endgeneration %}`` tag, as
  transformers' chat-template environment defines it: the block renders its
  body unchanged and, while :func:`_answer_spans` tracks a rendering, records
  the characters it wrote as an answer span."""
  import jinja2
  import jinja2.ext
  import jinja2.nodes

  class Generation(jinja2.ext.Extension):
    tags = {"generation"}

    def __init__(self, environment):
      super().__init__(environment)
      # (text rendered so far as a list of blocks, spans found): set only
      # while a rendering is tracked, so plain renders ignore the tag.
      self.tracking = contextvars.ContextVar("cpjax_generation", default=None)
      environment.extend(generation_tracking=self.tracking)

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_track"), [], [], body).set_lineno(lineno)

    def _track(self, caller):
      text = caller()
      tracking = self.tracking.get()
      if tracking is not None:
        blocks, spans = tracking
        # The block's text is yielded after everything generate() has
        # yielded so far, so its start is their joined length.
        start = sum(len(b) for b in blocks)
        spans.append((start, start + len(text)))
      return text

  return Generation


def _compile(template: str):
  """The chat template in transformers' sandboxed environment."""
  import jinja2
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(
      x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )

  class TemplateDict:
    # dict() and dict.fromkeys() only: no class to reach attributes through.
    def __call__(self, *args, **kwargs):
      return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
      return dict.fromkeys(*args, **kwargs)

  class TemplateNamespace(jinja2.utils.Namespace):
    # As transformers': a namespace refuses underscore-prefixed names.
    def __init__(*args, **kwargs):
      self, args = args[0], args[1:]
      attrs = dict(*args, **kwargs)
      for name in attrs:
        TemplateNamespace._check(name)
      jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
      TemplateNamespace._check(name)
      jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
      if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
          f"Chat templates cannot store underscore-prefixed attributes on a namespace, but "
          f"got {name!r}. Please rename the attribute."
        )

  env = ImmutableSandboxedEnvironment(
    trim_blocks=True,
    lstrip_blocks=True,
    extensions=[_generation_extension(), jinja2.ext.loopcontrols],
  )
  env.filters["tojson"] = tojson
  # jinja2 leaves Environment.globals unannotated: its type is inferred from its defaults.
  cast(dict[str, Any], env.globals).update(
    raise_exception=raise_exception,
    strftime_now=lambda fmt: datetime.now().strftime(fmt),
    dict=TemplateDict(),
    namespace=TemplateNamespace,
  )
  return env.from_string(template)


def _answer_spans(compiled, **context) -> tuple[str, list[tuple[int, int]]]:
  """``(text, spans)``: the template rendered with ``context``, and the
  ``[start, end)`` characters of each ``{% generation %}`` block in it."""
  blocks, spans = [], []
  tracking = compiled.environment.generation_tracking
  token = tracking.set((blocks, spans))
  try:
    for block in compiled.generate(**context):
      blocks.append(block)
  finally:
    tracking.reset(token)
  return "".join(blocks), spans


class CheckpointTokenizer:
  """The tokenizer and chat template of a checkpoint directory.

  Args:
    path: a directory with ``tokenizer.json`` and ``tokenizer_config.json``;
      the chat template comes from ``chat_template.jinja`` if present, else
      ``tokenizer_config.json``'s ``chat_template``.

  Example:
    >>> import tempfile, json, os
    >>> from tokenizers import Tokenizer, models, pre_tokenizers
    >>> d = tempfile.mkdtemp()
    >>> tok = Tokenizer(models.WordLevel({"<bos>": 0, "hi": 1, "there": 2, "<unk>": 3}, "<unk>"))
    >>> tok.pre_tokenizer = pre_tokenizers.Whitespace()
    >>> tok.save(os.path.join(d, "tokenizer.json"))
    >>> template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    >>> with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
    ...   json.dump({"bos_token": "<bos>", "chat_template": template}, f)
    >>> t = CheckpointTokenizer(d)
    >>> t.encode("hi there")
    [1, 2]
    >>> ids, answer = t.encode_chat([{"role": "user", "content": "hi"},
    ...                              {"role": "assistant", "content": "there"}])
    >>> t.render([{"role": "user", "content": "hi"}]), ids.tolist(), answer.tolist()
    ('<bos>hi ', [0, 1, 2], [False, False, True])
  """

  def __init__(self, path: str | os.PathLike):
    from tokenizers import AddedToken, Tokenizer

    path = os.fspath(path)
    files = {
      name: os.path.join(path, name)
      for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
    }
    if not os.path.isfile(files["tokenizer.json"]):
      raise FileNotFoundError(
        f"{path} has no tokenizer.json (the checkpoint's tokenizer, in "
        f"the format of the `tokenizers` library)"
      )
    config = {}
    if os.path.isfile(files["tokenizer_config.json"]):
      with open(files["tokenizer_config.json"], encoding="utf-8") as f:
        config = json.load(f)
    self.path = path
    self.config = config
    self.backend = Tokenizer.from_file(files["tokenizer.json"])
    # Every named special token, as apply_chat_template passes them to the template.
    self.special_tokens = {
      key: text
      for key, value in config.items()
      if key.endswith("_token") and (text := _token_text(value)) is not None
    }
    # As transformers: the named special tokens are added tokens (matched whole
    # in text, never normalized); add_bos_token / add_eos_token are ignored
    # when tokenizer.json exists (its post-processor decides).
    self.backend.add_special_tokens(
      [AddedToken(t, special=True, normalized=False) for t in self.special_tokens.values()]
    )
    # Gemma 4's processors add their video placeholder as a special token
    # (tokenizer_config.json does not name it); where the vocabulary has it.
    self.video_token = self.special_tokens.get("video_token", VIDEO_TOKEN)
    if self.backend.token_to_id(self.video_token) is not None:
      self.backend.add_special_tokens(
        [AddedToken(self.video_token, special=True, normalized=False)]
      )
    template = config.get("chat_template")
    if os.path.isfile(files["chat_template.jinja"]):
      with open(files["chat_template.jinja"], encoding="utf-8") as f:
        template = f.read()
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
      template = {t["name"]: t["template"] for t in template}.get("default")
    self.chat_template = template
    self._compiled = None

  # ------------------------------------------------------------------ text
  def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """Encode ``text`` as token ids: ``tokenizer(text)["input_ids"]``.

    Args:
      text: the text.
      add_special_tokens: add the tokenizer's special tokens.

    Returns:
      The token ids.
    """
    if not isinstance(text, str):
      raise TypeError(f"text must be a str, got {type(text).__name__}")
    return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

  def token_id(self, token: str) -> int:
    """Return the id of one token of the vocabulary (a ``KeyError`` if absent).

    Args:
      token: the token.

    Returns:
      Its id.
    """
    i = self.backend.token_to_id(token)
    if i is None:
      raise KeyError(f"token {token!r} is not in the vocabulary of {self.path}")
    return i

  # ------------------------------------------------------------------ chat
  @property
  def marks_generation(self) -> bool:
    """Whether the chat template marks the assistant's text with ``{%
    generation %}`` blocks (then they are the answer spans)."""
    return self.chat_template is not None and bool(_GENERATION_TAG.search(self.chat_template))

  def _template(self):
    if self.chat_template is None:
      raise ValueError(
        f"{self.path} has no chat template (chat_template.jinja or "
        f"tokenizer_config.json's chat_template): conversations need one"
      )
    if self._compiled is None:
      self._compiled = _compile(self.chat_template)
    return self._compiled

  def _context(self, messages, add_generation_prompt: bool, template_kwargs) -> dict:
    """What apply_chat_template passes the template (its keyword arguments
    override the special tokens)."""
    return dict(
      messages=list(messages),
      tools=None,
      documents=None,
      add_generation_prompt=add_generation_prompt,
      **{**self.special_tokens, **template_kwargs},
    )

  def render(
    self,
    messages: Sequence[Mapping],
    *,
    add_generation_prompt: bool = False,
    **template_kwargs: Any,
  ) -> str:
    """Render the conversation as the chat template writes it (a string).

    Args:
      messages: the conversation, a list of ``{"role", "content"}`` dicts.
      add_generation_prompt: passed to the template.
      **template_kwargs: further template variables (they override the special
        tokens).

    Returns:
      The rendered conversation.
    """
    return self._template().render(
      **self._context(messages, add_generation_prompt, template_kwargs)
    )

  def encode_chat(
    self,
    messages: Sequence[Mapping],
    *,
    soft_tokens: Sequence[int] = (),
    audio_tokens: Sequence[int] = (),
    videos: Sequence[tuple[int, Sequence[float]]] = (),
    add_generation_prompt: bool = False,
    **template_kwargs: Any,
  ) -> tuple[np.ndarray, np.ndarray]:
    """Encode the rendered conversation's tokens and which of them the assistant wrote.

    See the module's docstring.

    Args:
      messages: the conversation, a list of ``{"role", "content"}`` dicts.
      soft_tokens: for a conversation with images, each image's soft-token
        count, in order. As Gemma 4's processor, the k-th image placeholder the
        template writes (``image_token``) becomes ``boi_token + image_token *
        soft_tokens[k] + eoi_token``; image tokens are never answer tokens.
      audio_tokens: for a conversation with audio, each clip's soft-token
        count, in order: the k-th audio placeholder (``audio_token``) becomes
        ``boa_token + audio_token * audio_tokens[k] + eoa_token``, as Gemma 4's
        processors expand it; audio tokens are never answer tokens.
      videos: for a conversation with videos, each video's (soft tokens per
        frame, its sampled frames' timestamps in seconds), in order: the k-th
        video placeholder (``<|video|>``) becomes, frame by frame, ``"mm:ss "
        + boi_token + <|video|> * n + eoi_token``, joined by spaces
        (:func:`cpjax.data.video.placeholder_text`); video tokens are never
        answer tokens.
      add_generation_prompt: passed to the template.
      **template_kwargs: further template variables, as :meth:`render`.

    Returns:
      ``(ids int32[T], answer bool[T])``: the rendered conversation's tokens
      and which of them the assistant wrote.

    Raises:
      ValueError: naming the message when a template without generation tags
        renders an earlier part of the conversation differently from the whole
        (then the answer spans cannot be read off the rendering), and when the
        rendering holds a different number of image (audio, video)
        placeholders than ``soft_tokens`` (``audio_tokens``, ``videos``).
    """
    check_messages(messages)
    if self.marks_generation:
      full, spans = _answer_spans(
        self._template(), **self._context(messages, add_generation_prompt, template_kwargs)
      )
    else:
      full = self.render(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
      spans = self._prefix_spans(messages, full, template_kwargs)
    full, spans = self._expand(full, spans, self._placeholders(soft_tokens, audio_tokens, videos))
    encoding = self.backend.encode(full, add_special_tokens=False)
    answer = np.zeros(len(encoding.ids), bool)
    for t, (lo, hi) in enumerate(encoding.offsets):
      # A token belongs to the answer when it overlaps an answer span.
      answer[t] = any(lo < end and hi > start for start, end in spans)
    ids = np.asarray(encoding.ids, np.int32)
    for key in ("image_token", "audio_token"):
      if key in self.special_tokens:
        answer &= ids != self.token_id(self.special_tokens[key])
    if videos:
      answer &= ids != self.token_id(self.video_token)
    return ids, answer

  def _placeholders(
    self, soft_tokens, audio_tokens, videos
  ) -> dict[str, tuple[str | None, list[str]]]:
    """Each kind's placeholder and, in order, the text each of its inputs becomes."""
    from cpjax.data.video import placeholder_text

    def marker(key, kind):
      if key not in self.special_tokens:
        raise ValueError(f"{self.path}'s tokenizer_config.json names no {key}: {kind} needs it")
      return self.special_tokens[key]

    def framed(kind, begin, end, counts):
      token = self.special_tokens.get(f"{kind}_token")
      if token is None or not counts:  # the template renders none: _expand says so
        return token, [""] * len(counts)
      b, e = marker(begin, kind), marker(end, kind)
      return token, [b + token * n + e for n in counts]

    out = {
      "image": framed("image", "boi_token", "eoi_token", soft_tokens),
      "audio": framed("audio", "boa_token", "eoa_token", audio_tokens),
    }
    texts = []
    if videos:
      if self.backend.token_to_id(self.video_token) is None:
        raise ValueError(f"{self.path}'s tokenizer has no video token {self.video_token!r}")
      boi, eoi = marker("boi_token", "video"), marker("eoi_token", "video")
      texts = [
        placeholder_text(times, n, boi=boi, video_token=self.video_token, eoi=eoi)
        for n, times in videos
      ]
    out["video"] = (self.video_token, texts)
    return out

  def _prefix_spans(self, messages, full: str, template_kwargs) -> list[tuple[int, int]]:
    """The answer spans in ``full`` (the whole rendering) of a template
    without generation tags: what each assistant message adds, less its
    turn header."""
    spans = []
    for i, message in enumerate(messages):
      if message["role"] != ANSWER_ROLE:
        continue
      end = self.render(messages[: i + 1], **template_kwargs)
      prompt = self.render(messages[:i], add_generation_prompt=True, **template_kwargs)
      if not full.startswith(end):
        raise ValueError(
          f"message {i}: the chat template renders the conversation up to this "
          f"assistant message differently from the whole conversation, so its "
          f"answer tokens cannot be told apart"
        )
      start = len(os.path.commonprefix([prompt, end]))
      spans.append((start, len(end)))
    return spans

  def _expand(self, text: str, spans, inputs: Mapping[str, tuple[str | None, list[str]]]):
    """The text with the k-th placeholder of each kind replaced by the k-th
    text of that kind (``inputs``: kind -> (placeholder, texts)), and the
    answer spans moved with it."""
    runs = {}  # placeholder -> its texts, in order
    for kind, (token, texts) in inputs.items():
      found = text.count(token) if token else 0
      if found != len(texts):
        raise ValueError(
          f"the conversation renders {found} {kind} placeholders ({token!r}) for "
          f"{len(texts)} {kind} inputs"
        )
      if found:
        assert token is not None  # it was found, once per input
        runs[token] = iter(texts)
    if not runs:
      return text, spans
    pieces = re.split("(" + "|".join(map(re.escape, runs)) + ")", text)
    out, shifts = [], []  # shifts: (where in the old text, added characters)
    at = 0
    for i, piece in enumerate(pieces):
      if i % 2:  # a placeholder (re.split keeps the separators at odd places)
        piece_out = next(runs[piece])
        shifts.append((at, len(piece_out) - len(piece)))
        out.append(piece_out)
      else:
        out.append(piece)
      at += len(piece)

    def moved(pos):
      return pos + sum(extra for where, extra in shifts if where < pos)

    return "".join(out), [(moved(a), moved(b)) for a, b in spans]


def check_messages(messages: object) -> None:
  """Check a conversation: a non-empty list of ``{"role", "content"}`` dicts.

  Each has a known role and string or list content (``ValueError`` /
  ``TypeError`` naming the message).

  Args:
    messages: the conversation.
  """
  if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
    raise ValueError(
      f"messages must be a non-empty list of {{'role', 'content'}} dicts, got "
      f"{type(messages).__name__}"
    )
  for i, message in enumerate(messages):
    if not isinstance(message, Mapping):
      raise TypeError(
        f"message {i} must be a dict with 'role' and 'content', got {type(message).__name__}"
      )
    role = message.get("role")
    if role not in KNOWN_ROLES:
      raise ValueError(f"message {i} has role {role!r}; expected one of {KNOWN_ROLES}")
    content = message.get("content")
    if not isinstance(content, (str, list)):
      raise TypeError(
        f"message {i} ({role}) content must be a string or a list of parts, got "
        f"{type(content).__name__}"
      )
