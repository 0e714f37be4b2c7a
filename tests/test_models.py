"""Tests for the model zoo (models/)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import models
from models import layers
from models import llama as llama_lib

TINY = ('gpt-tiny', 'llama-tiny')


def _tiny(name, dtype=jnp.float32, seed=0, **overrides):
  cfg = models.get_config(name, **overrides)
  return models.build(cfg, rngs=nnx.Rngs(seed), dtype=dtype)


def _tokens(cfg, b=2, t=16, seed=0):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)


# ---------------------------------------------------------------------------
# Parameter counts (abstract shapes only).
# ---------------------------------------------------------------------------


def _closed_form_count(cfg) -> int:
  d, v, f, n = cfg.d_model, cfg.vocab_size, cfg.d_ff, cfg.n_layers
  if cfg.family == 'gpt':
    block = (2 * 2 * d                      # ln_1, ln_2 (scale + bias)
             + d * 3 * d + 3 * d            # c_attn
             + d * d + d                    # attn.c_proj
             + d * f + f + f * d + d)       # c_fc, mlp.c_proj
    return v * d + cfg.max_seq_len * d + n * block + 2 * d  # wte wpe h ln_f
  hd = d // cfg.n_heads
  q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
  block = 2 * d + d * q + 2 * d * kv + q * d + 3 * d * f
  return 2 * v * d + n * block + d  # embed_tokens + lm_head, layers, norm


@pytest.mark.parametrize('name', sorted(models.PRESETS))
def test_param_count_matches_closed_form(name):
  cfg = models.get_config(name)
  assert models.param_count(cfg) == _closed_form_count(cfg)


@pytest.mark.parametrize('name,lo,hi', [
    ('gpt345m', 340e6, 370e6),
    ('llama500m', 505e6, 520e6),
    ('llama1.8b', 1.80e9, 1.86e9),
    ('llama-1m', 0.95e6, 1.1e6),
    ('llama-10m', 9.5e6, 10.5e6),
])
def test_param_count_stated_sizes(name, lo, hi):
  assert lo <= models.param_count(models.get_config(name)) <= hi


def test_param_count_does_not_allocate():
  cfg = models.get_config('llama1.8b', n_layers=23)  # Fresh (uncached) cfg.
  before = sum(x.nbytes for x in jax.live_arrays())
  n = models.param_count(cfg)
  after = sum(x.nbytes for x in jax.live_arrays())
  assert n > 1.7e9
  assert after - before < 1 << 20


def test_presets_shapes():
  gpt = models.get_config('gpt345m')
  assert gpt.vocab_size == 50304 and gpt.vocab_size % 128 == 0
  assert gpt.n_kv_heads == gpt.n_heads
  assert gpt.norm_eps == 1e-5
  lm = models.get_config('llama500m')
  assert (lm.n_layers, lm.d_model, lm.d_ff, lm.n_heads, lm.n_kv_heads) == (
      16, 1536, 4096, 16, 8)
  assert lm.rope_theta == 10000.0 and lm.family == 'llama'


# ---------------------------------------------------------------------------
# Forward pass: shapes, dtypes, causality.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize('name', TINY)
def test_logits_shape_and_dtype(name):
  model = _tiny(name, dtype=jnp.bfloat16)
  for p in jax.tree.leaves(nnx.state(model, nnx.Param)):
    assert p.dtype == jnp.float32
  tokens = _tokens(model.cfg, b=3, t=model.cfg.max_seq_len)
  logits = nnx.jit(lambda m, t: m(t))(model, tokens)
  assert logits.shape == (3, model.cfg.max_seq_len, model.cfg.vocab_size)
  assert logits.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(logits)))


@pytest.mark.parametrize('name', TINY)
def test_too_long_sequence_raises(name):
  model = _tiny(name)
  with pytest.raises(ValueError, match='max_seq_len'):
    model(jnp.zeros((1, model.cfg.max_seq_len + 1), jnp.int32))


@pytest.mark.parametrize('name,dtype', [
    ('gpt-tiny', jnp.float32),
    ('llama-tiny', jnp.float32),
    ('llama-tiny', jnp.bfloat16),
])
def test_causality(name, dtype):
  model = _tiny(name, dtype=dtype)
  tokens = _tokens(model.cfg)
  j = 7
  changed = tokens.at[:, j].set((tokens[:, j] + 1) % model.cfg.vocab_size)
  a, b = model(tokens), model(changed)
  np.testing.assert_allclose(a[:, :j], b[:, :j], rtol=0, atol=1e-6)
  assert float(jnp.max(jnp.abs(a[:, j] - b[:, j]))) > 1e-4


# ---------------------------------------------------------------------------
# Llama attention: GQA and RoPE.
# ---------------------------------------------------------------------------


def _attention(n_kv_heads, seed=0):
  cfg = models.get_config('llama-tiny', n_kv_heads=n_kv_heads)
  attn = llama_lib.Attention(cfg, dtype=jnp.float32, param_dtype=jnp.float32,
                             rngs=nnx.Rngs(seed))
  return cfg, attn


def _np_rope(x, theta):
  """HF Llama rotate-half RoPE on x [B, T, H, D], float64."""
  d = x.shape[-1]
  inv_freq = 1.0 / theta**(np.arange(0, d, 2) / d)
  freqs = np.outer(np.arange(x.shape[1]), inv_freq)
  emb = np.concatenate([freqs, freqs], -1)[None, :, None, :]
  rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
  return x * np.cos(emb) + rot * np.sin(emb)


def _np_llama_attention(attn, cfg, x):
  """Independent float64 reference with HF `repeat_kv` semantics."""
  w = {n: np.asarray(getattr(attn, n).kernel.get_value(), np.float64)
       for n in ('q_proj', 'k_proj', 'v_proj', 'o_proj')}
  x = np.asarray(x, np.float64)
  b, t, _ = x.shape
  h, kvh, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  q = _np_rope((x @ w['q_proj']).reshape(b, t, h, hd), cfg.rope_theta)
  k = _np_rope((x @ w['k_proj']).reshape(b, t, kvh, hd), cfg.rope_theta)
  v = (x @ w['v_proj']).reshape(b, t, kvh, hd)
  k = np.repeat(k, h // kvh, axis=2)  # == HF repeat_kv.
  v = np.repeat(v, h // kvh, axis=2)
  s = np.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(hd)
  s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  o = np.einsum('bhqk,bkhd->bqhd', p, v).reshape(b, t, h * hd)
  return o @ w['o_proj']


@pytest.mark.parametrize('n_kv_heads', [1, 2, 4])
def test_llama_attention_matches_numpy_reference(n_kv_heads):
  cfg, attn = _attention(n_kv_heads)
  x = jax.random.normal(jax.random.key(1), (2, 16, cfg.d_model))
  np.testing.assert_allclose(
      attn(x), _np_llama_attention(attn, cfg, x), rtol=1e-4, atol=1e-5)


def test_gqa_equals_mha_with_repeated_kv():
  cfg, gqa = _attention(n_kv_heads=2)
  _, mha = _attention(n_kv_heads=cfg.n_heads, seed=1)
  group = cfg.n_heads // 2

  def repeat(kernel):  # [d, K*D] -> [d, H*D], kv head k serves k*G..k*G+G-1.
    k = kernel.get_value().reshape(cfg.d_model, 2, cfg.head_dim)
    return jnp.repeat(k, group, axis=1).reshape(cfg.d_model, -1)

  for name in ('q_proj', 'o_proj'):
    getattr(mha, name).kernel.set_value(getattr(gqa, name).kernel.get_value())
  mha.k_proj.kernel.set_value(repeat(gqa.k_proj.kernel))
  mha.v_proj.kernel.set_value(repeat(gqa.v_proj.kernel))
  x = jax.random.normal(jax.random.key(2), (2, 16, cfg.d_model))
  np.testing.assert_allclose(gqa(x), mha(x), rtol=1e-5, atol=1e-6)


def test_rope_preserves_norm_and_is_relative():
  hd, theta, t = 16, 10000.0, 24
  cos, sin = layers.rope_cos_sin(jnp.arange(t), hd, theta)
  key_q, key_k = jax.random.split(jax.random.key(3))
  q1 = jax.random.normal(key_q, (hd,))
  k1 = jax.random.normal(key_k, (hd,))
  # The same vector at every position, rotated by its position.
  q = layers.apply_rope(jnp.broadcast_to(q1, (1, t, 1, hd)), cos, sin)[0, :, 0]
  k = layers.apply_rope(jnp.broadcast_to(k1, (1, t, 1, hd)), cos, sin)[0, :, 0]
  np.testing.assert_allclose(
      jnp.linalg.norm(q, axis=-1), jnp.linalg.norm(q1), rtol=1e-5)
  dots = q @ k.T  # dots[m, n] must depend only on m - n.
  for shift in (1, 5, 11):
    np.testing.assert_allclose(
        dots[shift:, shift:], dots[:-shift, :-shift], rtol=1e-4, atol=1e-4)
  assert not np.allclose(dots[0, 0], dots[0, 3], atol=1e-3)
  np.testing.assert_allclose(q[0], q1, rtol=1e-6)  # Position 0: identity.


# ---------------------------------------------------------------------------
# Embedding tying, names, logical axes.
# ---------------------------------------------------------------------------


def test_gpt_tied_embeddings():
  model = _tiny('gpt-tiny')
  cfg = model.cfg
  vocab_params = [
      path for path, axes in nnx.to_flat_state(models.logical_axes(model))
      if 'vocab' in axes]
  assert vocab_params == [('wte', 'embedding')]
  assert not hasattr(model, 'lm_head')
  tokens = _tokens(cfg)
  wte = model.wte.embedding.get_value()
  x = wte[tokens] + model.wpe.embedding.get_value()[:16]
  for block in model.h:
    x = block(x)
  expected = model.ln_f(x) @ wte.T
  np.testing.assert_allclose(model(tokens), expected, rtol=1e-5, atol=1e-5)


def test_llama_untied_embeddings():
  model = _tiny('llama-tiny')
  cfg = model.cfg
  head = model.lm_head.kernel.get_value()
  emb = model.embed_tokens.embedding.get_value()
  assert head.shape == (cfg.d_model, cfg.vocab_size)
  assert emb.shape == (cfg.vocab_size, cfg.d_model)
  assert not np.allclose(head, emb.T)
  tokens = _tokens(cfg)
  before = model(tokens)
  model.lm_head.kernel.set_value(head * 2.0)
  np.testing.assert_allclose(model(tokens), 2.0 * before, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(model.embed_tokens.embedding.get_value(), emb)


def _paths(model):
  return {'.'.join(map(str, p))
          for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_hf_compatible_names():
  gpt = _paths(_tiny('gpt-tiny'))
  for name in ('wte.embedding', 'wpe.embedding', 'ln_f.scale', 'ln_f.bias',
               'h.0.ln_1.scale', 'h.1.attn.c_attn.kernel',
               'h.1.attn.c_attn.bias', 'h.0.attn.c_proj.kernel',
               'h.0.ln_2.bias', 'h.0.mlp.c_fc.kernel', 'h.0.mlp.c_proj.bias'):
    assert name in gpt, name
  lm = _paths(_tiny('llama-tiny'))
  for name in ('embed_tokens.embedding', 'norm.scale', 'lm_head.kernel',
               'layers.1.input_layernorm.scale',
               'layers.0.post_attention_layernorm.scale',
               'layers.0.self_attn.q_proj.kernel',
               'layers.0.self_attn.k_proj.kernel',
               'layers.0.self_attn.v_proj.kernel',
               'layers.0.self_attn.o_proj.kernel',
               'layers.0.mlp.gate_proj.kernel', 'layers.0.mlp.up_proj.kernel',
               'layers.0.mlp.down_proj.kernel'):
    assert name in lm, name
  assert not any(p.endswith('bias') for p in lm)


@pytest.mark.parametrize('name', TINY)
def test_logical_axes(name):
  model = _tiny(name)
  state = nnx.state(model, nnx.Param)
  axes = models.logical_axes(model)
  is_tuple = lambda x: isinstance(x, tuple)
  assert (jax.tree.structure(axes, is_leaf=is_tuple)
          == jax.tree.structure(
              jax.tree.map(lambda _: (), state, is_leaf=lambda x: isinstance(
                  x, nnx.Variable)), is_leaf=is_tuple))
  flat_axes = dict(nnx.to_flat_state(axes))
  for path, param in nnx.to_flat_state(state):
    names = flat_axes[path]
    assert len(names) == param.get_value().ndim, path
    assert all(n is None or n in models.LOGICAL_AXES for n in names), path
  # Works on an abstract state too.
  abstract = nnx.state(
      nnx.eval_shape(lambda: models.build(model.cfg, rngs=nnx.Rngs(0))),
      nnx.Param)
  assert dict(nnx.to_flat_state(models.logical_axes(abstract))) == flat_axes
  if name == 'llama-tiny':
    expect = {
        'layers.0.self_attn.q_proj.kernel': ('embed', 'heads'),
        'layers.0.self_attn.k_proj.kernel': ('embed', 'kv'),
        'layers.0.self_attn.o_proj.kernel': ('heads', 'embed'),
        'layers.0.mlp.up_proj.kernel': ('embed', 'mlp'),
        'layers.0.mlp.down_proj.kernel': ('mlp', 'embed'),
        'embed_tokens.embedding': ('vocab', 'embed'),
        'lm_head.kernel': ('embed', 'vocab'),
        'norm.scale': ('embed',),
    }
  else:
    expect = {'wpe.embedding': ('pos', 'embed'),
              'wte.embedding': ('vocab', 'embed'),
              'h.0.mlp.c_fc.bias': ('mlp',)}
  named = {'.'.join(map(str, p)): v for p, v in flat_axes.items()}
  for path, names in expect.items():
    assert named[path] == names, path


def test_sharded_forward_matches_unsharded():
  model = _tiny('llama-tiny')
  tokens = _tokens(model.cfg, b=4)
  expected = model(tokens)
  mesh = jax.make_mesh((2, 4), ('data', 'model'),
                       axis_types=(AxisType.Auto,) * 2)
  rules = {'heads': 'model', 'kv': 'model', 'mlp': 'model', 'vocab': 'model'}
  state = nnx.state(model, nnx.Param)
  shardings = jax.tree.map(
      lambda names: NamedSharding(mesh, P(*(rules.get(n) for n in names))),
      models.logical_axes(state), is_leaf=lambda x: isinstance(x, tuple))
  nnx.update(model, jax.device_put(state, shardings))
  tokens = jax.device_put(tokens, NamedSharding(mesh, P('data')))
  logits = nnx.jit(lambda m, t: m(t))(model, tokens)
  np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# Options: remat, attention implementation.
# ---------------------------------------------------------------------------


def test_remat_matches():
  name = 'llama-tiny'  # Both families share `layers.run_block`.
  tokens = _tokens(models.get_config(name))

  def loss_and_grad(model):
    def loss(m):
      return jnp.mean(jax.nn.logsumexp(m(tokens), axis=-1))
    return nnx.jit(nnx.value_and_grad(loss))(model)

  l0, g0 = loss_and_grad(_tiny(name, remat=False))
  l1, g1 = loss_and_grad(_tiny(name, remat=True))
  for remat, expect in ((False, 0), (True, 2)):  # One remat per block.
    graphdef, state = nnx.split(_tiny(name, remat=remat))
    jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(tokens))(state)
    assert str(jaxpr).count('remat') == expect
  np.testing.assert_allclose(l0, l1, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
               g0, g1)


def test_attn_impl_jax_matches_xla():
  name = 'llama-tiny'  # GQA: 4 query heads share 2 kv heads.
  tokens = _tokens(models.get_config(name))
  a = _tiny(name, attn_impl='xla')(tokens)
  b = _tiny(name, attn_impl='jax')(tokens)
  np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# get_config.
# ---------------------------------------------------------------------------


def test_get_config_unknown_name():
  with pytest.raises(ValueError) as err:
    models.get_config('nope')
  msg = str(err.value)
  assert 'nope' in msg
  for name in models.PRESETS:
    assert name in msg


def test_get_config_overrides():
  cfg = models.get_config('llama-tiny', n_layers=3, remat=True)
  assert (cfg.n_layers, cfg.remat) == (3, True)
  assert models.PRESETS['llama-tiny'].n_layers == 2  # Preset untouched.
  gpt = models.get_config('gpt-tiny', n_heads=8)
  assert gpt.n_kv_heads == 8
  with pytest.raises(ValueError, match='bogus'):
    models.get_config('gpt-tiny', bogus=1)
  with pytest.raises(ValueError):
    models.get_config('llama-tiny', n_kv_heads=3)
