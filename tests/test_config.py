"""Tests for scape_jax.config."""

import dataclasses
import json
import textwrap

import pytest

from scape_jax.train import config


def _write(tmp_path, text: str) -> str:
  path = tmp_path / 'cfg.py'
  path.write_text(textwrap.dedent(text))
  return str(path)


def test_defaults_validate():
  cfg = config.load(None)
  assert cfg == config.Config()
  assert cfg.optimizer.name == 'adamw' and cfg.mesh.data == -1


def test_file_states_only_changes(tmp_path):
  path = _write(tmp_path, """
      import math
      _hidden = 123
      model = dict(preset='llama500m')
      optimizer = dict(name='scape', lr=3e-4, scape=dict(density=0.01))
      steps = 100_000
      """)
  cfg = config.load(path)
  assert cfg.model.preset == 'llama500m'
  assert cfg.optimizer.name == 'scape' and cfg.optimizer.lr == 3e-4
  assert cfg.optimizer.scape.density == 0.01
  assert cfg.steps == 100_000
  # Everything not stated keeps its default.
  default = config.Config()
  assert cfg.model.dtype == default.model.dtype
  assert cfg.optimizer.b2 == default.optimizer.b2
  assert cfg.data == default.data and cfg.mesh == default.mesh
  assert cfg.out_dir == default.out_dir


def test_overrides_after_file(tmp_path):
  path = _write(tmp_path, "optimizer = dict(name='scape', lr=1e-3)\n")
  cfg = config.load(path, [
      '--config.optimizer.name=adamw',
      '--config.steps', '1_000',
      '--config.optimizer.warmup_steps=1e2',
      '--config.data.data_dir=',
      '--config.mesh.data=-1',
  ])
  assert cfg.optimizer.name == 'adamw'
  assert cfg.optimizer.lr == 1e-3
  assert cfg.steps == 1000 and isinstance(cfg.steps, int)
  assert cfg.optimizer.warmup_steps == 100
  assert cfg.data.data_dir == ''


@pytest.mark.parametrize('text,expected', [
    ('true', True), ('True', True), ('1', True),
    ('false', False), ('FALSE', False), ('0', False)])
def test_bool_parsing(text, expected):
  assert config.load(None, [f'--config.model.remat={text}']).model.remat is (
      expected)


def test_unknown_key_in_file(tmp_path):
  path = _write(tmp_path, "optimizer = dict(nmae='scape')\n")
  with pytest.raises(config.ConfigError, match=r'optimizer\.nmae') as e:
    config.load(path)
  assert 'name' in str(e.value) and 'scape' in str(e.value)
  path = _write(tmp_path, 'stpes = 10\n')
  with pytest.raises(config.ConfigError, match=r"'stpes'.*steps"):
    config.load(path)


def test_a_methods_own_key_outside_its_section_names_the_section():
  with pytest.raises(config.ConfigError,
                     match=r"'optimizer.scape.density'"):
    config.load(None, ['--config.optimizer.density=0.1'])


def test_sections_of_unselected_methods_are_checked_too():
  with pytest.raises(config.ConfigError, match=r'optimizer.scape: density'):
    config.load(None, ['--config.optimizer.name=adamw',
                       '--config.optimizer.scape.density=2'])


def test_allowed_names_come_from_the_registry():
  from scape_jax.train import methods
  with pytest.raises(config.ConfigError) as e:
    config.load(None, ['--config.optimizer.name=sgd'])
  assert all(name in str(e.value) for name in methods.names())


def test_unknown_key_in_override():
  with pytest.raises(config.ConfigError, match=r'optimizer\.lrr') as e:
    config.load(None, ['--config.optimizer.lrr=1'])
  assert 'min_lr_ratio' in str(e.value)
  with pytest.raises(config.ConfigError, match='modle'):
    config.load(None, ['--config.modle.preset=x'])


