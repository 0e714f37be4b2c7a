"""Runs that never lose work (issue 8), in process on 8 simulated devices.

The units first (config diff, steps in flight, metrics truncation, corpus
checks), then a few short runs of the trainer that share one small corpus.
`tests/test_cli.py` signals a real `train.py` process.
"""

import dataclasses
import json
import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train as train_cli
from scape_jax import train as trainer
from scape_jax.data import prepare
from scape_jax.train import checkpoint
from scape_jax.train import config as config_lib
from scape_jax.train import guard
from scape_jax.train import methods
from scape_jax.train import resume
from scape_jax.train import trainer as trainer_lib
from scape_jax.train.metrics import MetricsLogger, read_jsonl


# ----------------------------------------------------------------------------
# Units.


def test_config_changes_by_kind():
  saved = config_lib.to_dict(config_lib.load(None, [
      '--config.optimizer.name=scape', '--config.optimizer.scape.density=0.1']))
  same_method = config_lib.to_dict(config_lib.load(None, [
      '--config.optimizer.name=scape', '--config.optimizer.scape.density=0.05',
      '--config.optimizer.lr=1e-3', '--config.log_every=7',
      '--config.out_dir=elsewhere']))
  changes = resume.config_changes(saved, same_method)
  assert changes == {'log_every': (10, 7), 'optimizer.lr': (3e-4, 1e-3),
                     'optimizer.scape.density': (0.1, 0.05),
                     'out_dir': ('runs/default', 'elsewhere')}
  with pytest.raises(config_lib.ConfigError) as e:
    resume.check_config(saved, same_method, 'ckpt 5', allow_change=False)
  message = str(e.value)
  assert 'optimizer.lr: 0.0003 -> 0.001' in message
  assert 'optimizer.scape.density: 0.1 -> 0.05' in message
  assert '--allow-config-change' in message
  assert 'log_every' not in message and 'out_dir' not in message  # safe
  assert resume.check_config(saved, same_method, 'ckpt 5',
                             allow_change=True) == changes
  # Only safe keys changed: no flag needed.
  safe = dict(saved, log_every=1, ckpt_every=5)
  assert set(resume.check_config(saved, safe, 'ckpt 5', False)) == {
      'log_every', 'ckpt_every'}
  # Another eval set: the eval losses would not compare; the flag records it.
  with pytest.raises(config_lib.ConfigError, match='eval_batches: 8 -> 2'):
    resume.check_config(saved, dict(saved, eval_batches=2), 'ckpt 5', False)


@pytest.mark.parametrize('override, key', [
    ('--config.optimizer.name=adamw', "optimizer.name: 'scape' -> 'adamw'"),
    ('--config.seed=1', 'seed: 0 -> 1'),
    ('--config.data.batch_size=16', 'data.batch_size: 32 -> 16'),
    ('--config.mesh.fsdp=2', 'mesh.fsdp: 1 -> 2'),
    # The same shapes, but SCAPE's state holds the embedding reordered.
    ('--config.optimizer.scape.interleaved_leaves=embed_tokens',
     "optimizer.scape.interleaved_leaves: '' -> 'embed_tokens'"),
])
def test_structural_changes_are_refused_even_with_the_flag(override, key):
  saved = config_lib.to_dict(config_lib.load(None, [
      '--config.optimizer.name=scape']))
  current = config_lib.to_dict(config_lib.load(None, [
      '--config.optimizer.name=scape', override]))
  with pytest.raises(config_lib.ConfigError,
                     match='must stay as saved') as e:
    resume.check_config(saved, current, 'ckpt 5', allow_change=True)
  assert key in str(e.value)


def test_keys_added_since_a_checkpoint_are_no_change_at_their_defaults():
  """A checkpoint from before mesh.nodes, model.lora and fcdp existed
  resumes (it ran as their defaults do); set away from the default, an added
  key is a change as before."""
  current = config_lib.to_dict(config_lib.load(None, []))
  saved = json.loads(json.dumps(current))
  del saved['mesh']['nodes'], saved['model']['lora'], saved['fcdp']
  assert resume.check_config(saved, current, 'ckpt 5', False) == {}
  lora = config_lib.to_dict(config_lib.load(None, [
      '--config.model.lora.targets=q_proj']))
  with pytest.raises(config_lib.ConfigError, match=r'must stay as saved(.|\n)*'
                     r"model.lora.targets: '\(absent\)' -> \['q_proj'\]"):
    resume.check_config(saved, lora, 'ckpt 5', allow_change=True)


