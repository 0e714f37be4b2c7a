"""The tier of each test: `unit`, `integration` or `system` (pytest markers).

* unit: the library against NumPy/optax references, parsers, config checks,
  small compiled programs; no trainer run, no subprocess. `make test-fast`.
* integration: the trainer in-process (`scape_jax.train.train`, train.py's
  `main`, a bench driver's `main`), the trainer's program of a real model
  built and stepped (`build_program`), or a whole update with its Pallas
  kernels in Pallas' interpreter (slow on the CPU).
* system: other processes: train.py, pip or python subprocesses,
  multi-process `jax.distributed`, network namespaces, mounts.

`conftest.py` marks every collected test from `MODULE_TIERS` (by the test
file's name), with `TEST_TIERS` naming the tests of a module that belong to
another tier (by function name: every parametrisation). A marker written in
the test file itself (`@pytest.mark.system`) wins over both.

A new test file must be added to `MODULE_TIERS`: until it is, its tests are
marked `system` (`UNKNOWN_TIER`, so `make test-fast` never picks up an
unclassified slow file) and `tests/test_tiers.py` fails, naming the file.
"""

UNIT, INTEGRATION, SYSTEM = 'unit', 'integration', 'system'
TIERS = (UNIT, INTEGRATION, SYSTEM)
UNKNOWN_TIER = SYSTEM

MODULE_TIERS = {
    'test_adams': UNIT,
    'test_alg2': UNIT,
    'test_architecture': UNIT,
    'test_bench': SYSTEM,  # runs bench/comm_volume.py as a subprocess
    'test_bench_cli': SYSTEM,  # bench/ scripts as subprocesses
    'test_bench_overhead': INTEGRATION,
    'test_checkpoint': UNIT,
    'test_cli': SYSTEM,
    'test_comm': UNIT,
    'test_compile_cache': INTEGRATION,
    'test_compile_profile': SYSTEM,  # bench/first_step.py --profile
    'test_composition': UNIT,
    'test_config': UNIT,
    'test_cost': UNIT,
    'test_data': UNIT,
    'test_demo': UNIT,
    'test_density_schedule': UNIT,
    'test_diloco': UNIT,
    'test_diloco_train': INTEGRATION,
    'test_export': UNIT,
    'test_eval_downstream': UNIT,
    'test_examples': SYSTEM,  # docs/examples.md's blocks as subprocesses
    'test_fcdp': INTEGRATION,
    'test_fcdp_bench': SYSTEM,  # bench/fcdp_volume.py as a subprocess
    'test_gpu': UNIT,
    'test_hf': INTEGRATION,
    'test_hf_convert': UNIT,
    'test_interleave': UNIT,
    'test_kernels': UNIT,
    'test_layouts': INTEGRATION,
    'test_lora': UNIT,
    'test_masks': UNIT,
    'test_metrics': UNIT,
    'test_models': UNIT,
    'test_multiprocess': SYSTEM,
    'test_network': SYSTEM,
    'test_no_copies': UNIT,
    'test_offload': INTEGRATION,
    'test_outdir': SYSTEM,
    'test_outer_placement': UNIT,
    'test_packaging': SYSTEM,
    'test_radius': UNIT,
    'test_radix': UNIT,
    'test_readme': UNIT,
    'test_resilience': INTEGRATION,
    'test_run_output': INTEGRATION,
    'test_scan_layers': UNIT,  # two trainer runs marked integration
    'test_scape': UNIT,
    'test_scape_local_adam': UNIT,
    'test_step': UNIT,
    'test_tiers': UNIT,
    'test_topk': UNIT,
    'test_traffic': UNIT,
    'test_train': INTEGRATION,
    'test_update_count': UNIT,
    'test_vocab_size': INTEGRATION,
    'test_wire': UNIT,
}

