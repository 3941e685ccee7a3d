"""JSONL records -> corpus -> packed rows -> sharded labels: the loss counts
exactly the assistant tokens, and every bad record is reported by line."""

import json
import os

import numpy as np
import pytest

from cpjax import cli
from cpjax.data import corpus
from cpjax.data.records import BadRecord, prepare_data, read_jsonl
from cpjax.data.tokenizer import CheckpointTokenizer
from tests.data.make_chat_example import gemma_style_tokenizer, records, texts_of

GOOD = records(30, seed=3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  return gemma_style_tokenizer(str(tmp_path_factory.mktemp("tok")), texts_of(GOOD), vocab_size=400)


def write_jsonl(path, lines):
  with open(path, "w") as f:
    for line in lines:
      f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
  return str(path)


def answer_tokens_by_hand(tok, record):
  """Target tokens of one record re-derived without the answer mask: a text
  counts every token after the first; a conversation, the tokens of each
  assistant turn ('content<turn|>\\n' after '<|turn>model\\n')."""
  if "text" in record:
    return len(tok.encode(record["text"])) - 1
  n = 0
  for m in record["messages"]:
    if m["role"] == "assistant":
      n += len(tok.encode(m["content"].strip() + "<turn|>\n", add_special_tokens=False))
  return n


def test_loss_counts_exactly_the_assistant_tokens_through_packing_and_sharding(
  checkpoint, tmp_path
):
  import cpjax
  from tests.helpers import cp_mesh

  tok = CheckpointTokenizer(checkpoint)
  source = write_jsonl(tmp_path / "in.jsonl", GOOD)
  summary = prepare_data(
    source, tmp_path / "corpus", checkpoint=checkpoint, seq_len=128, progress=False
  )
  expected = sum(answer_tokens_by_hand(tok, r) for r in GOOD)
  assert (summary.documents, summary.dropped, summary.target_tokens) == (30, [], expected)
  rows = list(
    corpus.packed_rows(
      str(tmp_path / "corpus"),
      seq_len=128,
      shuffle=False,
      num_epochs=1,
      process_index=0,
      process_count=1,
    )
  )
  batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
  assert int(np.sum(batch["labels"] != -100)) == expected
  # Each document of the packed rows is one record's tokens (first-fit packing
  # reorders them); its labels are the next tokens exactly where the record's
  # answer mask holds them.
  masks = {}
  for record in GOOD:
    if "text" in record:
      ids = np.asarray(tok.encode(record["text"]))
      masks[tuple(ids.tolist())] = np.ones(ids.size, bool)
    else:
      ids, answer = tok.encode_chat(record["messages"])
      masks[tuple(ids.tolist())] = answer
  seen = []
  for r in range(len(rows)):
    for d in np.unique(batch["_packed_seq_ids"][r]):
      if d == 0:
        continue
      at = np.flatnonzero(batch["_packed_seq_ids"][r] == d)
      ids = batch["input_ids"][r, at]
      mask = masks[tuple(ids.tolist())]
      np.testing.assert_array_equal(batch["labels"][r, at[:-1]], np.where(mask[1:], ids[1:], -100))
      assert batch["labels"][r, at[-1]] == -100
      seen.append(tuple(ids.tolist()))
  assert sorted(seen) == sorted(masks) and len(seen) == 30
  # Through CP sharding, both layouts: every rank's labels together are the row's.
  mesh = cp_mesh(4)
  for layout in ("contiguous", "load_balanced"):
    sharded, lay = cpjax.shard_batch(batch, mesh, layout=layout)
    assert int(np.sum(np.asarray(sharded["labels"]) != -100)) == expected
    back = cpjax.unshard_batch(sharded, lay)
    np.testing.assert_array_equal(np.asarray(back["labels"]), batch["labels"])


def test_a_template_with_generation_tags_keeps_every_conversation(tmp_path):
  """prepare-data on a checkpoint whose template marks the assistant's text
  with {% generation %} (here its content alone, not the end of turn):
  nothing is dropped and the loss counts exactly the tagged tokens; a
  conversation the blocks skip is reported, not trained on."""
  from tests.test_tokenizer import TAGGED_TEMPLATES

  d = gemma_style_tokenizer(
    str(tmp_path / "tok"), texts_of(GOOD), vocab_size=400, template=TAGGED_TEMPLATES["content_only"]
  )
  tok = CheckpointTokenizer(d)
  by_hand = sum(
    len(tok.encode(r["text"])) - 1
    if "text" in r
    else sum(
      len(tok.encode(m["content"].strip(), add_special_tokens=False))
      for m in r["messages"]
      if m["role"] == "assistant"
    )
    for r in GOOD
  )
  lines = GOOD + [
    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "   "}]}
  ]  # an empty block
  summary = prepare_data(
    write_jsonl(tmp_path / "in.jsonl", lines),
    tmp_path / "corpus",
    checkpoint=d,
    seq_len=128,
    progress=False,
  )
  assert (summary.documents, summary.target_tokens) == (len(GOOD), by_hand)
  ((line, reason),) = summary.dropped
  assert line == len(GOOD) + 1 and "{% generation %} blocks cover none of its tokens" in reason