def test_bad_type_names_key_value_and_type():
  with pytest.raises(config.ConfigError) as e:
    config.load(None, ['--config.steps=abc'])
  message = str(e.value)
  assert 'steps' in message and 'abc' in message and 'int' in message
  for override in ('--config.steps=1.5', '--config.model.remat=yes',
                   '--config.optimizer.lr=fast'):
    with pytest.raises(config.ConfigError, match=override.split('=')[1]):
      config.load(None, [override])


def test_bad_type_in_file(tmp_path):
  with pytest.raises(config.ConfigError, match=r"'steps'.*int"):
    config.load(_write(tmp_path, "steps = 'many'\n"))
  with pytest.raises(config.ConfigError, match=r"'model.remat'.*bool"):
    config.load(_write(tmp_path, 'model = dict(remat=3)\n'))


def test_sections_and_leaves_do_not_mix(tmp_path):
  with pytest.raises(config.ConfigError, match="'optimizer' is a section"):
    config.load(_write(tmp_path, "optimizer = 'adamw'\n"))
  with pytest.raises(config.ConfigError, match="'steps' is a leaf"):
    config.load(_write(tmp_path, 'steps = dict(n=3)\n'))
  with pytest.raises(config.ConfigError, match="'optimizer' is a section"):
    config.load(None, ['--config.optimizer=adamw'])
  with pytest.raises(config.ConfigError, match="'steps' is a leaf"):
    config.load(None, ['--config.steps.n=3'])


@pytest.mark.parametrize('override', [
    'steps=10', '--steps=10', '--config.steps', '--config.=3'])
def test_malformed_overrides(override):
  with pytest.raises(config.ConfigError, match='--config.KEY'):
    config.load(None, [override])


@pytest.mark.parametrize('override,match', [
    ('--config.optimizer.scape.density=0', 'density'),
    ('--config.optimizer.scape.density=1.5', 'density'),
    ('--config.optimizer.scape.density_levels=1', 'density_levels'),
    ('--config.steps=0', 'steps'),
    ('--config.optimizer.lr=0', 'lr'),
    ('--config.optimizer.lr=nan', 'lr'),
    ('--config.optimizer.lr=inf', 'lr'),
    ('--config.optimizer.eps=0', 'eps'),
    ('--config.optimizer.b1=-0.1', 'b1'),
    ('--config.mesh.replica=0', 'mesh.replica'),
    ('--config.optimizer.name=sgd', 'optimizer.name'),
    ('--config.optimizer.decay=linear', 'decay'),
    ('--config.optimizer.scape.mask_encoding=rle', 'mask_encoding'),
    ('--config.optimizer.scape.select=heap', 'select'),
    ('--config.optimizer.scape.local_adam=maybe', 'local_adam'),
    ('--config.optimizer.b2=1', 'b2'),
    ('--config.optimizer.min_lr_ratio=2', 'min_lr_ratio'),
    ('--config.optimizer.warmup_steps=-1', 'warmup_steps'),
    ('--config.model.dtype=float16', 'model.dtype'),
    ('--config.data.batch_size=0', 'batch_size'),
    ('--config.data.seq_len=-4', 'seq_len'),
    ('--config.mesh.data=0', 'mesh.data'),
    ('--config.mesh.fsdp=0', 'mesh.fsdp'),
])
def test_validate_errors(override, match):
  with pytest.raises(config.ConfigError, match=match):
    config.load(None, [override])


def test_cudnn_attention_needs_bfloat16():
  with pytest.raises(config.ConfigError, match=r"attn_impl='cudnn' needs "
                     r"model.dtype='bfloat16', got 'float32'"):
    config.load(None, ['--config.model.attn_impl=cudnn',
                       '--config.model.dtype=float32'])
  assert config.load(None, ['--config.model.attn_impl=cudnn']).model.dtype == (
      'bfloat16')


_OUTER = ['--config.mesh.replica=2', '--config.mesh.data=4']


@pytest.mark.parametrize('steps', [0, -3])
@pytest.mark.parametrize('method', [[], ['--config.optimizer.name=pier',
                                         *_OUTER]])
