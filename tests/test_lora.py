"""LoRA adapters on GPT and Llama (models/lora.py) and the settings around
them: the layer against a NumPy reference, base weights untouched by adding
adapters, and bad settings as clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from models import lora as lora_lib
from scape_jax import hf
from scape_jax import sharding
from scape_jax import train as trainer
from scape_jax.train import config as config_lib
from tests.reference import lora_reference


def _spec(targets=('q_proj',), rank=4, alpha=8.0):
  return models.LoraSpec(rank, alpha, tuple(targets))


def test_lora_layer_and_gradients_match_numpy():
  layer = lora_lib.LoRALinear(6, 5, ('embed', 'mlp'), spec=_spec(rank=3,
                                                                  alpha=6.0),
                              std=0.5, use_bias=True, dtype=jnp.float32,
                              param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  layer.lora_b.set_value(jnp.asarray(rng.normal(size=(3, 5)), jnp.float32))
  layer.bias.set_value(jnp.asarray(rng.normal(size=(5,)), jnp.float32))
  x = jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)
  g = jnp.asarray(rng.normal(size=(4, 5)), jnp.float32)

  def loss(adapters, rest):
    return jnp.sum(nnx.merge(graphdef, adapters, rest)(x) * g)

  graphdef, adapters, rest = nnx.split(layer, nnx.LoRAParam, ...)
  grads = jax.jit(jax.grad(loss))(adapters, rest)
  want_y, want_da, want_db = lora_reference(
      x, layer.kernel.get_value(), layer.bias.get_value(),
      layer.lora_a.get_value(), layer.lora_b.get_value(), 2.0, g)
  np.testing.assert_allclose(layer(x), want_y, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(grads['lora_a'].get_value(), want_da, rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(grads['lora_b'].get_value(), want_db, rtol=1e-5,
                             atol=1e-5)
  # A starts in +-1/sqrt(d_in) (PEFT's init), B at zero.
  fresh = lora_lib.LoRALinear(64, 8, ('embed', 'mlp'), spec=_spec(), std=0.02,
                              use_bias=False, dtype=jnp.float32,
                              param_dtype=jnp.float32, rngs=nnx.Rngs(1))
  a = np.asarray(fresh.lora_a.get_value())
  assert 0.9 / 8 < np.abs(a).max() <= 1 / 8 and not fresh.lora_b.get_value().any()


@pytest.mark.parametrize('preset, targets, per_block', [
    ('llama-tiny', ('q_proj', 'self_attn.v_proj'), 2),
    ('llama-tiny', ('o_proj', 'gate_proj', 'up_proj', 'down_proj'), 4),
    ('gpt-tiny', ('c_proj',), 2),  # both of GPT's c_proj
    ('gpt-tiny', ('attn.c_attn', 'mlp.c_fc'), 2),
])
def test_adapters_leave_the_base_model_unchanged(preset, targets, per_block):
  base_cfg = models.get_config(preset)
  lora_cfg = models.get_config(preset, lora=_spec(targets))
  base = models.build(base_cfg, rngs=models.rngs(0), dtype=jnp.float32)
  model = models.build(lora_cfg, rngs=models.rngs(0), dtype=jnp.float32)
  adapters = nnx.state(model, nnx.LoRAParam)
  n_adapters = len(jax.tree.leaves(adapters))
  assert n_adapters == 2 * per_block * base_cfg.n_layers
  # Same base weights for the same seed, and the same function (B = 0).
  want = nnx.to_pure_dict(nnx.state(base, nnx.Param))
  got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  flat = {jax.tree_util.keystr(p): v for p, v in
          jax.tree_util.tree_flatten_with_path(got)[0]}
  for path, value in jax.tree_util.tree_flatten_with_path(want)[0]:
    np.testing.assert_array_equal(flat[jax.tree_util.keystr(path)], value)
  tokens = jnp.arange(32, dtype=jnp.int32).reshape(2, 16)
  forward = nnx.jit(lambda m, t: m(t))
  np.testing.assert_array_equal(forward(model, tokens), forward(base, tokens))
  # The adapters carry W's logical axes, so fsdp splits them like W.
  axes = models.logical_axes(nnx.state(model, nnx.LoRAParam))
  names = set(jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple)))
  assert names & {('embed', None), (None, 'embed')}


def _cfg(*overrides):
  return config_lib.load(None, ['--config.mesh.data=1', '--config.mesh.fsdp=8',
                                '--config.mesh.nodes=2'] + list(overrides))


@pytest.mark.parametrize('overrides, message', [
    (['--config.model.lora.targets=q_proj,wq'],
     r"targets \['wq'\] name no layer of llama; allowed: .*q_proj"),
    (['--config.model.preset=gpt-tiny', '--config.model.lora.targets=q_proj'],
     r"\['q_proj'\] name no layer of gpt; allowed: .*c_attn"),
    (['--config.model.lora.targets=q_proj', '--config.model.lora.rank=0'],
     'model.lora.rank must be >= 1, got 0'),
    (['--config.model.lora.rank=-2'], 'model.lora.rank must be >= 1, got -2'),
    (['--config.model.lora.rank=16'], r'model.lora.rank=16 has no effect '
     r'without model.lora.targets \(LoRA is off: every parameter trains\)'),
    (['--config.model.lora.alpha=32'], 'model.lora.alpha=32.0 has no effect'),
    (['--config.model.lora.targets=q_proj', '--config.model.lora.alpha=0'],
     'model.lora.alpha must be > 0'),
    (['--config.fcdp.lora_aware=true'], 'fcdp.lora_aware needs LoRA'),
    (['--config.mesh.nodes=1', '--config.fcdp.hierarchical=true'],
     r'fcdp.hierarchical needs .*mesh.nodes > 1'),
    (['--config.mesh.fsdp=1', '--config.mesh.nodes=1', '--config.mesh.data=8',
      '--config.fcdp.host_cache=true'],
     r'fcdp.host_cache needs the fsdp layout \(mesh.fsdp > 1\)'),
    (['--config.mesh.nodes=3'], 'mesh.nodes=3 must divide mesh.fsdp=8'),
    (['--config.mesh.nodes=0'], 'mesh.nodes must be >= 1, got 0'),
])
def test_bad_settings_are_clear_errors(overrides, message):
  with pytest.raises(config_lib.ConfigError, match=message):
    trainer.build_program(_cfg(*overrides))


def test_adapters_on_a_random_base_are_noted():
  """LoRA without model.init_from trains adapters on a random frozen base:
  legal (the FCDP traffic benchmarks do it), but said."""
  program = trainer.build_program(_cfg('--config.model.lora.targets=q_proj'))
  assert program.notes == (
      'model.lora.targets without model.init_from: the frozen base is a '
      'random initialisation (fine for measuring traffic and speed, not for '
      'fine-tuning); model.init_from=DIR starts from a Hugging Face '
      'GPT-2/Llama directory',)


@pytest.mark.parametrize('args, message', [
    ((2.5, 8.0, ('q_proj',)), 'rank=2.5 must be an int'),
    ((True, 8.0, ('q_proj',)), 'rank=True must be an int'),
    ((0, 8.0, ('q_proj',)), 'rank=0 must be >= 1'),
    ((4, float('inf'), ('q_proj',)), 'alpha=inf must be finite'),
    ((4, 8.0, 'q_proj'), "targets='q_proj' must be a list"),
    ((4, 8.0, ()), 'targets is empty'),
])
def test_lora_spec_refuses_bad_values(args, message):
  with pytest.raises(ValueError, match=message):
    models.LoraSpec(*args)
  assert models.LoraSpec(np.int64(4), 8, ['q_proj']).scale == 2.0


def test_targets_from_a_config_file(tmp_path):
  path = tmp_path / 'lora.py'
  path.write_text("model = dict(preset='gpt-tiny', lora=dict(rank=2, "
                  "alpha=4.0, targets=['c_attn', 'mlp.c_proj']))\n")
  cfg = config_lib.load(str(path))
  assert cfg.model.lora.targets == ['c_attn', 'mlp.c_proj']
  assert config_lib.from_dict(config_lib.to_dict(cfg)) == cfg
  with pytest.raises(config_lib.ConfigError, match='expected a list of names'):
    config_lib.from_dict({'model': {'lora': {'targets': [1, 2]}}})


def test_missing_memory_kind_names_the_kinds_there_are():

  class Memory:
    def __init__(self, kind):
      self.kind = kind

  class Device:
    platform = 'fake'

    def addressable_memories(self):
      return [Memory('device'), Memory('unpinned_host')]

  with pytest.raises(ValueError, match=r"'pinned_host'.*fake.*device, "
                     'unpinned_host'):
    sharding.fcdp.check_memory_kinds([Device()])
  sharding.fcdp.check_memory_kinds(jax.devices())  # the CPU has pinned_host


def test_data_parallel_gpt_trains_only_its_adapters():
  cfg = config_lib.load(None, [
      '--config.model.preset=gpt-tiny', '--config.model.dtype=float32',
      '--config.model.lora.targets=c_attn', '--config.data.seq_len=16',
      '--config.data.batch_size=8', '--config.mesh.data=8',
      '--config.optimizer.warmup_steps=0', '--config.optimizer.lr=1e-2'])
  program = trainer.build_program(cfg)
  params, opt_state = program.init_state()
  start = jax.tree.map(np.asarray, params)
  step = program.compile_step(0)
  rng = np.random.default_rng(0)
  for _ in range(2):
    tokens = rng.integers(0, 256, size=(8, 17), dtype=np.int32)
    batch = jax.device_put({'inputs': tokens[:, :-1],
                            'targets': tokens[:, 1:]}, program.batch_sharding())
    params, opt_state, _ = step(params, opt_state, batch)
  trainable = jax.tree.leaves(program.layout.trainable)
  assert sum(trainable) == 4  # c_attn's A and B in 2 blocks
  for p, s, t in zip(jax.tree.leaves(params), jax.tree.leaves(start),
                     trainable):
    assert np.array_equal(np.asarray(p), s) != t


def _params(model) -> dict:
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.mark.parametrize('preset, targets', [
    ('llama-tiny', ('q_proj', 'down_proj')), ('gpt-tiny', ('c_attn',))])
def test_merged_adapters_compute_what_the_adapted_model_does(preset, targets):
  spec = _spec(targets, rank=3, alpha=6.0)
  model = models.build(models.get_config(preset, lora=spec),
                       rngs=models.rngs(0), dtype=jnp.float32)
  rng = np.random.default_rng(0)
  for _, b in nnx.iter_graph(model):  # B != 0: the adapters change outputs
    if isinstance(b, lora_lib.LoRALinear):
      b.lora_b.set_value(jnp.asarray(rng.normal(size=b.lora_b.shape) * 0.1,
                                     jnp.float32))
  params = _params(model)
  merged = lora_lib.merge_adapters(params, spec.scale)
  base = models.build(models.get_config(preset), rngs=models.rngs(1),
                      dtype=jnp.float32)
  nnx.update(base, merged)
  tokens = jnp.arange(32, dtype=jnp.int32).reshape(2, 16)
  forward = nnx.jit(lambda m, t: m(t))
  want = forward(model, tokens)
  assert not np.allclose(forward(models.build(
      models.get_config(preset), rngs=models.rngs(0), dtype=jnp.float32),
                                  tokens), want, atol=1e-3)
  np.testing.assert_allclose(forward(base, tokens), want, rtol=1e-4,
                             atol=1e-4)
  assert lora_lib.without_adapters(params).keys() == merged.keys()
  # transformers' names exist for the merged params only.
  cfg = models.get_config(preset, lora=spec)
  assert not any('lora' in n for n in hf.to_hf_state(cfg, merged))
  with pytest.raises(hf.ConversionError, match='lora_a.*merge_adapters'):
    hf.to_hf_state(cfg, params)


def test_init_from_with_lora_loads_the_base_and_new_adapters(monkeypatch):
  # A transformers checkpoint of a llama-tiny (read through stand-ins for
  # the safetensors reader), fine-tuned with adapters on q_proj.
  base_cfg = models.get_config('llama-tiny')
  pretrained = _params(models.build(base_cfg, rngs=models.rngs(7)))
  tensors = hf.to_hf_state(base_cfg, pretrained)
  monkeypatch.setattr(hf, 'read_config', lambda d: hf.to_hf_config(base_cfg))
  monkeypatch.setattr(hf, 'read_safetensors', lambda d: dict(tensors))
  cfg = config_lib.load(None, [
      '--config.model.init_from=/pretrained', '--config.model.dtype=float32',
      '--config.model.lora.targets=q_proj', '--config.data.seq_len=16',
      '--config.data.batch_size=8', '--config.mesh.data=8'])
  params, _ = trainer.build_program(cfg).init_state()
  params = jax.tree.map(np.asarray, params)
  got = lora_lib.without_adapters(params)
  jax.tree.map(np.testing.assert_array_equal, got, pretrained)
  for i in range(base_cfg.n_layers):  # new adapters: A random, B = 0
    q_proj = params['layers'][i]['self_attn']['q_proj']
    assert q_proj['lora_a'].any() and not q_proj['lora_b'].any()


def test_export_merges_a_runs_adapters(tmp_path, monkeypatch):
  from scape_jax import export_hf  # pylint: disable=g-import-not-at-top
  from scape_jax.train.checkpoint import Checkpointer  # pylint: disable=g-import-not-at-top
  cfg = config_lib.load(None, ['--config.model.lora.targets=q_proj',
                               '--config.model.lora.rank=2'])
  spec = _spec(('q_proj',), rank=2, alpha=cfg.model.lora.alpha)
  params = _params(models.build(models.get_config(cfg.model.preset,
                                                  lora=spec),
                                rngs=models.rngs(0)))
  q_proj = params['layers'][0]['self_attn']['q_proj']
  q_proj['lora_b'] = np.full(q_proj['lora_b'].shape, 0.5, np.float32)
  with Checkpointer(str(tmp_path / 'run' / 'ckpt')) as ckpt:
    ckpt.save(3, {'params': params}, {'config': config_lib.to_dict(cfg)})
  saved = {}
  monkeypatch.setattr(hf, 'save_pretrained',  # no safetensors needed
                      lambda d, c, p, **kw: saved.update(params=p))
  export_hf.export(str(tmp_path / 'run'), str(tmp_path / 'out'))
  want = lora_lib.merge_adapters(jax.tree.map(np.asarray, params), spec.scale)
  jax.tree.map(np.testing.assert_array_equal, saved['params'], want)
  assert not np.array_equal(
      saved['params']['layers'][0]['self_attn']['q_proj']['kernel'],
      q_proj['kernel'])


def test_export_needs_no_init_from_directory(tmp_path, monkeypatch):
  """A run started from a transformers directory records its config.json;
  the export reads that, so the directory may be gone (it was a ConfigError
  although the checkpoint holds every weight)."""
  from scape_jax import export_hf  # pylint: disable=g-import-not-at-top
  from scape_jax.train import trainer as trainer_mod  # pylint: disable=g-import-not-at-top
  from scape_jax.train.checkpoint import Checkpointer  # pylint: disable=g-import-not-at-top
  base_cfg = models.get_config('llama-tiny')
  recorded = hf.to_hf_config(base_cfg)
  cfg = config_lib.load(None, ['--config.model.init_from=/pretrained'])
  monkeypatch.setattr(hf, 'read_config', lambda d: dict(recorded))
  saver = trainer_mod._Saver(cfg, None, None, [], trainer.build_program(
      config_lib.load(None, [])).mesh)
  assert saver._init_from == recorded  # what the checkpoints carry
  params = _params(models.build(base_cfg, rngs=models.rngs(0)))
  with Checkpointer(str(tmp_path / 'run' / 'ckpt')) as ckpt:
    ckpt.save(3, {'params': params}, {'config': config_lib.to_dict(cfg),
                                      'init_from_config': recorded})

  def gone(directory):
    raise FileNotFoundError(f'{directory}/config.json not found')
  monkeypatch.setattr(hf, 'read_config', gone)
  saved = {}
  monkeypatch.setattr(hf, 'save_pretrained',
                      lambda d, c, p, **kw: saved.update(params=p))
  export_hf.export(str(tmp_path / 'run'), str(tmp_path / 'out'),
                   write_tokenizer=False)
  jax.tree.map(np.testing.assert_array_equal, saved['params'],
               jax.tree.map(np.asarray, params))