# (module, test function) -> tier, for the tests of a mixed module.
TEST_TIERS = {
    ('test_cli', 'test_bad_process_options_are_usage_errors'): UNIT,
    ('test_cli', 'test_good_process_options_parse'): UNIT,
    ('test_cli', 'test_two_corpora_of_one_name_do_not_share_the_default_dir'):
        UNIT,
    ('test_cli', 'test_a_data_dir_beside_a_prepared_corpus_is_refused'): UNIT,
    ('test_config', 'test_the_program_refuses_pallas_on_cpu_and_notes_idle_devices'):
        INTEGRATION,
    ('test_demo', 'test_trainer_resumes_bit_exactly'): INTEGRATION,
    ('test_offload', 'test_offload_changes_no_number_over_20_steps'): UNIT,
    ('test_offload', 'test_state_shardings_carry_the_memory_kind'): UNIT,
    ('test_offload', 'test_a_missing_memory_kind_names_the_available_ones'):
        UNIT,
    ('test_outdir', 'test_a_second_lock_on_one_out_dir_names_the_holder'): UNIT,
    ('test_outdir', 'test_outputs_of_the_wrong_kind_exit_2_before_compiling'):
        INTEGRATION,
    ('test_outdir', 'test_skipped_step_lines_come_in_step_order'): INTEGRATION,
    ('test_outdir', 'test_a_mesh_change_error_is_at_most_5_lines'): UNIT,
    ('test_outdir', 'test_peer_watch_names_a_silent_peer_and_a_peer_that_failed'):
        UNIT,
    ('test_radius', 'test_trainer_resumes_bit_exactly_and_logs_bytes_per_kind'):
        INTEGRATION,
    ('test_readme', 'test_readme_block_runs'): SYSTEM,
    ('test_run_output', 'test_flops_of_llama_tiny_by_hand'): UNIT,
    ('test_scape', 'test_the_pallas_select_gives_the_sort_run'): INTEGRATION,
    ('test_run_output',
     'test_log_lines_never_share_a_terminal_line_with_the_bar'): SYSTEM,
    ('test_update_count', 'test_a_skipped_update_is_a_dropped_batch'):
        INTEGRATION,
    ('test_update_count',
     'test_radius_resumed_with_an_earlier_resample_is_refused'): INTEGRATION,
}


# Scheduling under `make test` (pytest-xdist, --dist loadgroup,
# --no-loadscope-reorder): each test file runs whole on one worker (its module
# fixtures are built once), except the files in SPLIT, whose tests are
# independent runs of other processes and go to whichever worker is free.
# Files in SLOW_FIRST (slowest first, by `pytest --durations`) start before
# the rest so that no long file is left running alone at the end.
SPLIT = ('test_multiprocess', 'test_cli', 'test_outdir')
SLOW_FIRST = (
    'test_multiprocess', 'test_cli', 'test_outdir', 'test_resilience',
    'test_train', 'test_topk', 'test_scape', 'test_offload', 'test_radius',
    'test_models', 'test_diloco_train', 'test_composition', 'test_packaging',
    'test_update_count', 'test_config', 'test_fcdp', 'test_wire', 'test_alg2',
    'test_kernels', 'test_demo', 'test_lora',
)


def order_key(module: str) -> int:
  """Where the tests of `module` go in the run (smaller first)."""
  if module in SLOW_FIRST:
    return SLOW_FIRST.index(module)
  return len(SLOW_FIRST)


def tier_of(module: str, function: str, own: tuple = ()) -> str:
  """The tier of test `function` of test file `module` (its name without
  .py); `own`: the tier markers written on the test itself."""
  own = tuple(dict.fromkeys(own))
  if len(own) > 1:
    raise ValueError(f'{module}::{function} is marked with {len(own)} tiers '
                     f'{own}: a test has exactly one')
  if own:
    return own[0]
  if (module, function) in TEST_TIERS:
    return TEST_TIERS[module, function]
  return MODULE_TIERS.get(module, UNKNOWN_TIER)
