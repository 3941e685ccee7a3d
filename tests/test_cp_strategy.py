"""The rule that picks a CP strategy per layer kind (cpjax plan, cpjax train's
``parallel.strategy: auto``), on the published sizes' shapes, hand-worked."""

import pytest

from cpjax.models.gemma4 import Gemma4Config
from cpjax.training.cp_strategy import as_strategy, choose, describe


def strategies(model, **kw):
  return {kind: c.strategy for kind, c in choose(Gemma4Config.preset(model).text, **kw).items()}


def test_e2b_and_26b_a4b_at_131072_tokens_on_cp_8():
  """E2B: both kinds all-gathered (one K/V head: 0.75 GiB a full row; the
  sliding window's halo). 26B-A4B: its full layers' 2 K/V heads all-gathered
  (1.5 GiB), its sliding layers on Ulysses: 8 K/V heads split over cp = 8,
  and vision groups there reach the whole row, which no halo holds."""
  assert strategies("e2b", seq_len=131072, cp=8) == {
    "full_attention": "all_gather",
    "sliding_attention": "all_gather",
  }
  assert strategies("a4b", seq_len=131072, cp=8) == {
    "full_attention": "all_gather",
    "sliding_attention": "ulysses",
  }
  why = choose(Gemma4Config.preset("e2b").text, seq_len=131072, cp=8)["sliding_attention"].why
  assert why.startswith("window 512: a halo of 1024 keys from 2 neighbour(s)"), why


def test_a_row_past_an_eighth_of_device_memory_takes_the_hybrid_or_the_ring():
  """26B-A4B's full layers at S = 262144: 12 bytes x S x 2 heads x 512 = 3 GiB
  gathered, over 16 GiB / 8, and their 2 K/V heads make Ulysses groups of 2
  on a ring of 4 (3 hops); with 32 GiB devices the row fits again. E2B's
  one K/V head at S = 2**21 (a 12 GiB row) shares no factor with cp: the
  ring."""
  a4b = choose(Gemma4Config.preset("a4b").text, seq_len=262144, cp=8)["full_attention"]
  assert a4b.strategy == "hybrid"
  assert "groups of 2 ranks, the ring over 4 groups (3 hops, not 7)" in a4b.why, a4b.why
  assert (
    strategies("a4b", seq_len=262144, cp=8, device_memory=32 * 2**30)["full_attention"]
    == "all_gather"
  )
  assert strategies("e2b", seq_len=2**21, cp=8)["full_attention"] == "ring"
  # At cp = 2 the 2 K/V heads split whole: Ulysses (rule 2) comes first.
  assert strategies("a4b", seq_len=2**20, cp=2)["full_attention"] == "ulysses"


def test_one_rank_is_the_ring_and_tp_divides_the_heads():
  assert set(strategies("e2b", seq_len=4096, cp=1).values()) == {"ring"}
  # 26B-A4B's 16 query and 8 sliding K/V heads: tp = 2 leaves 4 K/V heads,
  # which cp = 8 cannot split: the all-gather takes them.
  assert strategies("a4b", seq_len=131072, cp=8, tp=2)["sliding_attention"] == "all_gather"


def test_the_choice_reads_as_the_run_configs_text_and_the_contexts_pairs():
  choices = choose(Gemma4Config.preset("a4b").text, seq_len=131072, cp=8)
  assert describe(choices) == "full_attention=all_gather,sliding_attention=ulysses"
  assert as_strategy(choices) == (
    ("full_attention", "all_gather"),
    ("sliding_attention", "ulysses"),
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
