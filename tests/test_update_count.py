"""A skipped (non-finite) step is as if its batch had never come: the
optimizer's count does not advance, and the trainer picks each step's program
(SCAPE's density level, Radius's step kind, DiLoCo's and Pier's phases) by
that count, not by the step number.

Each test runs the trainer twice on the same corpus: once with the update of
one step skipped (the step returns its incoming parameters and state with
`skipped = 1`, which `tests/test_step.py` checks the real step does), and
once with that step's batch dropped from the data and one step fewer. The
losses of every later step must be the same, bit for bit.
"""

import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from scape_jax import train as trainer
from scape_jax.train import config as config_lib
from scape_jax.train import guard
from scape_jax.train import methods
from scape_jax.train import resume
from scape_jax.train import trainer as trainer_lib
from scape_jax.train.metrics import read_jsonl
from tiny_runs import run_config

SKIPPED = 3  # the 0-based step whose update is skipped: a boundary below


def _skip_one_update(monkeypatch, step: int) -> list:
  """Makes the `step`-th train step run (0-based) return its incoming
  parameters and state with `skipped = 1`; returns the counts whose
  programs the steps ran, in order."""
  counts = []
  compiled = trainer_lib.StepPrograms.__call__

  def call(self, count):
    exe, nbytes = compiled(self, count)

    def run(params, opt_state, batch):
      counts.append(count)
      if len(counts) - 1 != step:
        return exe(params, opt_state, batch)
      nan = jnp.float32(np.nan)
      return params, opt_state, {'loss': nan, 'grad_norm': nan,
                                 'skipped': jnp.float32(1.0)}
    return run, nbytes

  monkeypatch.setattr(trainer_lib.StepPrograms, '__call__', call)
  return counts


def _drop_one_batch(monkeypatch, index: int) -> None:
  """The `index`-th batch (0-based) of the train data is dropped."""
  taken = []
  original = trainer_lib._DataFeed.next  # pylint: disable=protected-access

  def next_batch(self):
    if len(taken) == index:
      taken.append(original(self))
    taken.append(original(self))
    return taken[-1]

  monkeypatch.setattr(trainer_lib._DataFeed, 'next', next_batch)  # pylint: disable=protected-access


def _losses(out_dir) -> dict:
  return {r['step']: r['loss'] for r in read_jsonl(
      os.path.join(out_dir, 'metrics.jsonl')) if r['split'] == 'train'}


# Each method with the step SKIPPED (0-based; update t = 4) on a boundary of
# its schedule, where the program of the next update depends on whether
# this one was applied.
METHODS = {
    # The density warmup: 3 levels, round(2 min(count, 5) / 5), so the
    # updates after counts 3 and 4 run different ks.
    'scape': ['--config.optimizer.name=scape',
              '--config.optimizer.scape.density=0.05',
              '--config.optimizer.scape.density_warmup_steps=5',
              '--config.optimizer.scape.density_levels=3'],
    # The first resample is update t = 4; the updates after it are sparse.
    'radius': ['--config.optimizer.name=radius',
               '--config.optimizer.radius.interval=4',
               '--config.optimizer.radius.dense_fraction=0'],
    # The first sync is update t = 4.
    'diloco': ['--config.optimizer.name=diloco', '--config.mesh.replica=2',
               '--config.optimizer.diloco.sync_every=4'],
    # The switch from the lazy start is update t = 4: floor(p T) is 4 for
    # both runs' T (10 and 9); the schedules in fractions of T are off.
    'pier': ['--config.optimizer.name=pier', '--config.mesh.replica=2',
             '--config.optimizer.pier.sync_every=2',
             '--config.optimizer.pier.lazy_start=0.45',
             '--config.optimizer.pier.momentum_decay=false',
             '--config.optimizer.pier.outer_lr_schedule=false'],
}


