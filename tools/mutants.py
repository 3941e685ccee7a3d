"""A mutation check that stays: one-line mutants of the core functions, each
with the tests that must fail when it is applied.

``make mutants`` (part of ``make soak``, not CI) copies the tracked tree to a
scratch folder per mutant, applies the mutant there, runs its tests, and
reports every mutant that survives (its tests still pass). Exit status 1 if
any survives, or if a mutant's text no longer occurs exactly once in its
file (the list must follow the code).

    python tools/mutants.py [--only NAME ...] [--list]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Mutant:
  name: str
  file: str  # relative to the repository root
  old: str  # occurs exactly once in ``file``
  new: str
  tests: tuple[str, ...]  # pytest node ids / paths that must fail


TILES = "tests/test_tile_schedule.py"

MUTANTS = (
  # --- bfloat16 as transformers rounds it
  Mutant(
    "gemma4: the router's 1/sqrt(D) rounded to bfloat16 before it multiplies",
    "cpjax/models/gemma4/text.py",
    "    z = scaled(z * self.scale[...].astype(r.dtype), self.root)",
    "    z = z * self.scale[...].astype(r.dtype) * jnp.asarray(self.root, r.dtype)",
    (
      "tests/test_gemma4_transformers.py::"
      "test_bfloat16_router_scales_its_input_as_transformers_does",
    ),
  ),
  # --- the suite's own speed: an eager call is one program
  Mutant(
    "context_parallel_attention: its program made again at each call",
    "cpjax/attention/global_attention.py",
    "@functools.lru_cache(maxsize=64)\n",
    "",
    ("tests/test_context_parallel.py::test_an_eager_call_is_one_program_made_once",),
  ),
  Mutant(
    "context_parallel_attention: its shard_map run op by op, not jitted",
    "cpjax/attention/global_attention.py",
    "  @functools.partial(jax.jit, out_shardings=jax.NamedSharding(mesh, x_spec))\n",
    "",
    ("tests/test_context_parallel.py::test_an_eager_call_is_one_program_made_once",),
  ),
  Mutant(
    "apply_lora: qwix's creation pass run eagerly, op by op",
    "cpjax/training/lora/adapters.py",
    "        adapted = _compiled_creation_pass(model, key, args, kwargs)\n",
    "        adapted = _creation_pass(model, key, args, kwargs)\n",
    ("tests/test_lora.py::test_the_creation_pass_is_one_cached_program_equal_to_qwixs_eager_pass",),
  ),
  Mutant(
    "apply_lora: the compiled creation pass copies the base it kept",
    "cpjax/training/lora/adapters.py",
    "  sources = tuple(index.get(id(x)) for x in leaves)",
    "  sources = tuple(None for x in leaves)",
    ("tests/test_lora.py::test_the_creation_pass_is_one_cached_program_equal_to_qwixs_eager_pass",),
  ),
  Mutant(
    "apply_lora: the compiled pass drops the unused base: the adapters on one device",
    "cpjax/training/lora/adapters.py",
    "@jax.jit(static_argnums=(0, 2, 4), keep_unused=True)",
    "@jax.jit(static_argnums=(0, 2, 4))",
    ("tests/test_lora.py::test_adapters_made_on_a_mesh_equal_those_made_on_one_device",),
  ),
  # --- cost estimates, the step-time plan and the ring's overlap (issue 61)
  Mutant(
    "kernel cost: the dk/dv kernel's recompute left out",
    "cpjax/attention/ring/kernels/_cost.py",
    'FLOPS_PER_PAIR = {"forward": 4, "dq": 6, "dkdv": 8}',
    'FLOPS_PER_PAIR = {"forward": 4, "dq": 6, "dkdv": 6}',
    (
      "tests/test_kernel_cost.py::test_one_calls_estimate_by_hand",
      "tests/test_kernel_cost.py::test_the_compiled_rings_flops_are_the_kernels_blocks_on_the_tpu",
    ),
  ),
  Mutant(
    "kernel cost: the ring's own chunk not counted among a rank's calls",
    "cpjax/attention/ring/_passes.py",
    "hops + 1 if back == 0 else 2 * hops + 2",
    "hops if back == 0 else 2 * hops + 2",
    ("tests/test_kernel_cost.py::test_the_compiled_rings_flops_are_the_kernels_blocks_on_the_tpu",),
  ),
  Mutant(
    "program reader: a loop's body counted once",
    "cpjax/training/hlo.py",
    'visit(callee, times * (trips if role == "body" else 1))',
    "visit(callee, times)",
    (
      "tests/test_step_time.py::test_the_program_reader_counts_each_loop_its_trips",
      "tests/test_kernel_cost.py::test_the_compiled_rings_flops_are_the_kernels_blocks_on_the_tpu",
    ),
  ),
  Mutant(
    "step time: exposed collectives not added",
    "cpjax/training/step_time.py",
    "    max(compute, memory) + exposed,",
    "    max(compute, memory),",
    ("tests/test_step_time.py::test_the_step_time_by_hand",),
  ),
  Mutant(
    "ring: a hop sends its K/V only after its kernel (no overlap)",
    "cpjax/attention/ring/_passes.py",
    "      return attend(stats, *here, (rank - h) % cp), nxt",
    "      stats = attend(stats, *here, (rank - h) % cp)\n"
    "      return stats, _shift(lax.optimization_barrier((here, stats))[0], cfg, +1)",
    ("tests/test_step_time.py::test_each_ring_hop_sends_while_its_kernel_runs",),
  ),
  # --- the window's halo and Ulysses (issue 46)
  Mutant(
    "halo: one key block short of the window's reach",
    "cpjax/attention/ring/_schedule.py",
    '      hi = np.searchsorted(queries, keys + behind, side="right")',
    '      hi = np.searchsorted(queries, keys + behind - block_kv, side="right")',
    ("tests/test_all_gather.py::test_a_window_gathers_only_its_halo",),
  ),
  Mutant(
    "halo: its gradient stays with the receiver",
    "cpjax/attention/ring/_passes.py",
    "    back = _shift(grad[:, :, start : start + h.length], cfg, -h.offset)",
    "    back = grad[:, :, start : start + h.length]",
    ("tests/test_all_gather.py::test_a_window_gathers_only_its_halo",),
  ),
  Mutant(
    "ulysses: K/V heads tiled, not repeated (query heads on the wrong K/V head)",
    "cpjax/attention/ring/_attention.py",
    "    k = jnp.repeat(k, repeats, axis=2)",
    "    k = jnp.tile(k, (1, 1, repeats, 1))",
    ("tests/test_ulysses.py::test_ulysses_keeps_each_query_head_on_its_kv_head",),
  ),
  Mutant(
    "ulysses: the output comes home in the wrong head order",
    "cpjax/attention/ring/_attention.py",
    "  return lax.all_to_all(\n    x, axis_name, split_axis=1, concat_axis=2, tiled=True, "
    "axis_index_groups=groups\n  )",
    "  return jnp.flip(lax.all_to_all(\n    x, axis_name, split_axis=1, concat_axis=2, tiled=True, "
    "axis_index_groups=groups\n  ), 2)",
    ("tests/test_ulysses.py::test_the_head_split_strategies_equal_the_reference",),
  ),
  Mutant(
    "hybrid: the serpentine's odd passes keep the ranks' order (tokens at the wrong places)",
    "cpjax/attention/ring/_attention.py",
    "  y = jnp.concatenate([y[:, :, :1], jnp.flip(y[:, :, 1:], axis=3)], axis=2)",
    "  y = jnp.concatenate([y[:, :, :1], y[:, :, 1:]], axis=2)",
    ("tests/test_ulysses.py::test_the_head_split_strategies_equal_the_reference",),
  ),
  Mutant(
    "hybrid: a hop goes to the next rank, not to the peer in the next group",
    "cpjax/attention/ring/_passes.py",
    "  perm = [(i, (i + offset * size) % (cp * size)) for i in range(cp * size)]",
    "  perm = [(i, (i + offset) % (cp * size)) for i in range(cp * size)]",
    ("tests/test_ulysses.py::test_the_head_split_strategies_equal_the_reference",),
  ),
  Mutant(
    "hybrid: the ring position is the rank's, not its group's",
    "cpjax/attention/ring/_passes.py",
    "  return lax.axis_index(cfg.axis_name) // cfg.ulysses_size",
    "  return lax.axis_index(cfg.axis_name) % cfg.layout.cp_size",
    ("tests/test_ulysses.py::test_the_head_split_strategies_equal_the_reference",),
  ),
  Mutant(
    "hybrid: Ulysses groups take K/V heads they must repeat",
    "cpjax/attention/ring/_attention.py",
    "  size = max(u for u in range(1, cp_size + 1) if cp_size % u == 0 and kv_heads % u == 0)",
    "  size = max(u for u in range(1, cp_size + 1) if cp_size % u == 0 and q_heads % u == 0)",
    ("tests/test_hybrid.py::test_hybrid_takes_the_largest_ulysses_group_the_kv_heads_allow",),
  ),
  Mutant(
    "cp strategy rule: the most bytes, not the fewest",
    "cpjax/training/cp_strategy.py",
    "    best = min(sent, key=sent.get)",
    "    best = max(sent, key=sent.get)",
    ("tests/test_cp_strategy.py::test_e2b_and_26b_a4b_at_131072_tokens_on_cp_8",),
  ),
  Mutant(
    "cp strategy bytes: the hybrid's hops carry one rank's mask ids, not the group's",
    "cpjax/training/cp_strategy.py",
    "    sent, hops = ring(cp // size, size * ids)",
    "    sent, hops = ring(cp // size, ids)",
    ("tests/test_cp_strategy.py::test_the_byte_count_is_the_benchmarks",),
  ),
  Mutant(
    "cp strategy rule: Ulysses' unrepeated K/V heads judged as a gathered row",
    "cpjax/training/cp_strategy.py",
    "    return 0 if repeats == 1 else seq_len * per_token * hkv * repeats // cp",
    "    return seq_len * per_token * hkv * repeats // cp",
    (
      "tests/test_cp_strategy.py::"
      "test_a_row_past_an_eighth_of_device_memory_takes_the_hybrid_or_the_ring",
    ),
  ),
  Mutant(
    "target search: compiles smaller slices the measured ratio puts past the memory",
    "cpjax/training/plan/search.py",
    "      <= SMALLER_SLICE_SLACK * memory",
    "      <= 100 * memory",
    (
      "tests/test_plan.py::"
      "test_the_target_search_compiles_down_while_it_fits_and_up_until_one_fits",
    ),
  ),
  Mutant(
    "target search: stops at the first slice that fits, however large",
    "cpjax/training/plan/search.py",
    "  if compiled(i).fits(memory):\n    while (\n      i > 0",
    "  if compiled(i).fits(memory):\n    while (\n      i < 0",
    (
      "tests/test_plan.py::"
      "test_the_target_search_compiles_down_while_it_fits_and_up_until_one_fits",
    ),
  ),
  Mutant(
    "targets: libtpu takes the chips' lock on a host without TPUs",
    "cpjax/training/targets.py",
    "          os.environ.setdefault(key, value)",
    "          pass",
    (
      "tests/test_targets.py::"
      "test_two_processes_compile_for_tpus_at_once_without_libtpu_start_up_noise",
    ),
  ),
  Mutant(
    "unified model: image groups seen only by the sliding layers",
    "cpjax/models/gemma4/model.py",
    "      FULL: LocalWindow(None, 0) | SameVisionGroup(),",
    "      FULL: LocalWindow(None, 0),",
    ("tests/test_gemma4_unified.py::test_logits_equal_transformers_on_one_device",),
  ),
  Mutant(
    "unified model: a patch's row looked up in the column's table",
    "cpjax/models/gemma4/embedders.py",
    "      for a in (0, 1)",
    "      for a in (0, 0)",
    ("tests/test_gemma4_unified.py::test_logits_equal_transformers_on_one_device",),
  ),
  Mutant(
    "unified model: padded audio frames taken for soft tokens",
    "cpjax/models/gemma4/model.py",
    "    source = _slot_sources(real.reshape(a * t), slot)",
    "    source = _slot_sources(jnp.ones((a * t,), bool), slot)",
    ("tests/test_gemma4_unified.py::test_logits_equal_transformers_on_one_device",),
  ),
  Mutant(
    "audio tower: the relative position bias not shifted to each query",
    "cpjax/models/gemma4/audio.py",
    "    bias = jnp.pad(bias, ((0, 0),) * 4 + ((0, w + 1 - rel.shape[0]),))",
    "    bias = jnp.pad(bias, ((0, 0),) * 4 + ((0, w - rel.shape[0]),))",
    ("tests/test_gemma4_audio.py::test_logits_equal_transformers_on_one_device",),
  ),
  Mutant(
    "audio tower: padding frames read as keys",
    "cpjax/models/gemma4/audio.py",
    "  return real_key[:, :, None, :] & window[None, None]",
    "  return (real_key[:, :, None, :] | True) & window[None, None]",
    ("tests/test_gemma4_audio.py::test_logits_equal_transformers_on_one_device",),
  ),
  Mutant(
    "audio tower: under CP each rank's clips placed as if they were all",
    "cpjax/models/gemma4/model.py",
    "  return jax.tree.map(lambda y: gather(y)[:n], out)",
    "  return jax.tree.map(lambda y: jnp.concatenate([y] * cp.layout.cp_size)[:n], out)",
    ("tests/test_gemma4_audio.py::test_cp_logits_equal_transformers[cp2]",),
  ),
  Mutant(
    "audio tower: a split clip's ranks read zeros for their neighbours' frames",
    "cpjax/models/gemma4/audio.py",
    "    return jax.lax.ppermute(x[:, x.shape[1] - n :], self.axis_name, pairs)",
    "    return jnp.zeros_like(x[:, x.shape[1] - n :])",
    (
      "tests/test_gemma4_audio.py::test_cp_logits_equal_transformers[cp4-load_balanced]",
      "tests/test_gemma4_audio.py::test_the_loss_gradient_reaches_the_audio_tower_under_cp",
    ),
  ),
  Mutant(
    "audio tower: a split clip's runs shorter than the halos they must hand on",
    "cpjax/models/gemma4/audio.py",
    "    return 4 * c * max(1, -(-halo // c))",
    "    return 4 * c",
    (
      "tests/test_gemma4_audio.py::"
      "test_a_split_clip_is_the_whole_clip_with_halos_longer_than_a_block",
    ),
  ),
  Mutant(
    "audio tower: a split clip's last block reads zeros for the next rank's frames",
    "cpjax/models/gemma4/audio.py",
    "    return jax.lax.ppermute(x[:, :n], self.axis_name, pairs)",
    "    return jnp.zeros_like(x[:, :n])",
    ("tests/test_gemma4_audio.py::test_cp_logits_equal_transformers[cp4-load_balanced]",),
  ),
  # --- video frames through the vision tower (issue 64, item 3)
  Mutant(
    "video: the frames' soft tokens taken from the images",
    "cpjax/models/gemma4/model.py",
    '      x = self._place_vision(x, video_slot, batch, cp, "video")',
    '      x = self._place_vision(x, video_slot, batch, cp, "image")',
    ("tests/test_gemma4_video.py::test_logits_with_video_equal_transformers[dense]",),
  ),
  Mutant(
    "video: a data shard numbers its video tokens from the images' offsets",
    "cpjax/models/gemma4/model.py",
    "      else slots(ids == cfg.video_token_id, VIDEO_OFFSET_KEY),",
    "      else slots(ids == cfg.video_token_id, IMAGE_OFFSET_KEY),",
    ("tests/test_gemma4_video.py::test_logits_with_video_equal_transformers[dense]",),
  ),
  # --- video in chat JSONL, records and packing (issue 64, item 3)
  Mutant(
    "video resize: negative weights rounded toward +inf, not away from zero",
    "cpjax/data/resample.py",
    "  fixed = np.trunc(np.where(scaled < 0, scaled - 0.5, scaled + 0.5))",
    "  fixed = np.trunc(scaled + 0.5)",
    ("tests/test_video_records.py::test_frames_resize_as_torch_does",),
  ),
  Mutant(
    "video resize: fewer fraction bits than torch's weights keep",
    "cpjax/data/resample.py",
    "_MAX_PRECISION = 22",
    "_MAX_PRECISION = 12",
    ("tests/test_video_records.py::test_frames_resize_as_torch_does",),
  ),
  Mutant(
    "video records: frames sampled from first to last, not at i * total // num_frames",
    "cpjax/data/video.py",
    "    indices = np.arange(num_frames, dtype=np.int64) * total // num_frames",
    "    indices = np.linspace(0, total - 1, num_frames).astype(np.int64)",
    ("tests/test_video_records.py::test_conversation_with_videos_equals_gemma4_processor",),
  ),
  Mutant(
    "video records: a video's frames not separated by spaces in the text",
    "cpjax/data/video.py",
    '  return " ".join(',
    '  return "".join(',
    ("tests/test_video_records.py::test_conversation_with_videos_equals_gemma4_processor",),
  ),
  Mutant(
    "video records: video tokens count in the loss of an answer",
    "cpjax/data/tokenizer.py",
    "      answer &= ids != self.token_id(self.video_token)",
    "      pass",
    ("tests/test_video_records.py::test_videos_ride_with_their_documents_through_packing",),
  ),
  Mutant(
    "video packing: video tokens marked as image tokens in mm_token_type_ids",
    "cpjax/data/corpus.py",
    '      out["mm_token_type_ids"] = np.where(ids == self.video["video_token_id"], 2, types)',
    '      out["mm_token_type_ids"] = np.where(ids == self.video["video_token_id"], 1, types)',
    ("tests/test_video_records.py::test_videos_ride_with_their_documents_through_packing",),
  ),
  Mutant(
    "video packing: a row's frames put in its slots in reverse order",
    "cpjax/data/corpus.py",
    '      pixels[i, :n] = pixel_values(row["video_patches"][start : start + n])',
    '      pixels[slots - 1 - i, :n] = pixel_values(row["video_patches"][start : start + n])',
    ("tests/test_video_records.py::test_videos_ride_with_their_documents_through_packing",),
  ),
  Mutant(
    "12B images: pixels rescaled as the other processors' (float64, cast)",
    "cpjax/data/images.py",
    "      return np.asarray(patches).astype(np.float32) * np.float32(1 / 255)",
    "      return pixel_values(patches)",
    ("tests/test_video_records.py::test_conversation_with_videos_equals_gemma4_processor",),
  ),
  Mutant(
    "12B images and frames: patches not merged",
    "cpjax/data/images.py",
    "    return self.patch_size * (self.pooling_kernel_size if self.unified else 1)",
    "    return self.patch_size",
    ("tests/test_video_records.py::test_conversation_with_videos_equals_gemma4_processor",),
  ),
  Mutant(
    "12B images: resized with PIL's bicubic, not torchvision's",
    "cpjax/data/images.py",
    "    if self.unified:  # torchvision's resize",
    "    if False:  # torchvision's resize",
    ("tests/test_video_records.py::test_conversation_with_videos_equals_gemma4_processor",),
  ),
  # --- audio in chat JSONL, records and packing (issue 64, item 3)
  Mutant(
    "audio records: a clip's placeholder expanded to one token per feature frame",
    "cpjax/data/records.py",
    "    soft.append(audio.soft_tokens(r))",
    "    soft.append(int(r.sum()))",
    ("tests/test_audio_records.py::test_conversation_with_audio_equals_gemma4_processor",),
  ),
  Mutant(
    "audio records: the log-mel soft tokens counted from every other frame once",
    "cpjax/data/audio.py",
    'return int(real[::2][::2].sum() if self.kind == "log_mel" else real.sum())',
    'return int(real[::2].sum() if self.kind == "log_mel" else real.sum())',
    ("tests/test_audio_records.py::test_conversation_with_audio_equals_gemma4_processor",),
  ),
  Mutant(
    "audio records: audio tokens count in the loss",
    "cpjax/data/tokenizer.py",
    '    for key in ("image_token", "audio_token"):',
    '    for key in ("image_token",):',
    ("tests/test_audio_records.py::test_conversation_with_audio_equals_gemma4_processor",),
  ),
  Mutant(
    "audio records: placeholders expanded without the begin / end of audio markers",
    "cpjax/data/tokenizer.py",
    "      return token, [b + token * n + e for n in counts]",
    "      return token, [token * n for n in counts]",
    ("tests/test_audio_records.py::test_conversation_with_audio_equals_gemma4_processor",),
  ),
  Mutant(
    "audio packing: a row's clips put in its slots in reverse order",
    "cpjax/data/corpus.py",
    '      features[i, :n] = row["audio_features"][start : start + n]',
    '      features[slots - 1 - i, :n] = row["audio_features"][start : start + n]',
    ("tests/test_audio_records.py::test_clips_ride_with_their_documents_through_packing",),
  ),
  Mutant(
    "audio packing: audio tokens not marked in mm_token_type_ids",
    "cpjax/data/corpus.py",
    '      out["mm_token_type_ids"] = np.where(ids == self.audio["audio_token_id"], 3, types)',
    '      out["mm_token_type_ids"] = types',
    ("tests/test_audio_records.py::test_clips_ride_with_their_documents_through_packing",),
  ),
  Mutant(
    "audio records: a document with audio truncated to the row",
    "cpjax/data/records.py",
    "        if cut and media:",
    "        if cut and media and not truncate:",
    ("tests/test_audio_records.py::test_bad_clips_are_dropped_and_reported_by_line",),
  ),
  Mutant(
    "audio batch: the placeholders counted against the frames, not the soft tokens",
    "cpjax/models/gemma4/cp_batch.py",
    "  soft = real[:, ::2][:, ::2] if tower else real",
    "  soft = real[:, ::2] if tower else real",
    ("tests/test_gemma4_audio.py::test_logits_equal_transformers_on_one_device",),
  ),
  Mutant(
    "cli: a cluster's processes each take the whole mesh's devices",
    "cpjax/cli/train.py",
    '    machine.use_cpu_devices(devices_needed // num_processes, collectives="gloo")',
    '    machine.use_cpu_devices(devices_needed, collectives="gloo")',
    ("tests/test_multiprocess.py::test_the_multi_host_guides_two_local_processes_train_as_one",),
  ),
  Mutant(
    "token_ranks: the layout's rank order read backwards",
    "cpjax/batch/sharding.py",
    "    source = np.broadcast_to(rank_order(layout), (rows, padded))",
    "    source = np.broadcast_to(np.argsort(rank_order(layout)), (rows, padded))",
    ("tests/test_sharding.py::test_token_ranks_are_the_chunks_each_rank_owns",),
  ),
  Mutant(
    "targets: a v5e-8 split over hosts of 4 chips",
    "cpjax/training/targets.py",
    "    if self.num_devices <= self.chip.single_host:",
    "    if self.num_devices < self.chip.single_host:",
    ("tests/test_targets.py::test_a_slice_is_the_hosts_cloud_tpu_rents",),
  ),
  Mutant(
    "plan: a compile refused past the chip's memory is a traceback",
    "cpjax/training/plan/compiled.py",
    "    refusal = _hbm_refusal(str(e))",
    "    refusal = None",
    (
      "tests/test_plan.py::"
      "test_a_compile_refused_past_the_chips_memory_is_a_plan_that_does_not_fit",
    ),
  ),
  Mutant(
    "plan: a refused compile's lower bound judged as a fit",
    "cpjax/training/plan/shape.py",
    "    return not self.refused and self.total <= device_memory",
    "    return self.total <= device_memory",
    (
      "tests/test_plan.py::"
      "test_a_compile_refused_past_the_chips_memory_is_a_plan_that_does_not_fit",
    ),
  ),
  Mutant(
    "plan: the closed form leaves out the strategies' whole-row K/V",
    "cpjax/training/plan/closed_form.py",
    "  ring += rows * _row_buffers(t, strategy, seq_len=seq_len, cp=cp, tp=tp, itemsize=a)",
    "  ring += 0",
    ("tests/test_plan.py::test_the_closed_form_adds_the_strategies_whole_row_buffers",),
  ),
  Mutant(
    "plan: the closed form's loss keeps the ring's tokens under the loss's all-gather",
    "cpjax/training/plan/closed_form.py",
    '    if loss_strategy == "all_gather" or (',
    '    if loss_strategy == "never" or (',
    ("tests/test_plan.py::test_the_closed_form_adds_the_strategies_whole_row_buffers",),
  ),
  Mutant(
    "loss all_gather: the vocabulary blocks' statistics not combined over cp",
    "cpjax/training/loss.py",
    "    axes = (s.vocab_axis, *axes)",
    "    axes = axes",
    ("tests/test_loss.py::test_the_losss_all_gather_over_cp_equals_the_dense_loss",),
  ),
  Mutant(
    "loss all_gather: every rank takes the first rank's hidden-state gradient",
    "cpjax/training/loss.py",
    "    dh = jax.lax.psum_scatter(dh, s.vocab_axis, scatter_dimension=1, tiled=True)",
    "    dh = jax.lax.psum(dh, s.vocab_axis)[:, : rows[1]]",
    ("tests/test_loss.py::test_the_losss_all_gather_over_cp_equals_the_dense_loss",),
  ),
  # --- the all-gather strategy (issue 46)
  Mutant(
    "all_gather: each rank keeps its own share of the key gradients, unsummed",
    "cpjax/attention/ring/_passes.py",
    "  shard = lax.psum_scatter(grad, cfg.axis_name, scatter_dimension=2, tiled=True)",
    "  size = grad.shape[2] // cfg.layout.cp_size\n"
    "  shard = lax.dynamic_slice_in_dim(grad, _rank(cfg) * size, size, 2)",
    ("tests/test_all_gather.py::test_all_gather_equals_the_reference",),
  ),
  Mutant(
    "all_gather: K = V scatters dK alone",
    "cpjax/attention/ring/_passes.py",
    "      dk, dv = _scatter_home(cfg, dk + dv), zero_kv",
    "      dk, dv = _scatter_home(cfg, dk), zero_kv",
    ("tests/test_all_gather.py::test_one_tensor_for_k_and_v_gets_the_sum_of_both_gradients",),
  ),
  Mutant(
    "all_gather: K = V scatters dK and dV apart",
    "cpjax/attention/ring/_passes.py",
    "    if cfg.shared_kv:  # one tensor: its gradient is dk + dv, scattered once",
    "    if False:",
    (
      "tests/test_all_gather.py::"
      "test_all_gather_of_one_tensor_for_k_and_v_gathers_and_scatters_it_once",
    ),
  ),
  Mutant(
    "all_gather: the training step's context drops the strategy",
    "cpjax/training/step.py",
    "    capacity_factor,\n    strategy=strategy,\n  )",
    "    capacity_factor,\n  )",
    (
      "tests/test_parallel.py::"
      "test_the_step_with_another_cp_strategy_equals_the_single_device_step",
    ),
  ),
  Mutant(
    "all_gather: cp_logits drops the strategy",
    "cpjax/models/gemma4/cp_forward.py",
    "tuple(expert_axes), strategy=strategy",
    "tuple(expert_axes)",
    ("tests/test_gemma4.py::test_cp_logits_with_another_strategy_equal_transformers",),
  ),
  Mutant(
    "all_gather: Gemma 4's layers take the strategy of no kind",
    "cpjax/models/gemma4/model.py",
    "            **cp.attention_options(t.layer_types[layer]),",
    "            **cp.attention_options(),",
    ("tests/test_gemma4.py::test_cp_logits_with_another_strategy_equal_transformers",),
  ),
  Mutant(
    "all_gather: key tiles checked against one rank's row",
    "cpjax/attention/ring/_attention.py",
    '    key_len=row if strategy in ("all_gather", "ulysses") else None,',
    "    key_len=None,",
    ("tests/test_all_gather.py::test_all_gather_checks_its_key_tiles_against_the_whole_row",),
  ),
  # --- tile tables within SMEM, and the closed form against XLA:TPU (issue 44)
  Mutant(
    "TPU kernels: one call however long its tile table",
    "cpjax/attention/ring/kernels/_tpu.py",
    (
      "  count = next(\n"
      "    (\n"
      "      p\n"
      "      for p in range(1, lists + 1)\n"
      "      if lists % p == 0 and batch * (lists // p) * per_list <= TABLE_WORDS\n"
      "    ),\n"
      "    lists,\n"
      "  )"
    ),
    "  count = next((p for p in range(1, lists + 1) if lists % p == 0), lists)",
    ("tests/test_kernels.py::test_tpu_kernels_split_a_table_too_long_for_smem_into_pieces",),
  ),
  Mutant(
    "TPU kernels: every piece computes the first piece's tokens",
    "cpjax/attention/ring/kernels/_tpu.py",
    "  return slice(blocks.start * block, blocks.stop * block)",
    "  return slice(0, (blocks.stop - blocks.start) * block)",
    ("tests/test_kernels.py::test_tpu_kernels_split_a_table_too_long_for_smem_into_pieces",),
  ),
  Mutant(
    "GPU kernels: a grouped block's first key tile only",
    "cpjax/attention/ring/kernels/_gpu.py",
    "    j = jb * per_key + within",
    "    j = jb * per_key",
    ("tests/test_kernels.py::test_gpu_kernels_walk_every_tile_of_a_grouped_schedule_block",),
  ),
  Mutant(
    "GPU kernels: dk/dv sees a grouped block's first row tile only",
    "cpjax/attention/ring/kernels/_gpu.py",
    "    start = (ib * per_row + within) * r",
    "    start = ib * per_row * r",
    ("tests/test_kernels.py::test_gpu_kernels_walk_every_tile_of_a_grouped_schedule_block",),
  ),
  Mutant(
    "GPU schedule: never grouped however many tiles",
    "cpjax/attention/ring/kernels/_implementations.py",
    "    schedule_tiles=1 << 20,\n",
    "",
    (
      "tests/test_compile_targets.py::test_the_gpu_schedule_stays_linear_in_tokens_at_a_million_t"
      "oken"
      "s",
    ),
  ),
  Mutant(
    "plan --write-config: the run's other settings dropped",
    "cpjax/cli/plan.py",
    "  base = args.run if args.run is not None else RunConfig()",
    "  base = RunConfig()",
    ("tests/test_run_config.py::test_plan_takes_a_runs_dotted_keys_and_writes_its_other_settings",),
  ),
  Mutant(
    "plan: the ring's float32 buffers left out",
    "cpjax/training/plan/closed_form.py",
    "  ring = 4 * rows * local * widest * 4 * (heads + kv)",
    "  ring = 0",
    ("tests/test_plan.py::test_the_closed_form_is_at_most_a_tenth_below_the_accelerators",),
  ),
  Mutant(
    "plan: a GPU's closed form is the TPU's",
    "cpjax/training/plan/closed_form.py",
    "    peak = values * 4 * layers * rows * local * d",
    "    peak = TPU_PEAK_VALUES * 4 * rows * local * d",
    (
      "tests/test_plan.py::test_the_closed_form_is_at_most_a_tenth_below_the_accelerators",
      "tests/test_cli.py::test_plan_target_follows_the_gpu_compiler",
    ),
  ),
  Mutant(
    "plan: XLA:TPU's peak values left out",
    "cpjax/training/plan/closed_form.py",
    "    peak = TPU_PEAK_VALUES * 4 * rows * local * d",
    "    peak = 0",
    ("tests/test_plan.py::test_the_closed_form_is_at_most_a_tenth_below_the_accelerators",),
  ),
  Mutant(
    "plan: the expert dispatch's backward left out",
    "cpjax/training/plan/closed_form.py",
    '    gathered += (4 * a + (DISPATCH_GPU * a if platform == "cuda" else 4 * 4)) * dispatch',
    "    gathered += 4 * a * dispatch",
    ("tests/test_plan.py::test_the_closed_form_is_at_most_a_tenth_below_the_accelerators",),
  ),
  Mutant(
    "experts: JAX's ragged_dot (a dense [G, M, K]) off TPU",
    "cpjax/models/gemma4/experts.py",
    "  return lax.platform_dependent(rows, weights, sizes, tpu=_ragged_dot, default=looped)",
    "  return lax.platform_dependent(rows, weights, sizes, tpu=_ragged_dot,"
    " default=lax.ragged_dot)",
    (
      "tests/test_compile_targets.py::test_the_experts_grouped_matmul_compiles_without_a_dense_ex"
      "pansio"
      "n",
    ),
  ),
  Mutant(
    "experts: on TPU the weights' gradient leaves the backward on its own (made at the step's end)",
    "cpjax/models/gemma4/experts.py",
    "  d_rows, d_weights = lax.optimization_barrier(pullback(d_out))",
    "  d_rows, d_weights = pullback(d_out)",
    (
      "tests/test_compile_targets.py::"
      "test_the_experts_weight_gradients_are_made_in_their_layers_backward_on_the_tpu",
    ),
  ),
  Mutant(
    "experts: a tile meets only its first row's group",
    "cpjax/models/gemma4/experts.py",
    "  count = jnp.where(first < g, last - first + 1, 0)",
    "  count = jnp.where(first < g, 1, 0)",
    ("tests/test_experts.py::test_grouped_matmul_off_tpu_equals_each_groups_product",),
  ),
  # --- the kernels wherever a mesh puts them (issue 44)
  Mutant(
    "kernels: left to XLA's partitioner over fsdp and tp",
    "cpjax/attention/ring/kernels/_common.py",
    "    if not free:",
    "    if True:",
    ("tests/test_compile_targets.py::test_the_training_step_compiles_for_the_chip",),
  ),
  Mutant(
    "kernels: per-row tables whole over the batch axes",
    "cpjax/attention/ring/kernels/_common.py",
    "      return P(over_b) if x.shape[0] == batch else P()",
    "      return P(over_b) if x.ndim == 3 else P()",
    ("tests/test_parallel.py::test_kernels_split_over_the_axes_the_partitioner_shards",),
  ),
  Mutant(
    "kernels: the step's default is the process's backend",
    "cpjax/training/step.py",
    "  implementation = resolve_implementation(implementation, platform=mesh_platform(mesh))",
    "  implementation = resolve_implementation(implementation, platform=None)",
    ("tests/test_compile_targets.py::test_the_training_step_compiles_for_the_chip",),
  ),
  # --- training state over fsdp x cp (issue 34)
  Mutant(
    "state: whole over cp by default",
    "cpjax/parallel/_placement.py",
    'STATE_AXES = ("fsdp", "cp")',
    'STATE_AXES = ("fsdp",)',
    (
      "tests/test_state_sharding.py::test_a_cp_rank_holds_what_an_fsdp_rank_holds",
      "tests/test_parallel.py::test_optimizer_state_follows_parameter_shardings",
    ),
  ),
  Mutant(
    "state: cp minor on its dimension",
    "cpjax/parallel/_placement.py",
    '        axes[d] = group + axes[d] if "cp" in group else axes[d] + group',
    "        axes[d] = axes[d] + group",
    ("cpjax/parallel/__init__.py", "tests/test_parallel.py::test_tp_splits_heads_and_hidden_units"),
  ),
  Mutant(
    "all-gather strategy: the scattered gradient not behind a barrier (KV-shared rows kept whole)",
    "cpjax/attention/ring/_passes.py",
    "  return lax.optimization_barrier(shard)",
    "  return shard",
    (
      "tests/test_compile_targets.py::"
      "test_kv_shared_layers_keep_no_whole_row_gradient_alive_on_the_tpu",
    ),
  ),
  Mutant(
    "ring lookup: the ids do not travel",
    "cpjax/parallel/_lookup.py",
    "  def add(visiting, total):\n    rel, hit = hits(visiting)\n",
    "  def add(visiting, total):\n    rel, hit = hits(ids)\n",
    ("tests/test_parallel.py::test_ring_lookup_keeps_the_table_split_over_cp",),
  ),
  Mutant(
    "ring lookup: the backward's hops unrolled (several partials in flight on the TPU)",
    "cpjax/parallel/_lookup.py",
    "  visiting, g, d_block = jax.lax.fori_loop(0, n - 1, step, (ids, g, d_block))",
    "  visiting, g, d_block = jax.lax.fori_loop(0, n - 1, step, (ids, g, d_block), unroll=True)",
    ("tests/test_compile_targets.py::test_the_ring_lookup_keeps_one_partial_in_flight_on_the_tpu",),
  ),
  Mutant(
    "loss over cp: a chunk's statistics do not travel with it",
    "cpjax/training/loss.py",
    "      return (h, y, stats.merge(_block_stats(h, y, head, s))), None",
    "      return (h, y, _block_stats(h, y, head, s)), None",
    ("tests/test_loss.py::test_linear_cross_entropy_is_vocabulary_parallel",),
  ),
  Mutant(
    "loss over cp: what a chunk gathered does not come home",
    "cpjax/training/loss.py",
    "  return hop(home(moving)), kept",
    "  return home(moving), kept",
    ("tests/test_loss.py::test_linear_cross_entropy_is_vocabulary_parallel",),
  ),
  Mutant(
    "loss: the head's gradient restarts at each hop",
    "cpjax/training/loss.py",
    "      chunk, jax.lax.dynamic_slice_in_dim(d_head, i * rows, rows), (h, y, lse, dh)",
    "      chunk, 0 * jax.lax.dynamic_slice_in_dim(d_head, i * rows, rows), (h, y, lse, dh)",
    ("tests/test_loss.py::test_linear_cross_entropy_is_vocabulary_parallel",),
  ),
  # --- what a long row's step keeps alive (issue 34)
  Mutant(
    "experts: grouped_matmul's row search by jnp.searchsorted",
    "cpjax/models/gemma4/experts.py",
    "  group = _at_most(jnp.cumsum(sizes), m)",
    '  group = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(m, dtype=sizes.dtype), side="right")',
    ("tests/test_experts.py::test_grouped_matmul_takes_group_sizes_varying_over_a_mesh_axis",),
  ),
  Mutant(
    "fills: a constant, built when the step starts",
    "cpjax/parallel/_vary.py",
    "    out = out + zero  # 0 or 0 * 1: never NaN",
    "    out = out",
    ("tests/test_step_memory.py::test_accumulators_are_made_where_their_loops_run",),
  ),
  Mutant(
    "mlp tiles: every tile at once",
    "cpjax/models/gemma4/text.py",
    "    out = remat_tiles(lambda state, x: nnx.merge(graphdef, state)._mlp(x), state, tiles)",
    "    out = jax.vmap(nnx.merge(graphdef, state)._mlp)(tiles)",
    ("tests/test_step_memory.py::test_the_mlp_in_tiles_keeps_one_tile_of_intermediates",),
  ),
  Mutant(
    "mlp tiles: every tile written to the first",
    "cpjax/models/gemma4/remat.py",
    "    return lax.dynamic_update_index_in_dim(out, one_tile(leaves, tiles[i]), i, 0)",
    "    return lax.dynamic_update_index_in_dim(out, one_tile(leaves, tiles[i]), 0, 0)",
    ("tests/test_step_memory.py::test_the_mlp_in_tiles_equals_the_whole_row",),
  ),
  Mutant(
    "mlp tiles: the weights' gradient of the last tile only",
    "cpjax/models/gemma4/remat.py",
    "    d_leaves = [d + d_leaf[j] for d, j in zip(d_leaves, grows)]",
    "    d_leaves = [d * 0 + d_leaf[j] for d, j in zip(d_leaves, grows)]",
    ("tests/test_step_memory.py::test_the_mlp_in_tiles_equals_the_whole_row",),
  ),
  Mutant(
    "mlp tiles: the input's gradient from a zeros constant",
    "cpjax/models/gemma4/remat.py",
    "    filled_after(g, tiles.shape, dtype=tiles.dtype),",
    "    jnp.zeros(tiles.shape, tiles.dtype),",
    ("tests/test_step_memory.py::test_the_mlp_tiles_backward_makes_its_buffers_where_it_runs",),
  ),
  Mutant(
    "mlp tiles: the weights' gradients from zeros constants",
    "cpjax/models/gemma4/remat.py",
    "    [filled_after(g, leaves[j].shape, dtype=leaves[j].dtype) for j in grows],",
    "    [jnp.zeros(leaves[j].shape, leaves[j].dtype) for j in grows],",
    ("tests/test_step_memory.py::test_the_mlp_tiles_backward_makes_its_buffers_where_it_runs",),
  ),
  Mutant(
    "mlp tiles: weights not made varying as the tiles",
    "cpjax/models/gemma4/remat.py",
    "  leaves = [vary_like(leaf, tiles) for leaf in leaves]",
    "  leaves = list(leaves)",
    ("tests/test_step_memory.py::test_tiles_sum_a_weight_shared_by_the_ranks_once",),
  ),
  Mutant(
    "step: ep's experts over cp gathered",
    "cpjax/training/step.py",
    '    return axis_name in expert_axes and "experts" in keys',
    "    return False",
    ("tests/test_experts.py::test_ep_step_equals_the_single_device_step",),
  ),
  Mutant(
    "step: a storage split over cp taken for ep's",
    "cpjax/training/step.py",
    '    return axis_name in expert_axes and "experts" in keys',
    '    return bool(expert_axes) and "experts" in keys',
    ("tests/test_experts.py::test_ep_step_equals_the_single_device_step",),
  ),
  Mutant(
    "trainer: --shard-state fsdp ignored",
    "cpjax/training/trainer/builder.py",
    "  state_axes = run.parallel.state_axes()",
    "  state_axes = parallel.STATE_AXES",
    ("tests/test_state_sharding.py::test_cpjax_train_places_the_state_as_shard_state_says",),
  ),
  # --- run configs and recipes (issue 36)
  Mutant(
    "run config: a dotted key beats its short flag",
    "cpjax/training/run_file.py",
    "    values[s.key] = namespace.get(s.key) if alias is argparse.SUPPRESS else alias",
    "    values[s.key] = namespace.get(s.key)",
    (
      "tests/test_run_config.py::test_overrides_beat_the_file_and_short_flags_beat_both",
      "tests/test_run_config.py::test_every_short_flag_sets_its_dotted_key",
    ),
  ),
  Mutant(
    "run config: no run.yaml in the state directory",
    "cpjax/training/trainer/loop.py",
    "  if run.checkpointing.state_dir and jax.process_index() == 0:",
    "  if False:",
    ("tests/test_run_config.py::test_run_yaml_reruns_bit_for_bit_and_resume_reads_it",),
  ),
  Mutant(
    "run config: --resume ignores run.yaml",
    "cpjax/cli/train.py",
    "    if os.path.isfile(saved):  # the saved run, under this command line",
    "    if False:",
    ("tests/test_run_config.py::test_run_yaml_reruns_bit_for_bit_and_resume_reads_it",),
  ),
  Mutant(
    "run config: --checkpoint keeps a recipe's model",
    "cpjax/cli/train.py",
    "        run = with_values(run, {other: None})",
    "        pass",
    ("tests/test_run_config.py::test_the_command_line_replaces_what_a_file_trains_and_its_mesh",),
  ),
  Mutant(
    "run config: a positive setting goes unchecked",
    "cpjax/training/run_config.py",
    "    if s.positive and value is not None and not value > 0:",
    "    if False:",
    ("tests/test_run_config.py::test_unknown_keys_and_wrong_types_are_one_line_exit_two",),
  ),
  Mutant(
    "plan: --write-config prefers bfloat16",
    "cpjax/cli/plan.py",
    '    for d in ("float32", "bfloat16")',
    '    for d in ("bfloat16", "float32")',
    ("tests/test_run_config.py::test_plan_writes_a_config_that_fits",),
  ),
  # --- the folders and the plan of a run (issue 62)
  Mutant(
    "folders: a module imports another package's private module",
    "cpjax/batch/sharding.py",
    "from cpjax.batch import _streams, balance\n",
    (
      "from cpjax.batch import _streams, balance\n"
      "from cpjax.masks._rules import MaskRule  # noqa: F401\n"
    ),
    ("tests/test_architecture.py::test_no_module_imports_another_modules_private_name",),
  ),
  Mutant(
    "deprecations: an old path's module takes the alias's spec",
    "cpjax/_deprecations.py",
    "    module.__spec__ = module.__spec__.loader_state\n",
    "    pass\n",
    ("tests/test_deprecations.py::test_an_old_module_path_is_the_new_module_with_a_warning",),
  ),
  Mutant(
    "plan: a run from dotted keys plans one row a batch shard, not its rows",
    "cpjax/cli/plan.py",
    'if getattr(args, key) is None and (named(*keys) or key == "batch_size"):',
    "if getattr(args, key) is None and named(*keys):",
    ("tests/test_plan.py::test_cli_plan_and_train_agree_without_a_recipe",),
  ),
  Mutant(
    "names: a ShardLayout given to shard_batch keeps its kind, not its stripes",
    "cpjax/batch/sharding.py",
    "    stripes, padded = layout.stripes, layout.padded_seq_len\n",
    "    stripes, padded = None, layout.padded_seq_len\n",
    ("tests/test_sharding.py::test_a_layout_given_back_shards_rows_of_that_shape_the_same_way",),
  ),
  Mutant(
    "names: an old keyword is dropped, not renamed",
    "cpjax/_deprecations.py",
    "  return {(new if k == old else k): v for k, v in given.items()}\n",
    "  return {k: v for k, v in given.items() if k != old}\n",
    ("tests/test_deprecations.py::test_an_old_keyword_warns_and_gives_what_the_new_one_gives",),
  ),
  # --- the package's layers (issue 35)
  Mutant(
    "layers: the data layer imports the training layer",
    "cpjax/data/synthetic.py",
    "from cpjax.batch.normalize import next_token_labels",
    (
      "from cpjax.batch.normalize import next_token_labels\n"
      "\n"
      "\n"
      "def _upward():\n"
      "  from cpjax.training import loss  # noqa: F401\n"
    ),
    ("tests/test_architecture.py::test_no_import_from_a_higher_layer",),
  ),
  Mutant(
    "layers: two batch modules import each other",
    "cpjax/batch/_streams.py",
    "from cpjax.batch import normalize as batch_lib",
    (
      "from cpjax.batch import normalize as batch_lib\n"
      "\n"
      "\n"
      "def _back():\n"
      "  from cpjax.batch import sharding  # noqa: F401\n"
    ),
    ("tests/test_architecture.py::test_no_import_cycle",),
  ),
  # --- the paths a real fine-tuning run takes (issue 33)
  Mutant(
    "tokenizer: a {% generation %} block's span starts at its end",
    "cpjax/data/tokenizer.py",
    "        spans.append((start, start + len(text)))",
    "        spans.append((start + len(text), start + len(text)))",
    (
      "tests/test_tokenizer.py::test_generation_tags_are_the_answer_as_transformers_reads_them",
      "tests/test_records.py::test_a_template_with_generation_tags_keeps_every_conversation",
    ),
  ),
  Mutant(
    "tokenizer: tagged templates use the prefix method",
    "cpjax/data/tokenizer.py",
    "    if self.marks_generation:",
    "    if False:",
    ("tests/test_tokenizer.py::test_generation_tags_by_hand",),
  ),
  Mutant(
    "checkpoint: buffers stay on one device",
    "cpjax/models/gemma4/checkpoint.py",
    "    return NamedSharding(on, P() if spec is None else spec)\n",
    "    return default if spec is None else NamedSharding(on, spec)\n",
    ("tests/test_gemma4_checkpoint.py::test_sharded_save_with_index_and_placement_on_a_mesh",),
  ),
  Mutant(
    "trainer: a resumed state restarts its step count",
    "cpjax/training/trainer/loop.py",
    '      trainer.state = TrainState(restored["params"], restored["opt_state"], step=step)',
    '      trainer.state = TrainState(restored["params"], restored["opt_state"])',
    ("tests/test_checkpointing.py::test_resume_continues_with_bit_identical_losses",),
  ),
  Mutant(
    "trainer: a failing hook ends the run unsaved",
    "cpjax/training/trainer/loop.py",
    "      saved = _save_after_failure(trainer, data, checkpointer, failure, summary)",
    '      saved = "nothing was saved"',
    ("tests/test_trainer.py::test_a_failing_hook_saves_the_run_and_names_itself",),
  ),
  Mutant(
    "lora: the creation pass runs on the Explicit mesh",
    "cpjax/training/lora/adapters.py",
    "  _retyped(model, auto)\n",
    "",
    ("tests/test_lora.py::test_adapters_made_on_a_mesh_equal_those_made_on_one_device",),
  ),
  Mutant(
    "lora: merging ignores rsLoRA",
    "cpjax/training/lora/adapters.py",
    "        name, base[...], a[...], b[...], settings.scale",
    "        name, base[...], a[...], b[...], settings.alpha / settings.rank",
    ("tests/test_lora.py::test_merged_model_equals_the_adapted_model_for_every_option",),
  ),
  Mutant(
    "checkpointing: a changed microbatches count resumes",
    "cpjax/training/checkpointing.py",
    '  for key in ("batch_size", "seq_len", "microbatches"):',
    '  for key in ("batch_size", "seq_len"):',
    ("tests/test_checkpointing.py::test_every_setting_resume_compares_refuses_a_change",),
  ),
  Mutant(
    "checkpointing: LoRA settings other than the rank are not compared",
    "cpjax/training/checkpointing.py",
    '  if saved.get("lora") != current.get("lora"):  # what the saved parameters are',
    '  if (saved.get("lora") or {}).get("rank") != (current.get("lora") or {}).get("rank"):',
    ("tests/test_checkpointing.py::test_every_setting_resume_compares_refuses_a_change",),
  ),
  Mutant(
    "gemma4: cp_logits does not check the expert split",
    "cpjax/models/gemma4/cp_forward.py",
    "  check_expert_axes(model.cfg, mesh, expert_axes)\n",
    "",
    ("tests/test_experts.py::test_bad_expert_parallel_input",),
  ),
  # --- expert parallelism (issue 23)
  Mutant(
    "experts: a kept pair's slot ignores the pairs kept before it in its group",
    "cpjax/models/gemma4/experts.py",
    "  slot = jnp.where(keep, group * rows + kept_before - first[group], groups * rows)",
    "  slot = jnp.where(keep, group * rows, groups * rows)",
    ("tests/test_experts.py::test_dispatch_and_gradients_equal_the_dense_reference",),
  ),
  Mutant(
    "experts: the received rows are not regrouped by local expert",
    "cpjax/models/gemma4/experts.py",
    "  out = expert_fn(received[regroup], counts, params)",
    "  out = expert_fn(received, counts, params)",
    ("tests/test_experts.py::test_dispatch_and_gradients_equal_the_dense_reference",),
  ),
  Mutant(
    "experts: the capacity keeps one pair too many per expert",
    "cpjax/models/gemma4/experts.py",
    "  keep = rank < _expert_capacity(flat.shape[0], e, capacity_factor)",
    "  keep = rank <= _expert_capacity(flat.shape[0], e, capacity_factor)",
    ("tests/test_experts.py::test_capacity_drops_exactly_the_counted_pairs",),
  ),
  Mutant(
    "experts: a dropped pair reads a returned row",
    "cpjax/models/gemma4/experts.py",
    '  y = back.at[slot].get(mode="fill", fill_value=0).astype(jnp.float32)',
    '  y = back.at[slot].get(mode="clip").astype(jnp.float32)',
    ("tests/test_experts.py::test_capacity_drops_exactly_the_counted_pairs",),
  ),
  Mutant(
    "experts: the stats are not summed over the batch axis",
    "cpjax/models/gemma4/experts.py",
    "    if batch is not None:  # the stats of every row this cp rank holds",
    "    if False:",
    ("tests/test_experts.py::test_dispatch_and_gradients_equal_the_dense_reference",),
  ),
  Mutant(
    "experts: the nested backward drops the weights' cotangent",
    "cpjax/models/gemma4/experts.py",
    "  return d_x, d_w, None, d_params",
    "  return d_x, jnp.zeros_like(d_w), None, d_params",
    ("tests/test_experts.py::test_dispatch_and_gradients_equal_the_dense_reference",),
  ),
  Mutant(
    "train: expert parameters enter the cp shard_map whole",
    "cpjax/attention/cp_context.py",
    "      kept = tuple(n for n in names if n in axes)",
    "      kept = ()",
    ("tests/test_experts.py::test_ep_step_equals_the_single_device_step",),
  ),
  Mutant(
    "parallel: ep folds onto the batch axis before cp",
    "cpjax/parallel/_mesh.py",
    '  options = [("cp",), (batch,), ("cp", batch)] if batch else [("cp",)]',
    '  options = [(batch,), ("cp",), ("cp", batch)] if batch else [("cp",)]',
    (
      "tests/test_experts.py::test_dispatch_and_gradients_equal_the_dense_reference",
      "cpjax/parallel/__init__.py",
    ),
  ),
  # --- your own data (issue 21)
  Mutant(
    "tokenizer: the answer spans start one character early, in the turn header",
    "cpjax/data/tokenizer.py",
    "      start = len(os.path.commonprefix([prompt, end]))",
    "      start = len(os.path.commonprefix([prompt, end])) - 1",
    ("tests/test_tokenizer.py::test_answer_mask_equals_transformers_generation_mask",),
  ),
  Mutant(
    "tokenizer: the named special tokens are not added tokens",
    "cpjax/data/tokenizer.py",
    (
      "    self.backend.add_special_tokens(\n"
      "      [AddedToken(t, special=True, normalized=False) for t in"
      " self.special_tokens.values()]\n"
      "    )"
    ),
    "    pass",
    ("tests/test_tokenizer.py::test_ids_equal_autotokenizer_and_apply_chat_template",),
  ),
  Mutant(
    "tokenizer: image tokens may count in the loss",
    "cpjax/data/tokenizer.py",
    '    for key in ("image_token", "audio_token"):',
    '    for key in ("audio_token",):',
    ("tests/test_images.py::test_conversation_with_images_equals_gemma4_processor",),
  ),
  Mutant(
    "tokenizer: answer spans keep their place when an image expands before them",
    "cpjax/data/tokenizer.py",
    "      return pos + sum(extra for where, extra in shifts if where < pos)",
    "      return pos",
    ("tests/test_images.py::test_conversation_with_images_equals_gemma4_processor",),
  ),
  Mutant(
    "corpus: the loss mask of the next token is ignored",
    "cpjax/data/corpus.py",
    '    same = (docs > 0) & (nxt_doc == docs) & (np.roll(row["loss_mask"], -1) > 0)',
    "    same = (docs > 0) & (nxt_doc == docs)",
    (
      "tests/test_records.py::test_loss_counts_exactly_the_assistant_tokens_through_packing"
      "_and_sharding",
    ),
  ),
  Mutant(
    "corpus: the loss mask of the token itself, not of its target",
    "cpjax/data/corpus.py",
    '    same = (docs > 0) & (nxt_doc == docs) & (np.roll(row["loss_mask"], -1) > 0)',
    '    same = (docs > 0) & (nxt_doc == docs) & (row["loss_mask"] > 0)',
    (
      "tests/test_records.py::test_loss_counts_exactly_the_assistant_tokens_through_packing"
      "_and_sharding",
    ),
  ),
  Mutant(
    "corpus: a row's images fill its slots from the last one",
    "cpjax/data/corpus.py",
    '      pixels[i, :n] = processor.pixels(row["image_patches"][start : start + n])',
    '      pixels[slots - 1 - i, :n] = processor.pixels(row["image_patches"][start : start + n])',
    ("tests/test_images.py::test_images_ride_with_their_documents_through_packing",),
  ),
  Mutant(
    "images: bilinear instead of bicubic resizing",
    "cpjax/data/images.py",
    "      image = image.resize((w, h), resample=Image.Resampling.BICUBIC, reducing_gap=None)",
    "      image = image.resize((w, h), resample=Image.Resampling.BILINEAR, reducing_gap=None)",
    ("tests/test_images.py::test_pixels_equal_transformers_image_processor",),
  ),
  Mutant(
    "images: patches flattened channel-first",
    "cpjax/data/images.py",
    "    patches = pixels.reshape(t, rows, p, cols, p, 3).transpose(0, 1, 3, 2, 4, 5)",
    "    patches = pixels.reshape(t, rows, p, cols, p, 3).transpose(0, 1, 3, 5, 2, 4)",
    ("tests/test_images.py::test_pixels_equal_transformers_image_processor",),
  ),
  Mutant(
    "images: transparency dropped, not composited onto white",
    "cpjax/data/images.py",
    '  if "A" in image.getbands() or image.info.get("transparency") is not None:',
    "  if False:",
    ("tests/test_images.py::test_pixels_equal_transformers_image_processor",),
  ),
  Mutant(
    "gemma4: an all-padding image slot yields a soft token in the tower",
    "cpjax/models/gemma4/vision.py",
    "    valid = jnp.any((weights != 0) & real[..., None], axis=1)  # [N, M]",
    "    valid = jnp.any(weights != 0, axis=1)  # [N, M]",
    ("tests/test_gemma4.py::test_all_padding_image_slots_yield_no_soft_tokens",),
  ),
  Mutant(
    "run config: the linear schedule decays over all steps, warmup included",
    "cpjax/training/run_config.py",
    "    lr, warm, rest = self.lr, self.warmup_steps, max(self.steps - self.warmup_steps, 1)",
    "    lr, warm, rest = self.lr, self.warmup_steps, max(self.steps, 1)",
    ("tests/test_trainer.py::test_schedules_equal_transformers",),
  ),
  Mutant(
    "trainer: validation counts one token too many",
    "cpjax/training/trainer/hooks.py",
    '    record["eval_loss"] = ce_sum / max(count, 1.0)',
    '    record["eval_loss"] = ce_sum / max(count + 1.0, 1.0)',
    ("tests/test_trainer.py::test_validation_loss_is_the_single_device_loss_of_the_fixed_rows",),
  ),
  # --- document_balanced (issue 20)
  Mutant(
    "layout: document_balanced stripes dealt cyclically, not in a serpentine",
    "cpjax/batch/layout.py",
    "  chunks = passes * cp + jnp.where(passes % 2 == 0, rank, cp - 1 - rank)",
    "  chunks = passes * cp + rank",
    ("tests/test_document_balance.py::test_stripes_are_dealt_in_a_serpentine",),
  ),
  Mutant(
    "sharding: unshard_batch applies the row order instead of its inverse",
    "cpjax/batch/sharding.py",
    "    inverse = jnp.argsort(source, axis=1).astype(jnp.int32)  # a permutation: exact",
    "    inverse = source.astype(jnp.int32)",
    ("tests/test_document_balance.py::test_shard_then_unshard_is_bit_exact",),
  ),
  Mutant(
    "balance: the document a stripe boundary cuts counts one token short",
    "cpjax/batch/balance.py",
    "  cut = np.where(np.take_along_axis(real[orders], doc, 1), _prefix_work(into, windows), 0.0)",
    "  cut = np.where(np.take_along_axis(real[orders], doc, 1), _prefix_work(into - 1,"
    " windows), 0.0)",
    ("tests/test_document_balance.py::test_search_scores_equal_the_work_of_the_reordered_row",),
  ),
  Mutant(
    "balance: a windowed layer's prefix work forgets the tokens past the window",
    "cpjax/batch/balance.py",
    "    out += c * (m * (m + 1) / 2 + (0 if w is None else (n - m) * w))",
    "    out += c * (m * (m + 1) / 2)",
    ("tests/test_document_balance.py::test_search_scores_equal_the_work_of_the_reordered_row",),
  ),
  Mutant(
    "sharding: document_balanced leaves the reordered ids unrenumbered",
    "cpjax/batch/sharding.py",
    (
      "      norm,\n"
      "      shard_layout,\n"
      "      batch_dims,\n"
      "      layer_windows=layer_windows,\n"
      "      renumber=batch_lib.DOCUMENT_IDS_KEY in streams,"
    ),
    "      norm, shard_layout, batch_dims, layer_windows=layer_windows, renumber=False",
    ("tests/test_document_balance.py::test_shard_then_unshard_is_bit_exact",),
  ),
  Mutant(
    "balance: renumbering follows the ids' values, not their first places",
    "cpjax/batch/balance.py",
    "    rename[np.flatnonzero(real)[np.argsort(first[real])]] = np.arange(1, real.sum() + 1)",
    "    rename[np.flatnonzero(real)] = np.arange(1, real.sum() + 1)",
    ("tests/test_document_balance.py::test_shard_then_unshard_is_bit_exact",),
  ),
  Mutant(
    "gemma4: the sharder's document_balanced stripes ignore the window",
    "cpjax/models/gemma4/model.py",
    "          min_stripe_len=t.effective_sliding_window,",
    "          min_stripe_len=1024,",
    ("tests/test_document_balance.py::test_min_stripe_len_sets_the_stripes_shard_batch_deals",),
  ),
  Mutant(
    "gemma4: the sharder's document_balanced balance counts causal work only",
    "cpjax/models/gemma4/model.py",
    "          layer_windows=tuple(",
    ("          layer_windows=None\n          and tuple("),
    ("tests/test_document_balance.py::test_min_stripe_len_sets_the_stripes_shard_batch_deals",),
  ),
  # --- the five of the review that found them surviving
  Mutant(
    "train: the loss picks the logit of labels + 1",
    "cpjax/training/loss.py",
    "  picked = jnp.sum(jnp.where(vocab == labels[..., None], logits, 0.0), axis=-1)",
    "  picked = jnp.sum(jnp.where(vocab == labels[..., None] + 1, logits, 0.0), axis=-1)",
    ("tests/test_loss.py",),
  ),
  Mutant(
    "ring: the tile loop never skips",
    "cpjax/attention/ring/_passes.py",
    "  visit = (jnp.any(blocks.any, axis=0) & active).ravel()",
    "  visit = jnp.broadcast_to(active, blocks.any.shape[1:]).ravel()",
    (TILES,),
  ),
  Mutant(
    "masks: SameDocument.classify calls no block empty or full",
    "cpjax/masks/_rules.py",
    "    return _group_blocks(qs, qs > 0, ks, ks > 0)",
    "    blocks = _group_blocks(qs, qs > 0, ks, ks > 0)\n"
    "    return BlockMap(jnp.ones_like(blocks.any), jnp.zeros_like(blocks.all))",
    (TILES,),
  ),
  Mutant(
    "sharding: unshard_batch ignores layout.replicated_keys",
    "cpjax/batch/sharding.py",
    "  streams = {k: d for k, d in streams.items() if k not in layout.replicated_keys}\n",
    "",
    ("tests/test_sharding.py::test_unshard_an_aux_only_batch",),
  ),
  Mutant(
    "masks: LocalWindow.classify, the wrong query bound for full",
    "cpjax/masks/_rules.py",
    "      some, every = some & (q_lo - k_hi <= self.left), every & (q_hi - k_lo <= self.left)",
    "      some, every = some & (q_lo - k_hi <= self.left), every & (q_lo - k_lo <= self.left)",
    (TILES,),
  ),
  Mutant(
    "train: the chunked loss's backward drops the soft cap's derivative",
    "cpjax/training/loss.py",
    "        dz = dz * (1.0 - t * t)",
    "        dz = dz * 1.0",
    ("tests/test_loss.py",),
  ),
  # --- one or more per core module
  Mutant(
    "kernels common: the per-row schedule never skips",
    "cpjax/attention/ring/kernels/_common.py",
    "  visit = jnp.broadcast_to(blocks.any, shape) & active",
    "  visit = jnp.broadcast_to(active, shape)",
    (TILES,),
  ),
  Mutant(
    "layout: the load-balanced tail chunk",
    "cpjax/batch/layout.py",
    "  chunks = passes * cp + jnp.where(passes % 2 == 0, rank, cp - 1 - rank)",
    "  chunks = passes * cp + jnp.where(passes % 2 == 0, rank, cp - 2 - rank)",
    ("tests/test_layout.py",),
  ),
  Mutant(
    "sharding: labels padded with 0",
    "cpjax/batch/_streams.py",
    '  "labels": batch_lib.IGNORE_INDEX,',
    '  "labels": 0,',
    ("tests/test_sharding.py",),
  ),
  Mutant(
    "masks: the window admits one key too many",
    "cpjax/masks/_rules.py",
    "      ok &= d <= self.left",
    "      ok &= d <= self.left + 1",
    ("tests/test_masks.py",),
  ),
  Mutant(
    "ring: a tile forgets to rescale the running sum",
    "cpjax/attention/ring/_passes.py",
    "    l = alpha * l + jnp.sum(p, axis=-1)",
    "    l = l + jnp.sum(p, axis=-1)",
    ("tests/test_ring_attention.py",),
  ),
  Mutant(
    "gemma4: embeddings unscaled",
    "cpjax/models/gemma4/text.py",
    "  return jnp.asarray(math.sqrt(width), dtype)",
    "  return jnp.asarray(1.0, dtype)",
    ("tests/test_gemma4.py::test_single_device_logits_equal_transformers",),
  ),
  Mutant(
    "gemma4 checkpoint: chunks land one row late",
    "cpjax/models/gemma4/checkpoint.py",
    "      host[lo:hi] = part  # casts to dtype as numpy does",
    "      host[lo + 1 : hi + 1] = part[: host.shape[0] - lo - 1]  # casts to dtype as numpy does",
    ("tests/test_gemma4_checkpoint.py::test_each_device_reads_its_block_in_chunks",),
  ),
  Mutant(
    "gemma4 checkpoint: a replicated block is read once, for the wrong device",
    "cpjax/models/gemma4/checkpoint.py",
    (
      "    block = (\n"
      "      _load_shard(file, key, index, shape, dtype, device)\n"
      "      if seen is None\n"
      "      else jax.device_put(seen, device)\n"
      "    )"
    ),
    "    block = _load_shard(file, key, index, shape, dtype, device) if seen is None else seen",
    ("tests/test_gemma4_checkpoint.py::test_each_device_reads_its_block_in_chunks",),
  ),
  Mutant(
    "checkpointing: the data position is not saved",
    "cpjax/training/checkpointing.py",
    "      data_state=ocp.args.JsonSave(dict(data_state)),",
    "      data_state=ocp.args.JsonSave({k: None for k in data_state}),",
    ("tests/test_checkpointing.py::test_resume_continues_with_bit_identical_losses",),
  ),
  Mutant(
    "batch: a 4-D mask read from its last head",
    "cpjax/batch/normalize.py",
    "    diag = jnp.diagonal(mask[:, 0], axis1=-2, axis2=-1)",
    "    diag = jnp.diagonal(mask[:, -1], axis1=-2, axis2=-1)",
    ("tests/test_batch.py",),
  ),
  Mutant(
    "data: synthetic text may draw a special id",
    "cpjax/data/synthetic.py",
    "  allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(reserved_ids, np.int64))",
    "  allowed = np.arange(vocab_size)",
    ("tests/test_gemma4_published.py::test_synthetic_rows_never_forge_a_special_token",),
  ),
  Mutant(
    "parallel: lookup reads every id from the first block of rows",
    "cpjax/parallel/_lookup.py",
    "  rel = ids - jax.lax.axis_index(table_axes) * size",
    "  rel = ids - 0 * size",
    ("tests/test_parallel.py::test_lookup_keeps_the_table_sharded",),
  ),
  Mutant(
    "linear CE: the vocabulary blocks' sums of exponentials are not combined",
    "cpjax/training/loss.py",
    "      sum_exp, picked = jax.lax.psum((sum_exp, picked), axes)",
    "      picked = jax.lax.psum(picked, axes)",
    ("tests/test_loss.py::test_linear_cross_entropy_is_vocabulary_parallel",),
  ),
  Mutant(
    "linear CE: the backward's vocabulary tiles all take the label at tile 0",
    "cpjax/training/loss.py",
    "      dz = jnp.exp(z - lc[:, None]) - _is_label(z, yc, start + i * rows)",
    "      dz = jnp.exp(z - lc[:, None]) - _is_label(z, yc, start)",
    ("tests/test_loss.py",),
  ),
  Mutant(
    "gemma4: image tokens take the next soft token",
    "cpjax/models/gemma4/model.py",
    "jnp.cumsum(is_token, axis=1, dtype=jnp.int32) - 1",
    "jnp.cumsum(is_token, axis=1, dtype=jnp.int32)",
    ("tests/test_gemma4.py::test_single_device_logits_equal_transformers",),
  ),
  Mutant(
    "gemma4: remat recomputes each layer from zeros",
    "cpjax/models/gemma4/remat.py",
    "  nan = lax.optimization_barrier(first != first)",
    "  nan = lax.optimization_barrier(first == first)",
    ("tests/test_gemma4.py::test_remat_policies_give_the_same_gradients",),
  ),
  Mutant(
    "gemma4: full remat re-traces the layer in the backward (LoRA adapters vanish)",
    "cpjax/models/gemma4/remat.py",
    "    return _tied_remat(replay, *args)",
    "    return _tied_remat(fn, *args)",
    ("tests/test_lora.py::test_adapter_gradients_equal_the_dense_reference",),
  ),
  Mutant(
    "lora: the experts' adapters are added unscaled",
    "cpjax/models/gemma4/text.py",
    "      return (y.astype(jnp.float32) + scale * term).astype(dt)",
    "      return (y.astype(jnp.float32) + term).astype(dt)",
    ("tests/test_lora.py::test_expert_adapters_equal_experts_with_the_merged_tensors",),
  ),
  Mutant(
    "lora: PEFT's expert lora_B read expert-major",
    "cpjax/training/lora/peft_format.py",
    '    b.set_value(_like(b, factors["B"].reshape(out, r, e).transpose(2, 1, 0)))',
    '    b.set_value(_like(b, factors["B"].reshape(out, e, r).transpose(1, 2, 0)))',
    ("tests/test_lora_peft.py::test_cpjax_loads_peft_expert_adapters_on_every_mesh",),
  ),
  Mutant(
    "lora: PEFT's expert wrappers nested the other way",
    "cpjax/training/lora/peft_format.py",
    "  outermost_first = list(reversed(names))\n",
    "  outermost_first = list(names)\n",
    (
      "tests/test_lora_peft.py::test_peft_loads_cpjax_expert_adapters_and_merging_equals_its_merge",
    ),
  ),
  Mutant(
    "lora: a target_parameters entry no module can adapt is skipped",
    "cpjax/training/lora/adapters.py",
    "  if refused:\n",
    "  if False:\n",
    ("tests/test_lora.py::test_target_parameters_naming_what_cannot_be_adapted_are_refused",),
  ),
  Mutant(
    "plan: expert adapters counted as split like the rest of the state",
    "cpjax/training/plan/closed_form.py",
    "on_experts / (expert_shards if ep > 1 else shards)",
    "on_experts / shards",
    ("tests/test_plan.py::test_expert_lora_compiled_plan_state_equals_the_closed_form",),
  ),
  Mutant(
    "gemma4: cp_logits takes rows whole over an Auto axis as split",
    "cpjax/models/gemma4/cp_forward.py",
    "  rows = batch_axis if len(labels) and labels[0] == batch_axis else None\n",
    "  rows = batch_axis\n",
    ("tests/test_lora_peft.py::test_cpjax_loads_peft_expert_adapters_on_every_mesh",),
  ),
  Mutant(
    "qlora: the experts run on the quantized values unscaled",
    "cpjax/models/gemma4/text.py",
    "        dense = qwix.dequantize(jax.lax.stop_gradient(weight))\n",
    "        dense = weight.qvalue.astype(jnp.float32)\n",
    ("tests/test_qlora.py::test_a_quantized_base_is_the_numpy_scheme_and_its_logits_transformers",),
  ),
  Mutant(
    "qlora: the experts' gradient reaches their frozen quantized tensors",
    "cpjax/models/gemma4/text.py",
    "        dense = qwix.dequantize(jax.lax.stop_gradient(weight))\n",
    "        dense = qwix.dequantize(weight)\n",
    # ep beside fsdp: the dispatch's own custom VJP (its cotangent's type).
    ("tests/test_qlora.py::test_a_quantized_base_compiles_to_the_closed_form_state",),
  ),
  Mutant(
    "qlora: one scale an expert, not an output channel",
    "cpjax/training/lora/quantize.py",
    "channelwise_axes=(0, 1), tiled_axes=tiles)",
    "channelwise_axes=(0,), tiled_axes=tiles)",
    ("tests/test_qlora.py::test_a_quantized_base_is_the_numpy_scheme_and_its_logits_transformers",),
  ),
  Mutant(
    "qlora: projections without adapters stay unquantized",
    "cpjax/training/lora/adapters.py",
    "    if quantized and re.fullmatch(QUANTIZED_MODULES, p) and p not in matched\n",
    "    if False\n",
    ("tests/test_qlora.py::test_a_quantized_base_is_the_numpy_scheme_and_its_logits_transformers",),
  ),
  Mutant(
    "qlora: the plan counts a 4-bit value as a byte",
    "cpjax/training/plan/closed_form.py",
    '  q = 0.5 if base_dtype in ("int4", "nf4") else 1.0\n',
    "  q = 1.0\n",
    ("tests/test_qlora.py::test_a_quantized_base_compiles_to_the_closed_form_state",),
  ),
  Mutant(
    "qlora: a 4-bit base runs the program compiled ahead of time",
    "cpjax/training/step.py",
    "      if self._executable is not None and not self._sub_byte:\n",
    "      if self._executable is not None:\n",
    (
      "tests/test_qlora.py::"
      "test_cli_trains_a_4bit_checkpoint_with_cp_resumes_and_peft_loads_it[moe-cp4-ep4]",
    ),
  ),
  Mutant(
    "qlora: a weight read for quantizing lives on while the next is read",
    "cpjax/models/gemma4/checkpoint.py",
    "    del weight  # the tensor in the checkpoint's dtype lives no longer than this\n",
    "",
    (
      "tests/test_qlora.py::"
      "test_a_checkpoint_is_quantized_tensor_by_tensor_as_it_is_read[moe-nf4-g8-fsdp2-cp2-ep4]",
    ),
  ),
  Mutant(
    "qlora: a weight read for quantizing is quantized per channel, not in its groups",
    "cpjax/models/gemma4/checkpoint.py",
    "      tiled.append((axis, n // groups))\n",
    "      pass\n",
    (
      "tests/test_qlora.py::"
      "test_a_checkpoint_is_quantized_tensor_by_tensor_as_it_is_read[moe-nf4-g8-fsdp2-cp2-ep4]",
    ),
  ),
  Mutant(
    "qlora: a quantized projection's values and scales are read replicated",
    "cpjax/training/trainer/builder.py",
    'if n not in ("value", "array")): spec',
    'if n != "value"): spec',
    (
      "tests/test_qlora.py::"
      "test_a_checkpoint_is_quantized_tensor_by_tensor_as_it_is_read[moe-nf4-g8-fsdp2-cp2-ep4]",
    ),
  ),
  Mutant(
    "qlora: the trainer loads the whole base before quantizing it",
    "cpjax/training/trainer/builder.py",
    "  if run.checkpoint and run.lora.rank is not None and base in lora.QUANTIZED_DTYPES:\n",
    "  if False:\n",
    (
      "tests/test_qlora.py::"
      "test_cli_trains_a_4bit_checkpoint_with_cp_resumes_and_peft_loads_it[moe-cp4-ep4]",
    ),
  ),
  Mutant(
    "qlora: a lazily adapted model keeps abstract adapters",
    "cpjax/training/lora/adapters.py",
    "      nnx.update(model, jax.jit(lambda: nnx.state(adapt(), nnx.LoRAParam))())\n",
    "      pass\n",
    (
      "tests/test_qlora.py::"
      "test_a_checkpoint_is_quantized_tensor_by_tensor_as_it_is_read[moe-nf4-g8-fsdp2-cp2-ep4]",
    ),
  ),
  Mutant(
    "qlora: a float8 base is stored in e5m2",
    "cpjax/training/lora/quantize.py",
    '    "float8_e4m3fn": jnp.float8_e4m3fn,\n',
    '    "float8_e4m3fn": jnp.float8_e5m2,\n',
    (
      "tests/test_qlora.py::"
      "test_a_quantized_base_is_the_numpy_scheme_and_its_logits_transformers[moe-float8-channel]",
    ),
  ),
  Mutant(
    "qlora: merging keeps the quantized weights",
    "cpjax/training/lora/adapters.py",
    "  _dequantize(model)\n",
    "",
    (
      "tests/test_qlora.py::"
      "test_merging_into_a_quantized_base_gives_a_plain_checkpoint_transformers_loads",
    ),
  ),
  Mutant(
    "qlora: a quantized weight's scales split like the weight over tp",
    "cpjax/models/gemma4/partitioning.py",
    "    if \"scale\" in path[7:]:  # a quantized weight's scales [out, groups] (qwix's QArray)\n",
    "    if False:\n",
    (
      "tests/test_qlora.py::test_a_quantized_weights_scales_split_with_its_rows_or_divisible_groups",
    ),
  ),
  Mutant(
    "lora: the adapters' scale ignores alpha",
    "cpjax/training/lora/adapters.py",
    "  alpha = settings.alpha * (math.sqrt(settings.rank) if settings.use_rslora else 1.0)",
    "  alpha = settings.rank * (math.sqrt(settings.rank) if settings.use_rslora else 1.0)",
    ("tests/test_lora.py::test_adapter_gradients_equal_the_dense_reference",),
  ),
  Mutant(
    "lora: rsLoRA scales by 1 / r",
    "cpjax/training/lora/adapters.py",
    "  alpha = settings.alpha * (math.sqrt(settings.rank) if settings.use_rslora else 1.0)",
    "  alpha = settings.alpha",
    ("tests/test_lora_peft.py::test_cpjax_loads_what_peft_saves",),
  ),
  Mutant(
    "lora: PEFT's A is saved untransposed",
    "cpjax/training/lora/peft_format.py",
    '    tensors[key + ".lora_A.weight"] = np.ascontiguousarray(np.asarray(a[...], np.float32).T)',
    (
      '    tensors[key + ".lora_A.weight"] = np.ascontiguousarray(\n'
      "      np.asarray(a[...], np.float32).reshape(a.shape[::-1])\n"
      "    )"
    ),
    ("tests/test_lora_peft.py::test_peft_loads_what_cpjax_saves_and_merging_equals_it",),
  ),
  Mutant(
    "lora: merging adds B A untransposed into a [out, in] weight",
    "cpjax/training/lora/adapters.py",
    "    delta = delta.T",
    "    delta = delta.reshape(delta.shape[::-1])",
    ("tests/test_lora_peft.py::test_peft_loads_what_cpjax_saves_and_merging_equals_it",),
  ),
  Mutant(
    "lora: the adapters' term stays float32 (PEFT casts it back)",
    "cpjax/training/lora/adapters.py",
    "      return super().einsum(einsum_str, *operands, **kwargs).astype(dtype)",
    "      return super().einsum(einsum_str, *operands, **kwargs)",
    ("tests/test_lora.py::test_bfloat16_base_keeps_the_activation_dtype",),
  ),
  Mutant(
    "tp: a column-split projection's A is not split",
    "cpjax/models/gemma4/partitioning.py",
    '      return P("tp", None) if split == "columns" else P()',
    "      return P()",
    ("tests/test_lora.py::test_lora_partition_rule_follows_the_weight",),
  ),
  Mutant(
    "train: the frozen base is the closure's, not the argument",
    "cpjax/training/step.py",
    "    output = forward(merge(params, frozen), batch, context)",
    "    output = forward(merge(params, default_frozen), batch, context)",
    ("tests/test_lora.py::test_lora_cp_gradients_equal_single_device",),
  ),
  Mutant(
    "resume: a different LoRA run is not refused",
    "cpjax/training/checkpointing.py",
    '  if saved.get("lora") != current.get("lora"):  # what the saved parameters are',
    "  if False:",
    (
      "tests/test_lora_training.py::test_adapters_train_resume_bit_identically_and_merge_into_the_froz"
      "en_bas"
      "e",
    ),
  ),
  Mutant(
    "gemma4 config: the vision rope type goes unchecked",
    "cpjax/models/gemma4/hf_config.py",
    '    _check_rope(rope, "vision_config.rope_parameters", ("default", "axial"))',
    '    _check_rope(rope, "vision_config.rope_parameters", ("default", "axial", "linear"))',
    ("tests/test_gemma4_published.py",),
  ),
  # --- the docs' traps and the plan's 4-bit bytes (issues 63, 65)
  Mutant(
    "train: a bare --cp drops a recipe's other mesh axes again",
    "cpjax/cli/train.py",
    '  others = ",".join(f"{k}={v}" for k, v in sizes.items() if k != "cp")',
    '  others = ""',
    ("tests/test_run_config.py::test_unknown_keys_and_wrong_types_are_one_line_exit_two",),
  ),
  Mutant(
    "train: a checkpoint trained on synthetic rows says nothing",
    "cpjax/training/trainer/loop.py",
    "  if run.checkpoint and not run.dataset.path:",
    "  if run.checkpoint and not run.checkpoint:",
    ("tests/test_trainer.py::test_a_checkpoint_trained_without_data_is_said_loudly",),
  ),
  Mutant(
    "abstract models: traced in quadratic time again",
    "cpjax/parallel/_abstract.py",
    '  tracer._origin_msg = lambda self: ""',
    "  tracer._origin_msg = original",
    ("tests/test_plan.py::test_linear_tracing_leaves_the_unread_origin_message_unbuilt",),
  ),
  Mutant(
    "closed form: no dispatch buffers for an MoE without ep",
    "cpjax/training/plan/closed_form.py",
    "    blocks = 1 if ep == 1 else ep if capacity_factor is None else min(ep, capacity_factor)",
    "    blocks = 0 if ep == 1 else ep if capacity_factor is None else min(ep, capacity_factor)",
    ("tests/test_run_config.py::test_each_published_size_recipe_fits_its_device",),
  ),
  Mutant(
    "closed form: LoRA on GPUs keeps full fine-tuning's values a layer",
    "cpjax/training/plan/closed_form.py",
    "    values = GPU_LAYER_VALUES if lora_rank is None else GPU_LAYER_VALUES_LORA",
    "    values = GPU_LAYER_VALUES",
    ("tests/test_run_config.py::test_each_published_size_recipe_fits_its_device",),
  ),
  Mutant(
    "plan: rows planned with video compile a step without the frames",
    "cpjax/training/plan/compiled.py",
    "    batch = _with_video(batch, cfg, video, after=0 if clip is None else clip[2], host=host)",
    "    pass",
    ("tests/test_plan.py::test_a_plan_with_video_compiles_the_frames_into_the_step",),
  ),
  Mutant(
    "vision tower: every rank runs every image and frame under CP",
    "cpjax/models/gemma4/model.py",
    "  if cp is None or cp.layout.cp_size == 1:\n    return features(*inputs)",
    "  if True:\n    return features(*inputs)",
    ("tests/test_plan.py::test_a_plan_with_video_compiles_the_frames_into_the_step",),
  ),
  Mutant(
    "closed form: the vision tower's frames counted on every rank",
    "cpjax/training/plan/closed_form.py",
    "  mine = -(-n // cp)  # frames a rank (each once across the ranks)",
    "  mine = n",
    (
      "tests/test_plan.py::test_the_closed_forms_vision_tower_follows_xla_tpu[None]",
      "tests/test_plan.py::test_the_closed_forms_vision_tower_follows_xla_tpu[4]",
    ),
  ),
  Mutant(
    "closed form: the 12B's patches counted once, not as XLA:TPU lays them out",
    "cpjax/training/plan/closed_form.py",
    "    here = UNIFIED_PIXEL_COPIES * pixels",
    "    here = pixels",
    ("tests/test_plan.py::test_the_closed_forms_vision_tower_follows_xla_tpu[4]",),
  ),
  Mutant(
    "plan: a 4-bit value counted as a byte again",
    "cpjax/parallel/_placement.py",
    "    total += -(-int(np.prod(shape)) * jax.dtypes.itemsize_bits(x.dtype) // 8)",
    "    total += int(np.prod(shape)) * np.dtype(x.dtype).itemsize",
    (
      "tests/test_plan.py::test_a_4bit_value_is_half_a_byte_and_a_shard_counts_once",
      "tests/test_qlora.py::test_a_quantized_base_compiles_to_the_closed_form_state",
    ),
  ),
)


def scratch_copy() -> str:
  """The tracked tree (and untracked, not ignored files) in a new folder."""
  files = subprocess.run(
    ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
    cwd=ROOT,
    check=True,
    capture_output=True,
    text=True,
  ).stdout.split()
  dest = tempfile.mkdtemp(prefix="cpjax-mutant-")
  for rel in files:
    src = os.path.join(ROOT, rel)
    if os.path.isfile(src):
      os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
      shutil.copy2(src, os.path.join(dest, rel))
  return dest


def apply(mutant: Mutant, root: str) -> None:
  path = os.path.join(root, mutant.file)
  with open(path) as f:
    text = f.read()
  if text.count(mutant.old) != 1:
    raise LookupError(
      f"{mutant.name}: the text to mutate occurs {text.count(mutant.old)} "
      f"times in {mutant.file}, not once"
    )
  with open(path, "w") as f:
    f.write(text.replace(mutant.old, mutant.new))


def caught(mutant: Mutant) -> tuple[bool, float, str]:
  """(a test failed, seconds, the first failure or pytest's last line)."""
  root = scratch_copy()
  try:
    apply(mutant, root)
    env = {**os.environ, "PYTHONPATH": root, "PYTHONDONTWRITEBYTECODE": "1"}
    # The copy's cpjax, not the installed (editable) one.
    where = subprocess.run(
      [sys.executable, "-c", "import cpjax; print(cpjax.__file__)"],
      cwd=root,
      env=env,
      capture_output=True,
      text=True,
      check=True,
    )
    assert where.stdout.startswith(root), where.stdout
    start = time.perf_counter()
    proc = subprocess.run(
      [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-rfE",
        "-p",
        "no:cacheprovider",
        "-m",
        "",
        *mutant.tests,
      ],
      cwd=root,
      env=env,
      capture_output=True,
      text=True,
    )
    # 1 with a FAILED test: caught. 0: survived. An import or collection error
    # (ERROR, or any other exit status) is a broken entry, not a catch.
    failed = [line for line in proc.stdout.splitlines() if line.startswith("FAILED ")]
    if proc.returncode not in (0, 1) or (proc.returncode == 1 and not failed):
      raise RuntimeError(
        f"{mutant.name}: pytest exited {proc.returncode} without a failed "
        f"test:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
      )
    summary = failed[0][len("FAILED ") :] if failed else proc.stdout.strip().splitlines()[-1]
    return bool(failed), time.perf_counter() - start, summary
  finally:
    shutil.rmtree(root, ignore_errors=True)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", nargs="+", default=None, help="mutant names (substrings)")
  parser.add_argument("--list", action="store_true", help="print the mutants and exit")
  args = parser.parse_args(argv)
  chosen = [m for m in MUTANTS if not args.only or any(o in m.name for o in args.only)]
  if args.list:
    for m in chosen:
      print(f"{m.name}  [{m.file}]  ->  {' '.join(m.tests)}")
    return 0
  survivors = []
  for m in chosen:
    ok, seconds, summary = caught(m)
    print(
      f"{'caught  ' if ok else 'SURVIVED'} {seconds:6.1f} s  {m.name}\n         {summary[:150]}",
      flush=True,
    )
    if not ok:
      survivors.append(m.name)
  print(f"{len(chosen) - len(survivors)} caught, {len(survivors)} survived")
  return 1 if survivors else 0


if __name__ == "__main__":
  sys.exit(main())
