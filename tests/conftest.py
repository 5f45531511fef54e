"""Shared pytest setup: tests marked ``gpu`` are skipped unless jax sees a
GPU (markers are declared in pyproject.toml)."""
import functools
import os

# Mosaic GPU's interpreter runs each simulated warpgroup as a jax computation
# on its own Python thread; the warpgroups meet at barriers inside
# io_callbacks, which XLA runs on its CPU worker pool (one thread per core
# unless PJRT_NPROC says otherwise).  On a 2-core machine the kernel's own
# callback and one warpgroup's barrier wait filled that pool, and the other
# warpgroups' callbacks never ran: the test hung (py-spy showed it).  A pool
# wider than the callbacks that can wait at once (the kernel's, 3
# warpgroups') removes the deadlock.  Read when jax creates its CPU client.
os.environ.setdefault("PJRT_NPROC", "16")

# XLA:CPU compiles the suite's programs at backend optimisation level 0,
# unless XLA_FLAGS sets a level or JAXATTN_TEST_XLA_OPT=default.  The
# suite is bound by XLA:CPU compiles of interpret-mode kernels, which users
# never run on the CPU; the references, which they may, give the same bits
# at both levels (test_extremes.py::test_references_do_not_depend_on_xla_
# optimisation compares them).  docs/design.md ("The CPU suite") has the
# times.  Not on a machine with an NVIDIA driver: the GPU tests compile
# what users run.
if (os.environ.get("JAXATTN_TEST_XLA_OPT", "0") == "0"
    and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")
    and not os.path.exists("/dev/nvidiactl")):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_backend_optimization_level=0").strip()

import pytest  # noqa: E402

# jax's persistent compilation cache, shared by the xdist workers of one run
# (``pytest -n``, as ``dev.sh test``): the tests of a file are spread over
# the workers, which compile many of the same interpret-mode kernels, and a
# worker compiles again after ``jax.clear_caches`` (below); docs/design.md
# ("The CPU suite") has the times.  The controller makes one directory per
# run and removes it at the end, so that a run never reads another's
# executables.  JAXATTN_TEST_JIT_CACHE=0 turns it off.
_CACHE_ENV = "JAXATTN_TEST_JIT_CACHE_DIR"
_CACHE_PREFIX = "jaxattn-jit-cache-"