def test_data_paths_are_compared_as_files(tmp_path, monkeypatch):
  """A trailing slash or a relative path to the same corpus is no change;
  a corpus moved elsewhere needs the flag (its content is checked when the
  data position is restored), not a new run."""
  (tmp_path / 'corpus').mkdir()
  (tmp_path / 'moved').mkdir()
  monkeypatch.chdir(tmp_path)

  def cfg(corpus):
    return config_lib.to_dict(config_lib.load(None, [
        f'--config.data.corpus={corpus}']))
  saved = cfg(tmp_path / 'corpus')
  for same in (f'{tmp_path / "corpus"}/', 'corpus', './corpus/../corpus'):
    assert resume.check_config(saved, cfg(same), 'ckpt 5', False) == {}
  moved = cfg(tmp_path / 'moved')
  with pytest.raises(config_lib.ConfigError, match='--allow-config-change'):
    resume.check_config(saved, moved, 'ckpt 5', allow_change=False)
  assert resume.check_config(saved, moved, 'ckpt 5', True) == {
      'data.corpus': (str(tmp_path / 'corpus'), str(tmp_path / 'moved'))}


def test_a_warmup_compiled_as_one_program_resumes_without_the_flag():
  # The demo's config gained shared_warmup=True: a run saved before resumes
  # (the same numbers, other programs), and the change is reported.
  def cfg(*extra):
    return config_lib.to_dict(config_lib.load(None, [
        '--config.optimizer.name=scape',
        '--config.optimizer.scape.density_warmup_steps=10', *extra]))
  saved = cfg()
  del saved['optimizer']['scape']['shared_warmup']  # saved before the key
  changes = resume.check_config(
      saved, cfg('--config.optimizer.scape.shared_warmup=true'), 'ckpt 5',
      allow_change=False)
  assert changes == {'optimizer.scape.shared_warmup': ('(absent)', True)}


def test_unused_method_sections_are_not_compared():
  saved = config_lib.to_dict(config_lib.load(None, []))  # adamw
  current = config_lib.to_dict(config_lib.load(
      None, ['--config.optimizer.scape.density=0.5']))
  assert resume.config_changes(saved, current) == {}


def test_the_inner_method_section_of_an_outer_method_is_compared():
  """DiLoCo with an inner SCAPE: optimizer.scape is in use; radius is not."""
  inner = ['--config.optimizer.name=diloco',
           '--config.optimizer.diloco.inner=scape']
  saved = config_lib.to_dict(config_lib.load(None, inner))
  current = config_lib.to_dict(config_lib.load(None, inner + [
      '--config.optimizer.scape.density=0.05',
      '--config.optimizer.radius.density=0.25']))
  assert resume.config_changes(saved, current) == {
      'optimizer.scape.density': (0.01, 0.05)}
  with pytest.raises(config_lib.ConfigError, match='optimizer.scape.density'):
    resume.check_config(saved, current, 'ckpt 5', allow_change=False)
  other = config_lib.to_dict(config_lib.load(None, inner[:1] + [
      '--config.optimizer.diloco.inner=adams']))  # another inner state
  with pytest.raises(config_lib.ConfigError, match=r"must stay as saved(.|\n)*"
                     r"optimizer.diloco.inner: 'scape' -> 'adams'"):
    resume.check_config(saved, other, 'ckpt 5', allow_change=True)
  # Algorithm 1 <-> 2 is converted on restore for optimizer.name='scape'
  # only: inside DiLoCo it would fail on the state's pytree paths.
  flip = '--config.optimizer.scape.distributed=true'
  mode = config_lib.to_dict(config_lib.load(None, inner + [flip]))
  with pytest.raises(config_lib.ConfigError, match=r"must stay as saved(.|\n)*"
                     r"optimizer.scape.distributed: False -> True"):
    resume.check_config(saved, mode, 'ckpt 5', allow_change=True)
  alone = [inner[1].replace('diloco.inner', 'name')]
  assert resume.check_config(
      config_lib.to_dict(config_lib.load(None, alone)),
      config_lib.to_dict(config_lib.load(None, alone + [flip])), 'ckpt 5',
      allow_change=False) == {'optimizer.scape.distributed': (False, True)}