def test_bad_steps_is_one_error_not_one_per_method(steps, method):
  with pytest.raises(config.ConfigError) as err:
    config.load(None, [f'--config.steps={steps}', *method])
  assert str(err.value) == (f'invalid config:\n  steps must be > 0, got '
                            f'{steps}')


@pytest.mark.parametrize('overrides,match', [
    (['--config.optimizer.eps=1e-50'], r'eps=1e-50 must be .*>= 1.18e-38'),
    (['--config.optimizer.name=radius', '--config.steps=150'],
     r'optimizer.radius.interval=200, dense_fraction=0.16: no step is '
     r'sparse: every one of the 150 steps is dense \(the first resample '
     r'would be step 200\)'),
    (['--config.optimizer.name=radius', '--config.steps=100',
      '--config.optimizer.radius.interval=7',
      '--config.optimizer.radius.dense_fraction=1'], 'step 105'),
    (['--config.optimizer.name=diloco', '--config.steps=4', *_OUTER],
     r'optimizer.diloco.sync_every=50 > steps=4: the replica groups would '
     'never synchronise'),
    (['--config.optimizer.name=pier', '--config.steps=4', *_OUTER],
     r'optimizer.pier.sync_every=50 > steps=4'),
    (['--config.optimizer.name=pier', '--config.steps=100', *_OUTER,
      '--config.optimizer.pier.outer_lr=0.3'],
     r'pier.outer_lr=0.3 has no effect while outer_lr_schedule=True'),
    (['--config.optimizer.name=pier', '--config.steps=100', *_OUTER,
      '--config.optimizer.pier.outer_momentum=0.5'],
     r'pier.outer_momentum=0.5 has no effect while momentum_decay=True'),
    (['--config.optimizer.name=scape', '--config.optimizer.scape.offload_kind=device'],
     r"scape.offload_kind='device' has no effect with offload=False"),
    (['--config.optimizer.name=scape', '--config.optimizer.scape.offload=true',
      '--config.optimizer.scape.offload_kind=device'],
     r"offload_kind='device' keeps the residual in device memory"),
    (['--config.optimizer.name=scape', '--config.optimizer.scape.density_levels=5'],
     r'density_levels=5 has no effect with density_warmup_steps=0'),
    (['--config.optimizer.name=scape', '--config.optimizer.scape.shared_warmup=true'],
     r'shared_warmup=True has no effect with density_warmup_steps=0'),
    (['--config.optimizer.decay=constant', '--config.optimizer.min_lr_ratio=0.5'],
     r"min_lr_ratio=0.5 has no effect with optimizer.decay='constant'"),
    (['--config.optimizer.name=scape', '--config.optimizer.scape.fp32_replica=true'],
     r'fp32_replica=True needs low-precision parameters'),
    (['--config.optimizer.name=diloco', *_OUTER,
      '--config.optimizer.diloco.inner=scape',
      '--config.optimizer.scape.fp32_replica=true'],
     r'fp32_replica=True needs low-precision'),  # SCAPE as the inner method
    (['--config.optimizer.name=diloco', *_OUTER,
      '--config.optimizer.diloco.inner=scape',
      '--config.optimizer.scape.fp32_replica=true',
      '--config.model.param_dtype=bfloat16'],
     r"fp32_replica=True inside optimizer.name='diloco' is not supported"),
    (['--config.optimizer.name=pier', *_OUTER, '--config.steps=100',
      '--config.optimizer.pier.inner=scape',
      '--config.optimizer.pier.lazy_start=0',
      '--config.optimizer.scape.fp32_replica=true',
      '--config.model.param_dtype=bfloat16'],
     r"fp32_replica=True inside optimizer.name='pier'"),
    # Pier: the lazy start (70 steps) outlasts the last sync (step 60).
    (['--config.optimizer.name=pier', '--config.steps=100', *_OUTER,
      '--config.optimizer.pier.sync_every=60',
      '--config.optimizer.pier.lazy_start=0.7'],
     r'lazy_start=0.7, sync_every=60: no sync after the lazy start '
     r'\(steps 1-70 of 100\)'),
    # Radius: no sparse step, every step from the first resample resamples.
    (['--config.optimizer.name=radius', '--config.steps=200',
      '--config.optimizer.radius.interval=1'],
     r'interval=1, dense_fraction=0.16: no step is sparse: every step from '
     r'the first resample on resamples'),
    # ... or the only resample is the last step.
    (['--config.optimizer.name=radius', '--config.steps=200',
      '--config.optimizer.radius.interval=50',
      '--config.optimizer.radius.dense_fraction=0.9'],
     r'no step is sparse: the first resample is the last step, 200'),
    (['--config.optimizer.name=diloco', *_OUTER,
      '--config.optimizer.diloco.inner=bogus'],
     r"optimizer.diloco: inner='bogus' is not an inner method; allowed: "
     'adamw, adams, scape, radius, demo$'),
])
def test_settings_with_no_effect_are_errors(overrides, match):
  with pytest.raises(config.ConfigError, match=match):
    config.load(None, overrides)


