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
    ('--config.optimizer.scape.variant=sloppy', 'variant'),
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


@pytest.mark.parametrize('variant', ['fresh', 'carry', 'carry_v'])
def test_distributed_scape_rejects_variants(variant):
  with pytest.raises(config.ConfigError,
                     match=f"variant='{variant}'.*distributed=True"):
    config.load(None, ['--config.optimizer.scape.distributed=True',
                       f'--config.optimizer.scape.variant={variant}'])


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
