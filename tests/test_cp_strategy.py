"""The rule that picks a CP strategy per layer kind (cpjax plan, cpjax train's
``parallel.strategy: auto``), on the published sizes' shapes, hand-worked."""

import pytest

from cpjax.models.gemma4 import Gemma4Config
from cpjax.training.cp_strategy import as_strategy, bytes_sent, choose, describe


def strategies(model, **kw):
  return {kind: c.strategy for kind, c in choose(Gemma4Config.preset(model).text, **kw).items()}


def test_e2b_and_26b_a4b_at_131072_tokens_on_cp_8():
  """E2B: its full layers on Ulysses (8 query heads over cp = 8, its one K/V
  head repeated: a 0.75 GiB row, 896 MiB a step against the all-gather's
  897 and the ring's 961), its sliding ones on the window's halo. 26B-A4B:
  Ulysses for both kinds (full: 1344 MiB a step against the hybrid's 1473,
  the all-gather's 1793, the ring's 1921; sliding: its 8 K/V heads split
  over cp = 8, and vision groups there reach the whole row, which no halo
  holds). The bytes are benchmarks/cp_strategies.py's rows."""
  assert strategies("e2b", seq_len=131072, cp=8) == {
    "full_attention": "ulysses",
    "sliding_attention": "all_gather",
  }
  assert strategies("a4b", seq_len=131072, cp=8) == {
    "full_attention": "ulysses",
    "sliding_attention": "ulysses",
  }
  e2b = choose(Gemma4Config.preset("e2b").text, seq_len=131072, cp=8)
  why = e2b["sliding_attention"].why
  assert why.startswith("window 512: a halo of 1024 keys from 2 neighbour(s)"), why
  why = choose(Gemma4Config.preset("a4b").text, seq_len=131072, cp=8)["full_attention"].why
  assert "1344 MiB (ring 1921 MiB, all_gather 1793 MiB, hybrid 1473 MiB)" in why, why


def test_the_byte_count_is_the_benchmarks():
  """Every row of benchmarks/cp_strategies.py's committed tables (E2B's two
  kinds and 26B-A4B's full layers, S = 32768 and 131072, cp = 2, 4, 8):
  the bytes and hops the rule compares are the ones the table prints."""
  import json
  from pathlib import Path

  results = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
  rows = 0
  for name in ("cp_strategies", "cp_strategies_a4b"):
    table = json.loads((results / f"{name}.json").read_text())
    for r in table["rows"]:
      hq, hkv, d, window = table["kinds"][r["layer"]]
      shape = dict(seq_len=r["S"], cp=r["cp"], q_heads=hq, kv_heads=hkv, head_dim=d)
      sent, hops = bytes_sent(r["strategy"], **shape, window=window)
      assert (round(sent / 2**20, 3), hops) == (round(r["MiB sent"], 3), r["hops"]), r
      rows += 1
  assert rows == 116


def test_at_small_cp_the_all_gather_sends_least():
  """cp = 2 and 4: the all-gather's (cp - 1) shares are fewer bytes than
  Ulysses' all-to-alls of every query head (E2B's full layers: 512 and 769
  MiB against 1280 and 1152)."""
  for cp in (2, 4):
    assert strategies("e2b", seq_len=131072, cp=cp)["full_attention"] == "all_gather"


def test_a_row_past_an_eighth_of_device_memory_takes_the_hybrid_or_the_ring():
  """S = 2**20: no whole-row K/V fits 16 GiB / 8. 26B-A4B's full layers' 2
  K/V heads make Ulysses groups of 2 on a ring of 4 (3 hops, fewer bytes than
  the ring's 7); E2B's one K/V head makes no group: the ring. With 256 GiB
  devices 26B-A4B's Ulysses row (6 GiB) fits again."""
  a4b = choose(Gemma4Config.preset("a4b").text, seq_len=2**20, cp=8)["full_attention"]
  assert a4b.strategy == "hybrid", a4b
  assert "all_gather: its row of 12.00 GiB is over 1/8 of 16.00 GiB" in a4b.why, a4b.why
  assert "ulysses: its repeated K/V row of 6.00 GiB is over" in a4b.why, a4b.why
  assert strategies("e2b", seq_len=2**20, cp=8)["full_attention"] == "ring"
  # Its sliding layers' 8 K/V heads split over cp unrepeated: a ring chunk's
  # K/V at any length, so Ulysses stays (its 3 GiB row is not a gathered one).
  assert strategies("a4b", seq_len=2**20, cp=8)["sliding_attention"] == "ulysses"
  big = strategies("a4b", seq_len=2**20, cp=8, device_memory=256 * 2**30)
  assert big["full_attention"] == "ulysses"


def test_one_rank_is_the_ring_and_tp_divides_the_heads():
  assert set(strategies("e2b", seq_len=4096, cp=1).values()) == {"ring"}
  # E2B's 8 query heads over tp = 2: 4 a rank, which cp = 8 cannot split.
  assert strategies("e2b", seq_len=131072, cp=8, tp=2)["full_attention"] == "all_gather"


def test_the_choice_reads_as_the_run_configs_text_and_the_contexts_pairs():
  choices = choose(Gemma4Config.preset("e2b").text, seq_len=131072, cp=8)
  assert describe(choices) == "full_attention=ulysses,sliding_attention=all_gather"
  assert as_strategy(choices) == (
    ("full_attention", "ulysses"),
    ("sliding_attention", "all_gather"),
  )


@pytest.mark.parametrize("layout", ["contiguous", "load_balanced"])
def test_the_halo_follows_the_layout(layout):
  """A contiguous causal layout needs the window's keys from one neighbour."""
  why = choose(Gemma4Config.preset("e2b").text, seq_len=131072, cp=8, layout=layout)
  want = "1 neighbour" if layout == "contiguous" else "2 neighbour"
  assert want in why["sliding_attention"].why


def test_a_length_the_layout_pads_is_planned_as_padded():
  """1000 tokens on cp = 8 load-balanced rows are padded to 1008 (16 chunks)."""
  assert strategies("e2b", seq_len=1000, cp=8) == strategies("e2b", seq_len=1008, cp=8)


def test_a_shard_layout_is_planned_as_its_kind():
  """The rule reads a layout's kind alone, from a name or a whole ShardLayout;
  so does the plan's StepShape."""
  import cpjax
  from cpjax.training.plan import StepShape

  text = Gemma4Config.preset("e2b").text
  lay = cpjax.ShardLayout(131072, 131072, 8, "contiguous")
  assert choose(text, seq_len=131072, cp=8, layout=lay) == choose(
    text, seq_len=131072, cp=8, layout="contiguous"
  )
  assert StepShape(131072, {"cp": 8}, layout=lay).layout == "contiguous"
  with pytest.raises(ValueError, match="layout must be one of .* or a ShardLayout, got 'zz'"):
    StepShape(131072, {"cp": 8}, layout="zz")