def test_settings_with_an_effect_pass():
  for overrides in (
      ['--config.optimizer.name=radius', '--config.steps=201'],  # sparse
      ['--config.optimizer.name=radius', '--config.steps=201',  # one sparse
       '--config.optimizer.radius.interval=50',
       '--config.optimizer.radius.dense_fraction=0.9'],
      ['--config.optimizer.name=pier', '--config.steps=100', *_OUTER,
       '--config.optimizer.pier.sync_every=60',
       '--config.optimizer.pier.lazy_start=0.5'],  # a sync at step 60
      ['--config.optimizer.name=diloco', '--config.steps=50', *_OUTER],
      ['--config.optimizer.name=pier', '--config.steps=100', *_OUTER,
       '--config.optimizer.pier.outer_lr_schedule=false',
       '--config.optimizer.pier.outer_lr=0.3'],
      ['--config.optimizer.name=scape',
       '--config.optimizer.scape.fp32_replica=true',
       '--config.model.param_dtype=bfloat16'],
      # Another method's section is checked, not refused: one line switches.
      ['--config.optimizer.name=adamw', '--config.steps=4',
       '--config.optimizer.diloco.sync_every=50']):
    config.load(None, overrides)


def test_keys_a_method_does_not_read_are_noted():
  from scape_jax.train import methods  # pylint: disable=g-import-not-at-top
  cfg = config.load(None, ['--config.optimizer.name=demo',
                           '--config.optimizer.clip_norm=0.5',
                           '--config.optimizer.b1=0.8'])
  [note] = methods.unread_notes(cfg.optimizer)
  assert note.startswith("optimizer.name='demo' does not read "
                         'optimizer.b1=0.8, optimizer.clip_norm=0.5 ('), note
  assert not methods.unread_notes(config.load(None, [
      '--config.optimizer.name=demo']).optimizer)
  assert not methods.unread_notes(config.load(None, [
      '--config.optimizer.clip_norm=0.5']).optimizer)  # SCAPE reads it


@pytest.mark.parametrize('other, match', [
    ('distributed=True', 'local_adam=True with distributed=True'),
    ('payload_dtype=bfloat16', "local_adam=True sends float32 values; got "
     "payload_dtype='bfloat16'")])
def test_local_adam_refuses_what_it_cannot_do(other, match):
  with pytest.raises(config.ConfigError, match=match):
    config.load(None, ['--config.optimizer.scape.local_adam=True',
                       f'--config.optimizer.scape.{other}'])


def test_validate_lists_every_problem():
  cfg = config.Config()
  cfg.steps = 0
  cfg.optimizer.scape.density = 0.0
  with pytest.raises(config.ConfigError) as e:
    config.validate(cfg)
  assert 'steps' in str(e.value) and 'density' in str(e.value)
  config.validate(config.Config())


def test_slots_reject_typos():
  cfg = config.Config()
  with pytest.raises(AttributeError):
    cfg.optimizer.lrr = 1.0  # pytype: disable=not-writable