# Another valid value of every key of every method's section.
_OTHER_VALUE = {
    'scape': dict(density=0.1, density_warmup_steps=3, density_levels=4,
                  shared_warmup=True, mask_encoding='bitmap', select='sort',
                  offload=False, offload_kind='unpinned_host', distributed=True,
                  fp32_replica=False,
                  payload_dtype='bfloat16', offset_bits='16',
                  local_adam=True, dense_leaves='embed_tokens',
                  interleaved_leaves='embed_tokens'),
    'radius': dict(density=0.25, interval=5, dense_fraction=0.3,
                   index_radius=1, select='sort'),
    'demo': dict(beta=0.9, chunk=32, topk=8),
    'diloco': dict(inner='adams', sync_every=5, outer_lr=0.5,
                   outer_momentum=0.5, offload=True),
    'pier': dict(inner='adams', sync_every=5, lazy_start=0.0,
                 momentum_warmup=False, momentum_decay=True,
                 outer_lr_schedule=True, outer_momentum=0.5, outer_lr=0.5,
                 offload=False),
}
# The base each value above is tried against, where the defaults would make
# one of them a setting with no effect (`methods.no_effect`), or a run with
# no sparse or sync step in its 10 steps.
_BASE = {
    'scape': dict(density_warmup_steps=2, offload=True, fp32_replica=True),
    'radius': dict(interval=2),
    'diloco': dict(sync_every=2),
    'pier': dict(sync_every=2, momentum_decay=False, outer_lr_schedule=False),
}


def _state_shapes(args):
  program = trainer.build_program(config_lib.load(None, [
      '--config.model.preset=llama-tiny', '--config.data.seq_len=16',
      '--config.data.batch_size=16', '--config.steps=10', *args]))
  state = (program.abstract_params, program.abstract_opt)
  return (jax.tree.structure(state),
          [(x.shape, x.dtype) for x in jax.tree.leaves(state)])


def _check_resumable_keys_keep_the_state(args, other_values: dict):
  """Each `key=value` that --allow-config-change lets through keeps the
  parameters' and the optimizer state's pytree and shapes (or is in
  `resume.CONVERTED_KEYS`); any other is refused, naming the key."""
  saved = config_lib.to_dict(config_lib.load(None, args))
  before = _state_shapes(args)
  for key, value in other_values.items():
    changed = args + [f'--config.{key}={value}']
    try:
      resume.check_config(saved, config_lib.to_dict(config_lib.load(
          None, changed)), 'ckpt', allow_change=True)
    except config_lib.ConfigError as e:
      assert key in str(e)
      continue
    if key not in resume.CONVERTED_KEYS:
      assert _state_shapes(changed) == before, key


def test_every_key_resumable_with_the_flag_keeps_the_state():
  """A change that --allow-config-change lets through must restore; any
  other must be refused before a checkpoint is read, naming the key, not
  fail on pytree paths. Every key of every method's section is tried."""
  sections = {n: s.section for n, s in methods.REGISTRY.items()
              if s.section is not None}
  assert set(_OTHER_VALUE) == set(sections)
  for name, section in sections.items():
    assert set(_OTHER_VALUE[name]) == {
        f.name for f in dataclasses.fields(section)}, name
    args = [f'--config.optimizer.name={name}'] + [
        f'--config.optimizer.{name}.{k}={v}'
        for k, v in _BASE.get(name, {}).items()]
    if name == 'scape':  # fp32_replica=True needs low-precision parameters
      args.append('--config.model.param_dtype=bfloat16')
    if methods.REGISTRY[name].per_replica:  # DiLoCo over SCAPE, Pier adamw
      args += ['--config.mesh.replica=2', '--config.optimizer.diloco.inner='
               'scape']
    _check_resumable_keys_keep_the_state(args, {
        f'optimizer.{name}.{k}': v for k, v in _OTHER_VALUE[name].items()})
  _check_resumable_keys_keep_the_state(  # LoRA adapters are parameters
      ['--config.model.lora.targets=q_proj,v_proj'], {
          'model.lora.rank': 4, 'model.lora.targets': 'q_proj',
          'model.lora.alpha': 8.0, 'model.dtype': 'float32',
          'model.remat': 'true', 'model.scan_layers': 'true',
          'data.micro_batches': 2})