# Cells of parametrized tests that run only in the extended suite
# (``bash dev.sh test --extended``, or ``-m extended``).  Each repeats, on
# the same backend and in the same test, a path that a sibling cell runs in
# CI: a method that is another's kernel with other dtype flags (fp16_fp32
# and fp16 are fp32's; int8's and fmha_int8's nonfinite handling is sage's;
# a float16 cache reads alike for fp32 and PASA), a quantizer
# option or a kernel on a second shape, a second case of a feature (the
# window's edge cases are the bounds' code, which
# test_float32_matches_jax_nn runs; int8's and fp8's index masks are sage's
# kernel; the reference's non-finite rule is one function for every
# method), a second method through one shared piece (every method's
# gradient is grad.py's one backward; the torch shim and the Flax layers
# pass a method through), or a second dtype through one cast.  The lists
# are checked against what is collected, so a renamed cell fails the run.
EXTENDED_CELLS = {
    "tests/test_no_host_wait.py::test_the_runtime_factor_with_a_bias_and_the_log_sum_exp":
        ["running-reference", "per_block-triton"],
    "tests/test_no_host_wait.py::test_the_factor_chosen_on_the_device_is_the_explicit_choice":
        ["mosaic-per_block", "triton-per_block", "reference-per_block",
         "reference-nearest", "triton-nearest", "reference-running",
         "triton-running"],
    "tests/test_no_host_wait.py::test_nonfinite_inputs_with_segment_ids":
        ["triton-pasa", "mosaic-pasa", "reference-int8"],
    "tests/test_api.py::test_nonfinite_reaches_the_rows_it_reaches_in_float32":
        ["triton-fp16_fp32", "triton-fp16", "triton-int8", "mosaic-fp16_fp32",
         "mosaic-int8", "mosaic-fmha_int8", "triton-fmha_int8",
         "reference-int8", "reference-fmha_int8", "reference-fp8",
         "mosaic-fp8", "mosaic-pasa", "mosaic-sage"],
    "tests/test_flash_pasa.py::test_pasa_is_fp16_fp32_where_no_block_is_shifted":
        ["hybrid-10.0-mosaic", "uniform-0.5-mosaic", "uniform-0.5-triton"],
    "tests/test_grad.py::test_gradient_and_residual_in_one_call":
        ["fp16_fp32-mosaic", "int8-mosaic", "fmha_int8-mosaic", "fp32-mosaic",
         "fp16_fp32-triton", "fp16-triton", "int8-triton", "fmha_int8-triton",
         "fp16_fp32-reference", "fmha_int8-reference", "fp8-reference",
         "int8-reference", "pasa-reference", "fp16-reference"],
    "tests/test_index_mask.py::test_triton_kernels_match_reference_with_dense_mask":
        ["fp16_fp32-bottom_right_lengths",
         "fp16_fp32-bottom_right_window_segments",
         "fp16-bottom_right_lengths", "fp16-bottom_right_window_segments",
         "int8-bottom_right_lengths", "fmha_int8-bottom_right_lengths",
         "fmha_int8-bottom_right_window_segments",
         "int8-packed_causal_window", "int8-bottom_right_window_segments",
         "sage-window_1", "sage-window_wider_than_sequence",
         "sage-window_lengths", "sage-bottom_right_window_segments",
         "sage-bottom_right_lengths", "pasa-packed_causal_window",
         "pasa-bottom_right_lengths", "fp16-packed_causal_window",
         "fp16_fp32-packed_causal_window", "fp32-window_1",
         "fp32-window_lengths", "fp32-window_wider_than_sequence"],
    "tests/test_pallas_quantized.py::test_kernel_matches_reference":
        ["(1, 200, 300, 2, 2, 64, True)-sage-{'preset': 'sage2-4b'}-0.0001",
         "(1, 200, 300, 2, 2, 64, True)-sage-{'preset': 'sage1'}-0.0001",
         "(1, 200, 300, 2, 2, 64, True)-sage-{'qk_granularity': 'token', "
         "'qk_dtype': 'int4'}-0.0001",
         "(1, 200, 300, 2, 2, 64, True)-int8-{'v_granularity': 'block'}-0.0001",
         "(1, 200, 300, 2, 2, 64, True)-int8-{'pv_dtype': 'fp16'}-0.001",
         "(1, 200, 300, 2, 2, 64, True)-fmha_int8-{}-0.005",
         "(2, 70, 150, 4, 2, 96, False)-sage-{'preset': 'sage2-4b'}-0.0001"],
    "tests/test_mosaic.py::test_mosaic_one_warpgroup_equals_two":
        ["fp8", "fmha_int8", "sage", "fp32"],
    "tests/test_sage.py::test_calls_beyond_the_bias_limit_run_by_query_chunks":
        ["triton", "mosaic"],
    "tests/multidevice_cases.py::test_ring_attention_every_method":
        ["fp16_fp32-reference-False", "fp16-reference-False",
         "int8-reference-False", "fmha_int8-reference-False",
         "pasa-reference-False", "sage-reference-False",
         "fp32-reference-False"],
    "tests/test_mosaic.py::test_mosaic_256_key_blocks_match_reference":
        ["fmha_int8", "int8"],
    "tests/multidevice_cases.py::test_batch_and_head_sharding_is_shard_local":
        ["reference-fp16", "reference-fp16_fp32", "reference-fp8"],
    "tests/test_mosaic.py::test_mosaic_pads_head_dims_to_its_tiles":
        ["fp32-{}-96", "pasa-{}-96", "fp8-{}-80"],
    "tests/test_mosaic.py::test_mosaic_interpreted_matches_reference":
        ["fp16_fp32-{}", "sage-{'preset': 'sage1'}",
         "int8-{'pv_dtype': 'fp16'}",
         "int8-{'v_granularity': 'block', 'block_k': 128}",
         "fp8-{'granularity': 'block', 'block_k': 128}"],
    "tests/test_mosaic.py::test_mosaic_index_mask_matches_dense_mask_reference":
        ["fp32-segments", "pasa-window", "fp8-segments", "sage-segments",
         "fp32-window"],
    "tests/test_mosaic.py::test_mosaic_log_sum_exp":
        ["fp8-fp8-True"],
    "tests/test_prepare.py::test_fused_qk_equals_xla_quantizers":
        ["sage-{'qk_granularity': 'token', 'smooth_v': False}-{}",
         "sage-{'qk_granularity': 'block'}-{}",
         "sage-{'preset': 'sage1'}-{'d': 96}",
         "fp8-{'granularity': 'block'}-{}",
         "sage-{'block_k': 128, 'block_q': 64, 'warp_rows': 16}-{'t': 129}"],
    "tests/test_mosaic.py::test_mosaic_call_without_key_lengths_compiles_no_masked_step":
        ["fp8"],
    "tests/test_mosaic.py::test_mosaic_exponent_flag_runs_each_static_form":
        ["fp8"],
    "tests/test_mosaic.py::test_mosaic_row_amax_is_the_written_rows_max":
        ["float16"],
    "tests/multidevice_cases.py::test_interpreter_callbacks_run_unpartitioned":
        ["triton-int8", "triton-fmha_int8"],
    "tests/test_mosaic.py::test_mosaic_block_k_scales_equal_per_key_scales":
        ["fp8-{'granularity': 'block', 'block_k': 128}"],
    "tests/test_paged.py::test_kernel_matches_reference":
        ["fp32-float16", "int8-nosmooth"],
    "tests/test_paged.py::test_paged_equals_dense_bit_for_bit":
        ["pasa-float16", "int8-nosmooth"],
    "tests/test_prepare.py::test_sage_inputs_equal_reference":
        ["{'qk_granularity': 'token'}", "{'qk_granularity': 'block'}",
         "{'preset': 'sage2-4b'}",
         "{'smooth_q': False, 'smooth_k': False, 'smooth_v': False}"],
    "tests/test_mosaic.py::test_mosaic_pasa_matches_triton_and_reference":
        ["(True, 150, 200, 200, 64, 64)"],
    "tests/test_flax.py::test_nnx_training_step_loss_falls_as_with_jax_nn":
        ["sage"],
    "tests/test_prepare.py::test_v_in_mosaic_key_order":
        ["sage"],
    "tests/test_flash_pasa.py::test_keys_keep_the_scale_only_where_scores_could_overflow":
        ["triton"],
    "tests/test_flash_pasa.py::test_pasa_bound_and_what_lies_beyond":
        ["mosaic"],
    "tests/test_index_mask.py::test_int8_v_scale_per_segment":
        ["reference"],
    "tests/test_flash_pasa.py::test_every_method_at_the_extreme_head_dims":
        ["32"],
    "tests/multidevice_cases.py::test_gradients_stay_shard_local":
        ["spec1"],
    "tests/multidevice_cases.py::test_sequence_sharding_under_jit_takes_the_ring":
        ["False"],
    "tests/test_grad.py::test_gradient_matches_float32_jax_nn":
        ["int8-reference-bias", "int8-reference-mask",
         "fmha_int8-reference-bias", "fmha_int8-reference-mask",
         "fp8-reference-mask", "sage-reference-bias",
         "fp16_fp32-reference-bias", "fp16_fp32-reference-mask",
         "fp16-reference-bias"],
    "tests/test_grad.py::test_triton_backward_kernel_equals_xla_backward":
        ["37-45-32-False", "50-30-40-True"],
    "tests/test_pallas_flash.py::test_kernel_matches_reference":
        ["(1, 37, 37, 2, 2, 64, False)-fp16",
         "(1, 37, 37, 2, 2, 64, False)-fp16_fp32",
         "(1, 150, 70, 4, 2, 96, True)-fp16",
         "(1, 150, 70, 4, 2, 96, True)-fp16_fp32",
         "(1, 130, 130, 2, 1, 64, True)-pasa"],
    "tests/test_flash_pasa.py::test_reference_accuracy_vs_float64":
        ["int8-causal_pad", "fp8-causal_pad", "pasa-causal_pad",
         "fmha_int8-causal_pad", "fp16_fp32-causal_pad", "fp16-causal_pad",
         "fp16-full", "fp16_fp32-full"],
    "tests/test_prepare.py::test_kernel_inputs_v_equals_reference_transposed":
        ["int8-{'v_granularity': 'block'}",
         "fp8-{'granularity': 'block', 'block_k': 128}"],
    "tests/test_torch.py::test_outputs_follow_the_inputs_memory_order":
        ["eager-gqa", "compiled-mha_s_eq_t"],
    "tests/test_index_mask.py::test_gradients_match_the_dense_mask":
        ["reference-window_lengths", "reference-bottom_right_window_segments"],
    "tests/test_no_host_wait.py::test_default_calls_have_no_branch_outside_the_kernels":
        ["pasa-mosaic-False"],
    "tests/test_prepare.py::test_rows_operand_tile_mean_is_the_query_block_mean":
        ["False-None"],
    "tests/test_int8_fmha_fp8.py::test_causal_padding_bias_and_numpy_emulation":
        ["fp8_block"],
    "tests/test_no_host_wait.py::test_nonfinite_rows_with_segments_equal_the_dense_rule":
        ["True-None", "False-window2"],
    "tests/test_api.py::test_quantized_methods_propagate_nonfinite":
        ["int8-reference", "fmha_int8-reference"],
    "tests/test_flash_pasa.py::test_pasa_float64_equals_attention_to_1e_10":
        ["0.3", "0.9"],
    "tests/test_torch.py::test_methods_match_jaxattn_float16":
        ["pasa", "fp16"],
    "tests/test_torch.py::test_autograd_matches_sdpa":
        ["HND-int8", "NHD-int8"],
    "tests/test_api.py::test_output_dtype_is_query_dtype":
        ["pasa-bfloat16", "int8-bfloat16", "pasa-float32"],
    "tests/test_flax.py::test_nnx_layer_matches_flax_default":
        ["sage-bfloat16"],
    "tests/test_flax.py::test_linen_layer_matches_flax_default":
        ["sage-bfloat16"],
}


