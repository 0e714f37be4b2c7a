"""The run's compile cache (`compile_cache`): a restart reads its programs
from it and trains the numbers of a fresh compile; a bad cache path is a
ConfigError."""

import os
import shutil

import jax
import pytest

from scape_jax import train as trainer
from scape_jax.train import config as config_lib
from scape_jax.train.metrics import read_jsonl
from tests.tiny_runs import run_config


def _train_losses(out_dir):
  rows = read_jsonl(os.path.join(out_dir, 'metrics.jsonl'))
  return [r['loss'] for r in rows if r['split'] == 'train']


def test_a_restart_loads_its_programs_from_the_compile_cache(corpus,
                                                             tmp_path):
  """The first start compiles the train step's programs (its cache is
  empty: no hits) into the run's compile cache; a restart reads them from
  there (JAX's cache-hit events) and trains the numbers of the first start,
  whose programs were compiled. The process's own cache (conftest's) is
  back after each run."""
  hits = []

  def listen(event, **_):
    if event == '/jax/compilation_cache/cache_hits':
      hits.append(event)

  method = ('--config.optimizer.name=scape',
            '--config.optimizer.scape.density=0.1', '--config.steps=4',
            '--config.compile_cache=xla_cache', '--config.ckpt_every=2')
  own = jax.config.jax_compilation_cache_dir
  min_time = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  jax.monitoring.register_event_listener(listen)
  try:
    out = tmp_path / 'run'
    compiled = trainer.train(run_config(corpus, out, *method))
    assert not hits
    assert any(name.startswith('jit_local_step')
               for name in os.listdir(out / 'xla_cache'))
    assert jax.config.jax_compilation_cache_dir == own
    shutil.rmtree(out / 'ckpt' / '4')  # preempted after step 2's save
    resumed = trainer.train(run_config(corpus, out, *method))
  finally:
    jax.monitoring.unregister_event_listener(listen)
    jax.config.update('jax_persistent_cache_min_compile_time_secs', min_time)
  assert resumed['start_step'] == 2 and hits
  assert resumed['losses'] == compiled['losses'][2:]
  assert _train_losses(out) == compiled['losses']
  assert jax.config.jax_compilation_cache_dir == own


def test_a_compile_cache_that_is_a_file_is_a_config_error(corpus, tmp_path):
  (tmp_path / 'cache').write_text('not a directory')
  with pytest.raises(config_lib.ConfigError, match=(
      r"compile_cache='cache': .*/cache is not a directory; give a directory "
      r"for JAX's compilation cache, or 'auto'")):
    trainer.train(run_config(corpus, tmp_path, '--config.compile_cache=cache'))
  with pytest.raises(config_lib.ConfigError, match=(
      "compile_cache must be 'auto' or a directory, got ''")):
    run_config(corpus, tmp_path, '--config.compile_cache=')