def _fake_metrics(skipped):
  return {'loss': jnp.float32(np.nan if skipped else 1.0),
          'grad_norm': jnp.float32(1.0), 'skipped': jnp.float32(skipped)}


def test_in_flight_steps_bounded_and_bad_steps_counted():
  seen = []
  steps = guard.InFlightSteps(max_bad_steps=3, depth=2,
                              on_skip=lambda s, m, n: seen.append((s, n)))
  flags = [0, 1, 1, 0, 1, 1]
  for step, flag in enumerate(flags, 1):
    steps.push(step, _fake_metrics(flag))
    assert steps.finished == (step - 2 if step > 2 else None)
  steps.drain()
  assert seen == [(2, 1), (3, 2), (5, 1), (6, 2)]
  assert (steps.in_a_row, steps.skipped) == (2, 4)
  steps.push(7, _fake_metrics(1))
  with pytest.raises(guard.DivergedError, match=r'steps 5\.\.7 \(3 in a row'):
    steps.drain()


def test_metrics_after_the_restored_step_are_dropped(tmp_path):
  with MetricsLogger(str(tmp_path), tensorboard=False) as log:
    for step in range(1, 6):
      log.log(step, {'loss': float(step)})
    log.log(5, {'loss': 0.5}, prefix='eval')
  with open(tmp_path / 'metrics.jsonl', 'a') as f:
    f.write('{"step": 6, "spl')  # cut off mid-line
  with MetricsLogger(str(tmp_path), tensorboard=False, start=3) as log:
    log.log(4, {'loss': 4.5})
  records = read_jsonl(str(tmp_path / 'metrics.jsonl'))
  assert [(r['step'], r['loss']) for r in records] == [
      (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.5)]


def _text_dir(path, files):
  os.makedirs(path)
  for name, data in files.items():
    with open(os.path.join(path, name), 'wb') as f:
      f.write(data)
  return str(path)


def test_binary_corpus_warns_and_text_does_not(tmp_path):
  rng = np.random.default_rng(0)
  text = b'To be, or not to be, that is the question.\n' * 50
  binary = _text_dir(tmp_path / 'bin', {
      'a.txt': text, 'b.txt': rng.bytes(4000), 'c.txt': text})
  with pytest.warns(prepare.CorpusWarning, match=r'not text.*b\.txt'):
    prepare.prepare(binary, 'byte', str(tmp_path / 'out-bin'))
  clean = _text_dir(tmp_path / 'txt', {'a.txt': text, 'b.txt': text})
  with warnings.catch_warnings():
    warnings.simplefilter('error', prepare.CorpusWarning)
    prepare.prepare(clean, 'byte', str(tmp_path / 'out-txt'))


@pytest.mark.parametrize('files, message', [
    (None, 'neither .shakespeare. nor an existing directory'),
    ({}, 'has 0 .txt file'),
    ({'only.txt': b'hello'}, 'has 1 .txt file'),
])
def test_unusable_corpus_dirs_are_corpus_errors(tmp_path, files, message):
  corpus = str(tmp_path / 'c')
  if files is not None:
    _text_dir(tmp_path / 'c', files)
  with pytest.raises(prepare.CorpusError, match=message):
    prepare.prepare(corpus, 'byte', str(tmp_path / 'out'))


@pytest.mark.parametrize('override, message', [
    ('--config.data.corpus=/no/such/dir', "'/no/such/dir' is neither"),
    ('--config.model.preset=llama9b', "unknown model 'llama9b'"),
])
def test_user_mistakes_exit_2_without_traceback(tmp_path, capsys, override,
                                                message):
  code = train_cli.main([f'--config.out_dir={tmp_path}', override])
  err = capsys.readouterr().err
  assert code == 2, err
  assert message in err and 'Traceback' not in err