def test_dict_round_trip():
  cfg = config.load(None, ['--config.optimizer.name=scape',
                           '--config.model.remat=true', '--config.seed=7'])
  d = config.to_dict(cfg)
  assert json.loads(json.dumps(d)) == d
  assert d['optimizer']['name'] == 'scape' and d['seed'] == 7
  restored = config.from_dict(json.loads(json.dumps(d)))
  assert restored == cfg
  assert dataclasses.asdict(restored) == d


def test_from_dict_is_strict():
  d = config.to_dict(config.Config())
  d['optimizer']['momentum'] = 0.9
  with pytest.raises(config.ConfigError, match=r'optimizer\.momentum'):
    config.from_dict(d)
  with pytest.raises(config.ConfigError, match='bogus'):
    config.from_dict({'bogus': 1})


def test_format_is_short_and_complete():
  text = config.format(config.load(None, ['--config.optimizer.lr=0.001']))
  # model, model.lora, optimizer (adamw has no section of its own), data,
  # mesh, fcdp, run
  assert len(text.splitlines()) == 7
  assert 'lr=0.001' in text and "preset='llama-tiny'" in text
  assert 'steps=1000' in text


def test_the_program_refuses_pallas_on_cpu_and_notes_idle_devices():
  from scape_jax import train as trainer  # pylint: disable=g-import-not-at-top
  for select in ('pallas_radix',):
    with pytest.raises(config.ConfigError,
                       match=rf"select='{select}' runs Pallas kernels.*on "
                       "cpu use 'auto'"):
      trainer.build_program(config.load(None, [
          '--config.optimizer.name=scape',
          f'--config.optimizer.scape.select={select}']))
  program = trainer.build_program(config.load(None, ['--config.mesh.data=4']))
  assert program.notes == ('the mesh uses 4 of the 8 devices; mesh.data=-1 '
                           'takes all that the other axes leave',)
  assert not trainer.build_program(config.load(None, [])).notes


def test_a_warmup_as_long_as_the_run_is_noted():
  """The lr warmup is cut to the run; the program says so (it is not
  an error: short smoke runs keep the configs' warmup)."""
  from scape_jax import train as trainer  # pylint: disable=g-import-not-at-top
  from scape_jax.train import methods  # pylint: disable=g-import-not-at-top
  cfg = config.load(None, ['--config.steps=10',
                           '--config.optimizer.warmup_steps=10'])
  assert trainer.build_program(cfg).notes == (
      'optimizer.warmup_steps=10 is not shorter than the run (steps=10): the '
      'learning rate warms up over 9 steps instead and reaches optimizer.lr '
      'at the last one',)
  lr = methods.learning_rate(cfg.optimizer, cfg.steps)
  assert float(lr(9)) == pytest.approx(cfg.optimizer.lr)  # what it says
  assert not methods.schedule_notes(cfg.optimizer, 11)


def test_keep_checkpoints_is_at_least_one():
  with pytest.raises(config.ConfigError,
                     match='keep_checkpoints must be >= 1, got 0'):
    config.load(None, ['--config.keep_checkpoints=0'])


@pytest.mark.parametrize('seed', [-1, 2**32])
def test_a_seed_outside_32_bits_is_refused(seed):
  """-1 failed later blaming data.corpus; 2**32 repeated seed 0's model."""
  with pytest.raises(config.ConfigError,
                     match=rf'seed must be in \[0, 2\*\*32\), got {seed}'):
    config.load(None, [f'--config.seed={seed}'])
  config.load(None, [f'--config.seed={2**32 - 1}'])


def test_an_invalid_fsdp_is_one_message():
  """mesh.fsdp=0 is reported once, not also as a nodes/fsdp mismatch."""
  with pytest.raises(config.ConfigError) as e:
    config.load(None, ['--config.mesh.fsdp=0'])
  assert str(e.value) == 'invalid config:\n  mesh.fsdp must be >= 1, got 0'