def pytest_addoption(parser):
  parser.addoption("--extended", action="store_true",
                   help="also run the cells in tests/conftest.py's "
                        "EXTENDED_CELLS, and 100 fuzz examples")


def _extended(config) -> bool:
  return (config.getoption("--extended")
          or "extended" in (config.getoption("markexpr") or ""))


def pytest_configure(config):
  if config.getoption("--extended"):
    os.environ.setdefault("JAXATTN_FUZZ_EXAMPLES", "100")
  if os.environ.get("JAXATTN_TEST_JIT_CACHE", "1") == "0":
    return
  if not hasattr(config, "workerinput"):   # the xdist controller, or no xdist
    if getattr(config.option, "numprocesses", None):
      _remove_stale_caches()
      import tempfile
      os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix=_CACHE_PREFIX)
      config._jaxattn_jit_cache_owner = True
    return
  if _CACHE_ENV in os.environ:   # a worker (the controller's environment)
    import jax
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # No size limit: a limit turns on the cache's file lock, but also a scan
    # of the whole directory on every write (thousands of entries a run),
    # which slowed the suite down.  Unlocked, a worker may read an entry the
    # other is still writing; jax then warns and compiles it again.


def _remove_stale_caches(max_age_s: float = 86400.0):
  """Removes the cache directories of runs killed before they could (older
  than a day, so that a concurrent run's is left alone)."""
  import glob
  import shutil
  import tempfile
  import time
  for path in glob.glob(os.path.join(tempfile.gettempdir(),
                                     _CACHE_PREFIX + "*")):
    try:
      if time.time() - os.path.getmtime(path) > max_age_s:
        shutil.rmtree(path, ignore_errors=True)
    except OSError:
      pass