def test_bad_records_are_dropped_and_reported_by_line(checkpoint, tmp_path):
  long_text = {"text": " ".join(["plus"] * 200)}
  lines = [
    GOOD[0],  # 1 ok
    {
      "messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]
    },  # 2 unknown role
    "{not json",  # 3
    long_text,  # 4 too long
    {"text": "ok", "images": ["a.png"]},  # 5 unknown key
    {"messages": [{"role": "user", "content": "only a question"}]},  # 6 no answer
    {"text": ""},  # 7 empty
    {
      "messages": [
        {"role": "user", "content": [{"type": "pdf", "pdf": "paper.pdf"}]},
        {"role": "assistant", "content": "x"},
      ]
    },  # 8 bad part
    {"text": "ok", "messages": []},  # 9 both
    "",  # 10 blank: skipped
    {"id": 7, "metadata": {"src": "x"}, **GOOD[1]},
  ]  # 11 ok
  source = write_jsonl(tmp_path / "in.jsonl", lines)
  summary = prepare_data(
    source, tmp_path / "out", checkpoint=checkpoint, seq_len=64, progress=False
  )
  assert summary.documents == 2 and summary.truncated == 0
  reasons = dict(summary.dropped)
  assert sorted(reasons) == [2, 3, 4, 5, 6, 7, 8, 9]
  assert "message 1 has role 'robot'" in reasons[2]
  assert reasons[3].startswith("not JSON")
  n_long = len(CheckpointTokenizer(checkpoint).encode(long_text["text"]))
  assert reasons[4] == f"{n_long} tokens, longer than the row of 64 (truncation keeps its first 64)"
  assert "unknown key(s) ['images']" in reasons[5]
  assert "no 'assistant' message" in reasons[6]
  assert "'text' must be a non-empty string" in reasons[7]
  assert "message 0 part 0: expected {'type': 'text'" in reasons[8]
  assert "exactly one of 'text'" in reasons[9]
  with open(tmp_path / "out" / "summary.json") as f:
    written = json.load(f)
  assert written["dropped"][0] == {"line": 2, "reason": reasons[2]}
  assert written["documents"] == 2 and written["seq_len"] == 64
  # truncation keeps the long one's first 64 tokens, and says so
  cut = prepare_data(
    source, tmp_path / "cut", checkpoint=checkpoint, seq_len=64, truncate=True, progress=False
  )
  assert (cut.documents, cut.truncated, len(cut.dropped)) == (3, 1, 7)
  # strict: the first bad record is an error naming its line
  with pytest.raises(BadRecord, match=r"in.jsonl line 2: message 1 has role 'robot'"):
    list(read_jsonl(source, CheckpointTokenizer(checkpoint), strict=True))
  nothing = write_jsonl(tmp_path / "bad.jsonl", ["{", {"text": ""}])
  with pytest.raises(ValueError, match=r"gave no document:\n  line 1: not JSON"):
    prepare_data(nothing, tmp_path / "none", checkpoint=checkpoint, progress=False)


def test_prepare_data_command(checkpoint, tmp_path, capsys):
  source = write_jsonl(tmp_path / "in.jsonl", GOOD[:5] + [{"text": ""}])
  assert (
    cli.main(
      [
        "prepare-data",
        source,
        str(tmp_path / "out"),
        "--checkpoint",
        checkpoint,
        "--seq-len",
        "128",
      ]
    )
    == 0
  )
  out = capsys.readouterr().out
  assert "5 documents" in out and "1 dropped" in out and "line 6: 'text' must be" in out
  assert os.path.isfile(tmp_path / "out" / "documents.array_record")
  for args, message in [
    (["--truncate"], "--truncate needs --seq-len"),
    (["--checkpoint", str(tmp_path)], "has no tokenizer.json"),
  ]:
    argv = ["prepare-data", source, str(tmp_path / "o2"), "--checkpoint", checkpoint, *args]
    with pytest.raises(SystemExit) as e:
      cli.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