@pytest.mark.parametrize('name', list(METHODS))
def test_a_skipped_update_is_a_dropped_batch(corpus, tmp_path, monkeypatch,
                                             name):
  """With SCAPE, also: the checkpoint records the skipped steps, so a run
  resumed after one picks the programs of the optimizer's count, as the run
  that went on."""
  steps = 10
  args = [f'--config.steps={steps}', '--config.eval_every=0',
          *METHODS[name]]
  if name == 'scape':
    args.append('--config.ckpt_every=5')
  with monkeypatch.context() as patch:
    counts = _skip_one_update(patch, SKIPPED)
    summary = trainer.train(run_config(corpus, tmp_path / 'skipped', *args))
  assert summary['skipped_steps'] == 1
  # The step after the skipped one runs the update that it did not make.
  assert counts == list(range(SKIPPED + 1)) + list(range(SKIPPED, steps - 1))
  with monkeypatch.context() as patch:
    _drop_one_batch(patch, SKIPPED)
    trainer.train(run_config(corpus, tmp_path / 'dropped',
                             f'--config.steps={steps - 1}',
                             '--config.eval_every=0', *METHODS[name]))
  skipped, dropped = _losses(tmp_path / 'skipped'), _losses(tmp_path /
                                                            'dropped')
  assert np.isnan(skipped[SKIPPED + 1])
  later = [skipped[s + 1] for s in range(SKIPPED + 1, steps)]
  assert later == [dropped[s] for s in range(SKIPPED + 1, steps)], name
  if name == 'scape':
    _check_resumed_keeps_the_count(corpus, tmp_path, monkeypatch, args,
                                   skipped)


def _check_resumed_keeps_the_count(corpus, tmp_path, monkeypatch, args,
                                   whole):
  """A run resumed from `args`' run's checkpoint of step 5 (after the
  skipped update) runs the update after 4 applied ones and the same losses
  as that run (`whole`)."""
  shutil.copytree(tmp_path / 'skipped' / 'ckpt', tmp_path / 'resumed' / 'ckpt')
  shutil.rmtree(tmp_path / 'resumed' / 'ckpt' / '10')
  with monkeypatch.context() as patch:
    counts = _skip_one_update(patch, -1)
    trainer.train(run_config(corpus, tmp_path / 'resumed', *args))
  assert counts[0] == 4  # step 5 runs the update after 4 applied ones
  resumed = _losses(tmp_path / 'resumed')
  assert [resumed[s] for s in range(6, 11)] == [whole[s] for s in
                                                range(6, 11)]


def test_updates_before_waits_only_where_a_skip_would_change_the_program():
  def metrics(skipped):
    return {'loss': jnp.float32(1.0), 'grad_norm': jnp.float32(1.0),
            'skipped': jnp.float32(skipped)}

  steps = guard.InFlightSteps(max_bad_steps=5, depth=2, skipped_before=2)
  level = lambda count: min(count, 6) // 3  # a boundary at count 3 and 6
  steps.push(1, metrics(1))
  steps.push(2, metrics(0))
  # Step 10 (0-based): 10 - 2 = 8 if neither is skipped, 6 or 7 otherwise:
  # the same program, so nothing is waited for.
  assert steps.updates_before(10, level) == 8 and steps.finished is None
  # Counts 3 and 4 would run other programs than 5: wait, then count.
  assert steps.updates_before(8, level) == 5 and steps.finished == 2
  assert steps.skipped_in_all == 3


# ----------------------------------------------------------------------------
# A resume under a changed config: the state must fit the new schedule.


def _check(saved_args, new_args):
  """The resume check after 9 updates (every case below is at 9)."""
  saved = config_lib.to_dict(config_lib.load(None, saved_args))
  cfg = config_lib.load(None, new_args)
  method = methods.build(cfg.optimizer, cfg.steps)
  resume.check_state_fits(saved, cfg, method, 9, 'checkpoint ckpt/9')


SCAPE = ['--config.optimizer.name=scape', '--config.steps=100']
RADIUS = ['--config.optimizer.name=radius', '--config.steps=100',
          '--config.optimizer.radius.dense_fraction=0']
