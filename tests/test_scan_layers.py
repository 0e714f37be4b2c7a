"""`scan_layers`: a model's blocks as one stacked module run by `nnx.scan`.

References: the same model unrolled (a list of blocks) with the same
weights, and its trainer run.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import models
import scape_jax
from scape_jax import hf
from scape_jax import train as trainer
from scape_jax.optim import compress_except
from scape_jax.train import config as config_lib
from tests.tiny_runs import run_config

TINY = ('gpt-tiny', 'llama-tiny')


def _pair(name, **overrides):
  """The model unrolled and scanned, built from the same seed."""
  return [models.build(models.get_config(name, scan_layers=scan, **overrides),
                       rngs=nnx.Rngs(0), dtype=jnp.float32)
          for scan in (False, True)]


def _params(model):
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _stacked(cfg, params):
  """The unrolled model's params with its blocks stacked (the reference)."""
  return models.stack_blocks(dataclasses.replace(cfg, scan_layers=True),
                             jax.tree.map(np.asarray, params))


@pytest.mark.parametrize('name', TINY)
def test_a_scanned_model_starts_from_the_unrolled_models_weights(name):
  unrolled, scanned = _pair(name)
  want = _stacked(unrolled.cfg, _params(unrolled))
  got = jax.tree.map(np.asarray, _params(scanned))
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(g, w)
  key = models.blocks_key(scanned.cfg)
  assert all(x.shape[0] == scanned.cfg.n_layers
             for x in jax.tree.leaves(got[key]))


@pytest.mark.parametrize('name', TINY)
@pytest.mark.parametrize('remat', [False, True])
def test_scanned_logits_and_gradients_equal_the_unrolled_models(name, remat):
  unrolled, scanned = _pair(name, remat=remat)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 200, (2, 16)),
                       jnp.int32)
  np.testing.assert_allclose(scanned(tokens), unrolled(tokens), atol=1e-5)

  def grads(model):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss = lambda p: jnp.mean(nnx.merge(graphdef, p, rest)(tokens) ** 2)
    return nnx.to_pure_dict(jax.grad(loss)(params))

  want = _stacked(unrolled.cfg, grads(unrolled))
  for g, w in zip(jax.tree.leaves(grads(scanned)), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize('name', TINY)
def test_the_layer_axis_is_named_and_not_counted_as_rank(name):
  _, scanned = _pair(name)
  axes = nnx.to_pure_dict(models.logical_axes(scanned))
  key = models.blocks_key(scanned.cfg)
  names = jax.tree.leaves(axes[key], is_leaf=lambda x: isinstance(x, tuple))
  assert names and all(n[0] == models.layers.LAYERS for n in names)
  params = _params(scanned)
  flags = models.matrices(axes)(params)
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    flag = flags
    for k in path:
      flag = flag[k.key]
    stacked = path[0].key == key
    assert flag == (x.ndim - stacked >= 2), jax.tree_util.keystr(path)
  # SCAPE's compress: the stacked norm scales stay dense, the kernels not.
  compress = compress_except('', matrices=models.matrices(axes))(params)
  block = compress[key]
  norm = block['input_layernorm' if key == 'layers' else 'ln_1']['scale']
  mlp = block['mlp']['down_proj' if key == 'layers' else 'c_fc']['kernel']
  assert norm is False and mlp is True


@pytest.mark.parametrize('name', TINY)
def test_hf_export_and_import_of_a_scanned_model(name):
  unrolled, scanned = _pair(name)
  want = hf.to_hf_state(unrolled.cfg, _params(unrolled))
  got = hf.to_hf_state(scanned.cfg, _params(scanned))
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k])
  abstract = nnx.to_pure_dict(nnx.state(
      nnx.eval_shape(lambda: models.build(scanned.cfg, rngs=nnx.Rngs(0))),
      nnx.Param))
  back = hf.from_hf_state(scanned.cfg, got, abstract)
  for b, p in zip(jax.tree.leaves(back), jax.tree.leaves(_params(scanned))):
    np.testing.assert_array_equal(b, p)


def test_fcdp_host_cache_and_hierarchical_without_remat_are_refused():
  fcdp = ['--config.model.scan_layers=true', '--config.mesh.data=1',
          '--config.mesh.fsdp=8', '--config.mesh.nodes=2',
          '--config.fcdp.host_cache=true', '--config.fcdp.hierarchical=true']
  with pytest.raises(config_lib.ConfigError,
                     match='model.scan_layers with fcdp.host_cache and '
                     'fcdp.hierarchical needs model.remat=true'):
    config_lib.load(None, fcdp)
  config_lib.load(None, fcdp + ['--config.model.remat=true'])
  config_lib.load(None, fcdp[1:])


@pytest.mark.integration
def test_adamw_trains_the_same_scanned_or_unrolled(corpus, tmp_path):
  """On a data x fsdp mesh (ZeRO-3: the units' gathers), which holds the
  data-parallel case; SCAPE on a scanned model over data=8 alone:
  tests/test_offload.py's mode conversion."""
  mesh = ['--config.mesh.data=2', '--config.mesh.fsdp=4']
  losses = []
  for scan in ('false', 'true'):
    cfg = run_config(corpus, tmp_path / scan, '--config.steps=3',
                     '--config.eval_every=3', '--config.optimizer.name=adamw',
                     f'--config.model.scan_layers={scan}', *mesh)
    losses.append(trainer.train(cfg)['losses'])
  np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)


@pytest.mark.integration
def test_scape_on_a_scanned_model_keeps_the_norm_scales_dense(corpus,
                                                              tmp_path):
  cfg = run_config(corpus, tmp_path, '--config.steps=1',
                   '--config.optimizer.name=scape',
                   '--config.model.scan_layers=true')
  program = trainer.build_program(cfg)
  state = program.abstract_opt[0]
  assert isinstance(state, scape_jax.ScaleByScapeState)
  layers = state.residual['layers']
  is_dense = lambda x: isinstance(x, optax.MaskedNode)
  assert is_dense(layers['input_layernorm']['scale'])
  assert is_dense(layers['post_attention_layernorm']['scale'])
  assert layers['mlp']['up_proj']['kernel'].shape[1:] == (
      program.model_cfg.n_layers, 64, 192)