# ----------------------------------------------------------------------------
# Short runs of the trainer.


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  path = str(tmp_path_factory.mktemp('corpus'))
  prepare.make_synthetic_corpus(path, num_tokens=1 << 15)
  return path


def _args(corpus, out_dir, *overrides):
  return [f'--config.data.corpus={corpus}', f'--config.out_dir={out_dir}',
          '--config.model.dtype=float32', '--config.data.seq_len=16',
          '--config.data.batch_size=8', '--config.eval_batches=1',
          '--config.log_every=1', '--config.eval_every=0',
          '--config.optimizer.decay=constant',
          '--config.optimizer.warmup_steps=0', '--config.optimizer.lr=3e-3',
          *overrides]


def _cfg(corpus, out_dir, *overrides):
  return config_lib.load(None, _args(corpus, out_dir, *overrides))


def _train_records(out_dir):
  return [r for r in read_jsonl(os.path.join(out_dir, 'metrics.jsonl'))
          if r['split'] == 'train']


def _count_in_flight(monkeypatch) -> list:
  """Patches the trainer's step programs to record, at each dispatch, how
  many earlier steps have not finished yet."""
  outstanding, counts = [], []
  compiled = trainer_lib.StepPrograms.__call__

  def call(self, step):
    exe, nbytes = compiled(self, step)

    def run(*args):
      outstanding[:] = [m for m in outstanding if not m.is_ready()]
      counts.append(len(outstanding))
      params, opt_state, metrics = exe(*args)
      outstanding.append(metrics['skipped'])
      return params, opt_state, metrics

    return run, nbytes

  monkeypatch.setattr(trainer_lib.StepPrograms, '__call__', call)
  return counts


def test_tokens_per_second_leave_out_evals_and_saves(corpus, tmp_path,
                                                     monkeypatch):
  """An eval or a save between two log lines is not train throughput: a
  1.5 s eval and save after every step would leave every later line below
  tokens / 3 s. (With 0.5 s each and a 1 s bound, a step slowed past 1 s
  by a loaded machine failed it once.)"""
  import time  # pylint: disable=g-import-not-at-top
  make_eval_step = trainer_lib.step_lib.make_eval_step

  def slow_eval_step(*args, **kwargs):
    evaluate = make_eval_step(*args, **kwargs)

    def slow(*a):
      time.sleep(1.5)
      return evaluate(*a)
    return slow
  monkeypatch.setattr(trainer_lib.step_lib, 'make_eval_step', slow_eval_step)
  original_save = trainer_lib._Saver.__call__

  def slow_save(self, *args):
    time.sleep(1.5)
    return original_save(self, *args)
  monkeypatch.setattr(trainer_lib._Saver, '__call__', slow_save)
  trainer.train(_cfg(corpus, tmp_path, '--config.steps=3',
                     '--config.eval_every=1', '--config.ckpt_every=1',
                     '--config.keep_checkpoints=2'))
  assert checkpoint.Checkpointer(str(tmp_path / 'ckpt')).all_steps() == [2, 3]
  rates = [r['tokens_per_s'] for r in read_jsonl(
      str(tmp_path / 'metrics.jsonl')) if r['split'] == 'train']
  tokens = 8 * 16  # data.batch_size x data.seq_len
  assert len(rates) == 3 and min(rates[1:]) > tokens / 2.5, rates  # (2.5 s)


def test_nothing_read_for_many_steps_matches_log_every_1(corpus, tmp_path,
                                                         monkeypatch):
  """The steps in flight stay bounded when nothing is read for 12 steps.

  `log_every=500` >= `steps`: nothing is read until the end, the worst case
  of any `log_every` (100 in the issue). With more than ~32 steps in flight
  XLA's CPU client deadlocks in a collective (see `guard`); whether a run
  gets there depends on how far the host outpaces the devices, so the bound
  itself is checked. SCAPE with a density warmup (two programs) and an
  evaluation in between: the losses and the final eval equal those of a run
  that reads every step.
  """
  scape = ('--config.optimizer.name=scape', '--config.steps=12',
           '--config.optimizer.scape.density=0.1',
           '--config.optimizer.scape.density_warmup_steps=1')
  reference = trainer.train(_cfg(corpus, tmp_path / 'every', *scape))
  out = tmp_path / 'ahead'
  in_flight = _count_in_flight(monkeypatch)
  run = trainer.train(_cfg(corpus, out, *scape, '--config.log_every=500',
                           '--config.eval_every=10'))
  assert len(in_flight) == 12
  assert max(in_flight) <= guard.MAX_STEPS_IN_FLIGHT < 32, in_flight
  assert run['losses'] == reference['losses']  # bit for bit
  assert run['eval_loss'] == reference['eval_loss']
  evals = [r['step'] for r in read_jsonl(str(out / 'metrics.jsonl'))
           if r['split'] == 'eval']
  assert evals == [10, 12]