def pytest_unconfigure(config):
  if getattr(config, "_jaxattn_jit_cache_owner", False):
    import shutil
    shutil.rmtree(os.environ.pop(_CACHE_ENV), ignore_errors=True)


def _memory_maps() -> int | None:
  """The number of this process's memory mappings (None off Linux)."""
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)
  except OSError:
    return None


def _max_memory_maps() -> int:
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except (OSError, ValueError):
    return 65530


@pytest.fixture(autouse=True)
def _release_compiled_code():
  """Drops jax's compiled executables when this process's memory
  mappings pass half of ``vm.max_map_count``.

  Every executable XLA's CPU backend compiles holds about three mappings
  of its JIT code until jax's caches let it go, and an xdist worker of
  the suite compiles tens of thousands (the interpret-mode kernels).  At
  the limit (65530) the next compile's mmap fails and the worker died
  with SIGSEGV while unwinding the compile error (a core at 65503
  mappings; the crashed test varied with the order).
  ``jax.clear_caches`` frees them (300 compiles: 428 -> 1402 -> 500
  mappings)."""
  yield
  maps = _memory_maps()
  if maps is not None and maps > _max_memory_maps() // 2:
    import gc

    import jax
    jax.clear_caches()
    gc.collect()


@functools.cache
def _has_gpu() -> bool:
  import jax
  try:
    return any(d.platform in ("gpu", "cuda", "rocm") for d in jax.devices())
  except RuntimeError:
    return False