PIER = ['--config.optimizer.name=pier', '--config.mesh.replica=2',
        '--config.steps=100', '--config.optimizer.pier.sync_every=5']


@pytest.mark.parametrize('saved, new', [
    # SCAPE's masks were chosen for density 0.01.
    (SCAPE, SCAPE + ['--config.optimizer.scape.density=0.1']),
    # ... or for a level of the warmup that the new one has elsewhere.
    (SCAPE + ['--config.optimizer.scape.density_warmup_steps=20'],
     SCAPE + ['--config.optimizer.scape.density_warmup_steps=40']),
    # Radius: no resample yet (T = 16), but the new T = 4 runs sparse steps.
    (RADIUS + ['--config.optimizer.radius.interval=16'],
     RADIUS + ['--config.optimizer.radius.interval=4']),
    # ... and the other way: masks and a residual, then dense steps.
    (RADIUS + ['--config.optimizer.radius.interval=4'],
     RADIUS + ['--config.optimizer.radius.interval=16']),
    # Pier: in the lazy start (L = 20), then past the switch (L = 5).
    (PIER + ['--config.optimizer.pier.lazy_start=0.2'],
     PIER + ['--config.optimizer.pier.lazy_start=0.05']),
    # DiLoCo over SCAPE: the inner method's masks.
    (['--config.optimizer.name=diloco', '--config.mesh.replica=2',
      '--config.optimizer.diloco.inner=scape'],
     ['--config.optimizer.name=diloco', '--config.mesh.replica=2',
      '--config.optimizer.diloco.inner=scape',
      '--config.optimizer.scape.density=0.5']),
])
def test_a_state_that_does_not_fit_the_new_schedule_is_refused(saved, new):
  with pytest.raises(config_lib.ConfigError) as e:
    _check(saved, new)
  changed = resume.config_changes(
      config_lib.to_dict(config_lib.load(None, saved)),
      config_lib.to_dict(config_lib.load(None, new)))
  for key in changed:
    assert key in str(e.value)
  assert 'after its 9 updates' in str(e.value)


@pytest.mark.parametrize('saved, new', [
    # Only the learning rate and the run's length change.
    (SCAPE, SCAPE + ['--config.optimizer.lr=1e-4', '--config.steps=200']),
    # The warmup is over under both schedules: the same density.
    (SCAPE + ['--config.optimizer.scape.density_warmup_steps=4'],
     SCAPE + ['--config.optimizer.scape.density_warmup_steps=8']),
    # Resampled under both intervals.
    (RADIUS + ['--config.optimizer.radius.interval=4'],
     RADIUS + ['--config.optimizer.radius.interval=8']),
    # Past the lazy start under both.
    (PIER + ['--config.optimizer.pier.lazy_start=0.05'],
     PIER + ['--config.optimizer.pier.lazy_start=0.08']),
])
def test_a_state_that_fits_the_new_schedule_resumes(saved, new):
  _check(saved, new)


def test_radius_resumed_with_an_earlier_resample_is_refused(corpus, tmp_path):
  """Through the trainer: a checkpoint before Radius's first resample (T =
  8) resumed with T = 4 would have run sparse steps 6 and 7 with masks that
  were never chosen (every compressed leaf sent nothing)."""
  args = ['--config.optimizer.name=radius', '--config.eval_every=0',
          '--config.optimizer.radius.dense_fraction=0', '--config.steps=10']
  trainer.train(run_config(corpus, tmp_path, '--config.ckpt_every=5',
                           '--config.optimizer.radius.interval=8', *args))
  shutil.rmtree(tmp_path / 'ckpt' / '10')  # resume from step 5
  cfg = run_config(corpus, tmp_path,
                   '--config.optimizer.radius.interval=4', *args)
  with pytest.raises(config_lib.ConfigError,
                     match=r'(?s)optimizer.radius.interval: 8 -> 4.*'
                     r"'resampled': False.*'resampled': True"):
    trainer.train(cfg, allow_config_change=True)