def test_divergence_stops_the_run_and_saves_only_finite_states(corpus,
                                                               tmp_path):
  cfg = _cfg(corpus, tmp_path, '--config.optimizer.lr=1e30',
             '--config.steps=30', '--config.ckpt_every=2',
             '--config.max_bad_steps=3')
  with pytest.raises(trainer.DivergedError,
                     match=r'\(3 in a row, max_bad_steps=3\)'):
    trainer.train(cfg)
  records = _train_records(tmp_path)
  skipped = [r['step'] for r in records if r['skipped']]
  assert len(skipped) == 3 and skipped == list(
      range(skipped[0], skipped[0] + 3))
  assert not np.isfinite(records[skipped[0] - 1]['grad_norm'])
  assert records[-1]['step'] == skipped[-1]  # logged up to the stop
  steps = checkpoint.Checkpointer(str(tmp_path / 'ckpt')).all_steps()
  assert steps and steps[-1] <= skipped[-1]  # Checkpointer saves only finite


def _edit_extras(step_dir, old, new):
  path = os.path.join(step_dir, 'extras', 'metadata')
  with open(path) as f:
    text = f.read()
  assert old in text
  with open(path, 'w') as f:
    f.write(text.replace(old, new, 1))


def test_resume_falls_back_checks_config_and_keeps_metrics_unique(
    corpus, tmp_path, capsys):
  out = tmp_path / 'run'
  first = trainer.train(_cfg(corpus, out, '--config.steps=3',
                             '--config.ckpt_every=1'))
  _edit_extras(out / 'ckpt' / '3', '"next_batch": 3', '"next_batch": 7')
  # A user mistake is a clean exit 2 that names the key, old and new.
  code = train_cli.main(_args(corpus, out, '--config.steps=5',
                              '--config.seed=1'))
  assert code == 2
  assert 'seed: 0 -> 1' in capsys.readouterr().err
  with pytest.raises(config_lib.ConfigError, match='steps: 3 -> 5'):
    trainer.train(_cfg(corpus, out, '--config.steps=5'))
  assert (out / 'ckpt' / '3').is_dir()  # nothing moved yet
  capsys.readouterr()
  resumed = trainer.train(_cfg(corpus, out, '--config.steps=5'),
                          allow_config_change=True)
  printed = capsys.readouterr().out
  assert resumed['start_step'] == 2
  assert 'ckpt/3 is corrupt' in printed and 'resuming from step 2' in printed
  assert (tmp_path / 'run' / 'ckpt.corrupt' / '3').is_dir()
  records = _train_records(out)
  assert [r['step'] for r in records] == [1, 2, 3, 4, 5]
  assert records[2]['loss'] == first['losses'][2]  # step 3 again, exactly
  _, extras = checkpoint.Checkpointer(str(out / 'ckpt')).read_extras(5)
  assert extras['config_history'] == [  # safe changes are recorded too
      {'step': 2, 'changes': {'ckpt_every': [1, 0], 'steps': [3, 5]}}]
  assert json.dumps(extras)  # recorded as plain JSON


def test_a_checkpoint_is_saved_only_after_its_steps_are_logged(
    corpus, tmp_path, monkeypatch):
  """ckpt_every not a multiple of log_every: a resume from any checkpoint
  must find every earlier step in metrics.jsonl (it starts after them)."""
  logged_at_save = []
  save = checkpoint.Checkpointer.save

  def spy(self, step, *args, **kwargs):
    logged_at_save.append((step, [r['step'] for r in _train_records(
        tmp_path)]))
    return save(self, step, *args, **kwargs)

  monkeypatch.setattr(checkpoint.Checkpointer, 'save', spy)
  trainer.train(_cfg(corpus, tmp_path, '--config.steps=6',
                     '--config.ckpt_every=2', '--config.log_every=5'))
  assert logged_at_save == [(s, list(range(1, s + 1))) for s in (2, 4, 6)]