def pytest_collection_modifyitems(config, items):
  # The tests marked ``slow`` (10-45 s each on 2 cores, compile-bound) go
  # first, so that the run ends on short tests instead of one worker
  # finishing a long test while the other idles.  (dev.sh runs xdist's
  # worksteal scheduler: each worker starts on half of the list and takes
  # half of the other's queue when it runs dry.)
  items.sort(key=lambda item: "slow" not in item.keywords)
  _mark_extended(config, items)
  gpu_items = [item for item in items if "gpu" in item.keywords]
  if not gpu_items or _has_gpu():
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU (jax.devices() has none)")
  for item in gpu_items:
    item.add_marker(skip)


def pytest_collection_finish(session):
  """Moves what the imports and the collection made (jax, torch, flax,
  the test modules) out of the garbage collector's reach, and lets the
  young generation grow to 50,000 objects before a collection: the
  collector walked those modules' objects again and again while tests
  traced, 4-6% of a run's time (docs/design.md, "The CPU suite")."""
  import gc
  gc.collect()
  gc.freeze()
  gc.set_threshold(50_000, 20, 100)


@pytest.fixture
def poison_allocator():
  """Fills the device allocator with NaN buffers of a shape before a kernel
  runs, so that an output element the kernel never writes shows up as NaN
  or as a mismatch instead of a stale correct value."""
  import jax.numpy as jnp

  def poison(shape):
    for _ in range(3):
      jnp.full(shape, jnp.nan, jnp.float32).block_until_ready()

  return poison


def _mark_extended(config, items):
  """Marks the cells of :data:`EXTENDED_CELLS` ``extended`` and, unless the
  run asks for them (or names them as node ids), deselects them.  A listed
  cell of a collected test that is not collected is an error (the list
  went stale), unless the run selects by ``-k`` or node id."""
  by_node_id = any("::" in arg for arg in config.args)
  found = {}
  for item in items:
    function, _, cell = item.nodeid.partition("[")
    if cell[:-1] in EXTENDED_CELLS.get(function, ()):
      item.add_marker(pytest.mark.extended)
      found.setdefault(function, set()).add(cell[:-1])
  collected = {item.nodeid.partition("[")[0] for item in items}
  for function, cells in EXTENDED_CELLS.items():
    missing = set(cells) - found.get(function, set())
    if (function in collected and missing and not by_node_id
        and not config.getoption("keyword")):
      raise pytest.UsageError(
          f"EXTENDED_CELLS lists cells of {function} that were not "
          f"collected: {sorted(missing)}")
  if _extended(config):
    return
  named = set(config.args)
  keep = [item for item in items
          if "extended" not in item.keywords or item.nodeid in named]
  if len(keep) < len(items):
    kept = set(map(id, keep))
    config.hook.pytest_deselected(
        items=[item for item in items if id(item) not in kept])
    items[:] = keep