def test_a_signal_after_the_last_step_still_saves_the_run(
    corpus, tmp_path, monkeypatch):
  """SIGTERM while the final checkpoint is written (ckpt_every=0, as in the
  demo) is held like one during the steps: the run finishes and saves. It
  reached the process's own handler before, which kills: nothing saved."""
  import signal  # pylint: disable=g-import-not-at-top
  leaked = []
  previous = signal.signal(signal.SIGTERM, lambda s, f: leaked.append(s))
  close = checkpoint.Checkpointer.close

  def signalled_close(self):
    signal.raise_signal(signal.SIGTERM)
    return close(self)

  monkeypatch.setattr(checkpoint.Checkpointer, 'close', signalled_close)
  try:
    run = trainer.train(_cfg(corpus, tmp_path, '--config.steps=3',
                             '--config.ckpt_every=0'))
  finally:
    signal.signal(signal.SIGTERM, previous)
  assert not leaked
  assert run['start_step'] == 0 and len(run['losses']) == 3
  assert checkpoint.Checkpointer(str(tmp_path / 'ckpt')).all_steps() == [3]


def test_rerunning_a_finished_run_logs_nothing_twice(corpus, tmp_path):
  cfg = _cfg(corpus, tmp_path, '--config.steps=3', '--config.ckpt_every=0')
  first = trainer.train(cfg)
  again = trainer.train(cfg)
  assert again['start_step'] == 3 and again['eval_loss'] == first['eval_loss']
  records = read_jsonl(str(tmp_path / 'metrics.jsonl'))
  assert [(r['step'], r['split']) for r in records] == [
      (0, 'compile'), (1, 'train'), (2, 'train'), (3, 'train'), (3, 'eval')]
  # A final eval lost after the final save is written on the rerun.
  with open(tmp_path / 'metrics.jsonl', 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in records[:4])
  trainer.train(cfg)
  records = read_jsonl(str(tmp_path / 'metrics.jsonl'))
  assert [r['split'] for r in records] == ['compile'] + ['train'] * 3 + [
      'eval']
  # Fewer steps than the run has trained: refused, not an eval of the
  # 3-step model logged as step 2.
  with pytest.raises(config_lib.ConfigError, match=(
      r'ckpt/3 is past steps=2: the run has trained 3 steps. Set steps >= 3')):
    trainer.train(_cfg(corpus, tmp_path, '--config.steps=2',
                       '--config.ckpt_every=0'), allow_config_change=True)
  assert read_jsonl(str(tmp_path / 'metrics.jsonl')) == records


def test_a_checkpoint_of_another_mesh_says_so(corpus, tmp_path, capsys):
  """SCAPE's per-worker state saved on 8 workers does not fit 4; the error
  names both meshes first (it listed shape mismatches only). AdamW, whose
  state has no per-worker fields, resumes there, and says so."""
  for name in ('scape', 'adamw'):
    out = tmp_path / name
    method = (f'--config.optimizer.name={name}',
              '--config.optimizer.scape.density=0.1')
    trainer.train(_cfg(corpus, out, '--config.steps=2', *method))
    later = _cfg(corpus, out, '--config.steps=3', *method)
    if name == 'adamw':
      capsys.readouterr()
      resumed = trainer.train(later, jax.devices()[:4],
                              allow_config_change=True)
      assert resumed['start_step'] == 2
      assert re.search(r"resuming step 2, saved on a mesh of \{.*'data': 8.*\}"
                       r" devices per axis, on this run's \{.*'data': 4.*\}: "
                       'the state is re-sharded', capsys.readouterr().out)
      continue
    with pytest.raises(checkpoint.CheckpointError, match=(
        r"ckpt/2 was saved on a mesh of \{.*'data': 8.*\} devices per axis; "
        r"this run has \{.*'data': 4.*\}")):
      trainer.train(later, jax.devices()[:4], allow_config_change=True)
