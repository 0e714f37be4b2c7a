"""SCAPE's half-width wire: 16-bit payload with its rounding fed back, and
16-bit offsets (docs/design.md, "Half-width wire")."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scape_jax
from scape_jax import analysis
from scape_jax.analysis import cost
from scape_jax.comm import masks
from scape_jax.comm import payload
from scape_jax.train import config
from tests.mesh_runner import MeshRunner, random_params, worker_grads
from tests.reference_wire import HalfWireScapeReference, ROUND

SHAPES = {'w1': (64, 40), 'w2': (13, 7), 'b': (7,), 's': (40,)}
# A chunk of 66,560 entries over 8 workers: two 16-bit sub-blocks.
BIG = {'big': (1024, 520), 'w': (64, 40), 'b': (40,)}


def _compare(run, ref, names, compressed, n):
  """params close; m, residuals and masks of compressed leaves bit-exact."""
  st = run.state[0]
  for j, k in enumerate(names):
    np.testing.assert_allclose(np.asarray(run.params[k]), ref.w[j],
                               rtol=2e-5, atol=2e-6, err_msg=k)
    if not compressed[j]:
      np.testing.assert_allclose(np.asarray(st.mu[k]), ref.m[j], rtol=2e-5,
                                 atol=2e-6, err_msg=k)
      continue
    np.testing.assert_array_equal(np.asarray(st.mu[k]), ref.m[j], err_msg=k)
    bits = np.asarray(masks.unpack_bits(st.mask[k], ref.chunk[j]))
    for w in range(n):
      np.testing.assert_array_equal(np.asarray(st.residual[k])[w],
                                    ref.e[w][j], err_msg=f'{k} e^{w}')
      np.testing.assert_array_equal(bits[w], ref.chunk_mask(j, w))


@pytest.mark.parametrize('payload_dtype,density,warmup', [
    ('bfloat16', 0.1, 0), ('float16', 0.01, 2)])
def test_matches_numpy_reference_step_by_step(payload_dtype, density, warmup):
  # b1 = 0.5 keeps m~ = b1 m + (1 - b1) g + e exact whether or not XLA fuses
  # multiply-adds, so m, e and the masks can be compared bit for bit.
  n, steps, clip, b1 = 8, 6, 2.0, 0.5
  params = random_params(SHAPES)
  grads = worker_grads(params, n, steps)
  names = sorted(params)
  compressed = [len(SHAPES[k]) >= 2 for k in names]
  tx = scape_jax.scape(
      1e-2, density=scape_jax.DensitySchedule(density, warmup), b1=b1,
      clip_norm=clip, payload_dtype=payload_dtype, offset_bits='auto')
  run = MeshRunner(tx, params, n, static_name='density_level')
  sched = scape_jax.DensitySchedule(density, warmup)
  ref = HalfWireScapeReference([params[k] for k in names], compressed, n,
                               density=density, lr_fn=lambda i: 1e-2, b1=b1,
                               clip=clip, payload_dtype=payload_dtype)
  for t, g in enumerate(grads):
    level = sched.level(t)
    ref.density = sched.levels[sched.level(t + 1)]  # k of the next mask
    mt = _moments(run.state[0], g, names, compressed, b1)
    run.step(g, static=level)
    ref.step([[g[k][w] for k in names] for w in range(n)])
    _compare(run, ref, names, compressed, n)
    _check_nothing_is_lost(run.state[0], mt, names, compressed, n)
  # The wire did round: some residual at the mask is not zero.
  assert any(np.any(ref.e[0][j][ref.mask[j][:ref.w[j].size].reshape(
      ref.w[j].shape)] != 0) for j in range(len(names)) if compressed[j])


def _moments(state, g, names, compressed, b1):
  """m~ per worker of the compressed leaves, from the state before a step."""
  return {k: b1 * np.asarray(state.mu[k]) + (1 - b1) * g[k] +
          np.asarray(state.residual[k]) for k, c in zip(names, compressed)
          if c}


def _check_nothing_is_lost(state, mt, names, compressed, n):
  """N m + sum of the residuals == sum of the workers' m~ (fp32 sums)."""
  for k, c in zip(names, compressed):
    if c:
      kept = n * np.asarray(state.mu[k], np.float64) + np.asarray(
          state.residual[k], np.float64).sum(0)
      np.testing.assert_allclose(kept, mt[k].astype(np.float64).sum(0),
                                 rtol=1e-5, atol=1e-5, err_msg=k)


def test_single_worker_without_axis_matches_reference():
  params = random_params({'w': (16, 12), 'b': (12,)})
  grads = worker_grads(params, 1, 3)
  tx = scape_jax.scape(1e-2, density=0.1, b1=0.5, axis_name=None,
                       clip_norm=None, payload_dtype='bfloat16')
  ref = HalfWireScapeReference([params['b'], params['w']], [False, True], 1,
                               density=0.1, lr_fn=lambda i: 1e-2, b1=0.5)
  p, s = params, tx.init(params)
  for g in grads:
    u, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
    p = optax.apply_updates(p, u)
    ref.step([[g['b'][0], g['w'][0]]])
  np.testing.assert_array_equal(np.asarray(s[0].mu['w']), ref.m[1])
  np.testing.assert_array_equal(np.asarray(s[0].residual['w'])[0],
                                ref.e[0][1])
  np.testing.assert_allclose(np.asarray(p['w']), ref.w[1], rtol=2e-5)


@pytest.mark.parametrize('payload_dtype', ['bfloat16', 'float16'])
def test_rounding_is_nearest_even_and_saturates(payload_dtype):
  rng = np.random.default_rng(0)
  x = np.concatenate([rng.normal(size=4000) * 10.0 ** rng.integers(
      -6, 6, 4000), [1e38, -1e38, 7e4, -7e4, 1.0 + 2.0**-8, 0.0]])
  x = x.astype(np.float32)
  got = np.asarray(jax.jit(payload.round_to, static_argnums=1)(
      x, jnp.dtype(payload_dtype)))
  np.testing.assert_array_equal(got, ROUND[payload_dtype](x))
  assert np.isfinite(got).all()


def test_16bit_offsets_round_trip_with_sub_blocks():
  rng = np.random.default_rng(0)
  to_wire = jax.jit(masks.mask_to_wire, static_argnums=(1, 2, 3))
  from_wire = jax.jit(masks.offsets_from_wire, static_argnums=(1, 2, 3))
  to_wire16 = jax.jit(masks.offsets_to_wire16, static_argnums=1)
  from_wire16 = jax.jit(masks.offsets_from_wire16, static_argnums=(1, 2))
  for chunk, k in [(200_000, 999), (65_536, 7), (300, 1)]:
    edges = [0, chunk - 1] + [b * masks.SUB_BLOCK + d for b in range(1, 4)
                              for d in (-1, 0) if b * masks.SUB_BLOCK < chunk]
    pool = np.setdiff1d(np.arange(chunk), edges)
    take = min(k, len(edges))
    offs = np.sort(np.concatenate([rng.choice(edges, take, replace=False),
                                   rng.choice(pool, k - take, replace=False)]))
    other = np.sort(rng.choice(chunk, k, replace=False))  # a second worker
    wire = to_wire16(jnp.asarray(offs, jnp.int32), chunk)
    lay = masks.LeafLayout.create(chunk * 8, 8)
    assert wire.dtype == jnp.uint32
    assert wire.shape == (lay.wire_words(k, 'indices16'),)
    assert wire.shape == (-(-k // 2) + -(-chunk // masks.SUB_BLOCK) - 1,)
    both = jnp.stack([wire, to_wire16(jnp.asarray(other, jnp.int32),
                                      chunk)])
    back = from_wire16(both, k, chunk)
    np.testing.assert_array_equal(np.asarray(back), np.stack([offs, other]))
    bits = np.zeros(chunk, bool)
    bits[offs] = True
    own = jax.jit(masks.pack_bits)(jnp.asarray(bits))
    for enc in ('bitmap', 'indices', 'indices16'):
      sent = to_wire(own, lay, k, enc)
      assert sent.shape == (lay.wire_words(k, enc),)
      got = from_wire(sent[None], lay, k, enc)
      np.testing.assert_array_equal(np.asarray(got)[0], offs, err_msg=enc)


def test_each_leaf_gets_the_smallest_allowed_encoding():
  lay = masks.LeafLayout.create(2048 * 8, 8)  # 64 bitmap words, one block
  assert lay.encoding(21, 'auto') == 'indices'  # today's default: int32
  assert lay.encoding(21, 'auto', 'auto') == 'indices16'  # 11 words
  assert lay.mask_words(21, 'auto', 'auto') == 11
  assert lay.encoding(21, 'indices', 16) == 'indices16'
  assert lay.encoding(21, 'bitmap', 'auto') == 'bitmap'
  assert lay.encoding(205, 'auto', 'auto') == 'bitmap'  # 64 < 103
  assert lay.encoding(1, 'auto', 'auto') == 'indices'  # 1 word either way
  big = masks.LeafLayout.create(200_000 * 8, 8)  # 6250 words, 4 blocks
  assert big.mask_words(2000, 'auto', 'auto') == 1000 + 3
  assert big.encoding(2000, 'auto', 16) == 'indices16'
  assert big.encoding(13_000, 'auto', 'auto') == 'bitmap'  # 6503 > 6250
  shapes = [(1024, 520), (64, 40), (13, 7), (40,)]  # chunks 66560, 320, 12
  got = cost.scape_bytes(shapes, 8, 0.01, 'auto', offset_bits='auto')
  assert got['per_leaf'] == ('indices16', 'indices16', 'bitmap', None)
  assert got['mask_words'] == 333 + 1 + 2 + 1
  got = cost.scape_bytes(shapes, 8, 0.01, 'auto')  # the default
  assert got['per_leaf'] == ('indices', 'indices', 'bitmap', None)


def test_16bit_offsets_give_the_same_run_as_the_bitmap():
  params = random_params(BIG)
  grads = worker_grads(params, 8, 3)
  lay = masks.LeafLayout.create(1024 * 520, 8)
  assert lay.sub_blocks == 2 and lay.encoding(666, 'auto', 16) == 'indices16'
  wires = (dict(mask_encoding='bitmap'), dict(offset_bits=16))
  runs = [MeshRunner(scape_jax.scape(1e-2, density=0.01, b1=0.5, **kw),
                     params, 8, static_name='density_level') for kw in wires]
  for t, g in enumerate(grads):
    for run in runs:
      run.step(g, static=min(t, 1))
  a, b = runs[0].state[0], runs[1].state[0]
  for field in ('mu', 'residual', 'mask'):  # exact (b1 = 0.5: see above)
    for x, y in zip(jax.tree.leaves(getattr(a, field)),
                    jax.tree.leaves(getattr(b, field))):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y), field)
  for x, y in zip(jax.tree.leaves(runs[0].params),
                  jax.tree.leaves(runs[1].params)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)


def test_bytes_from_compiled_hlo_equal_the_analytic_formula():
  params = random_params(BIG)
  n, density = 8, 0.01
  tx = scape_jax.scape(1e-2, density=density, payload_dtype='bfloat16',
                       offset_bits='auto')
  run = MeshRunner(tx, params, n, static_name='density_level')
  cols = analysis.collectives(run.compiled(1), run.params, run.state,
                              run.abstract_grads(params))
  by_kind = {}
  for c in cols:
    by_kind[c.kind] = by_kind.get(c.kind, 0.0) + c.bytes_sent
  shapes = [np.shape(params[k]) for k in sorted(params)]
  an = cost.scape_bytes(shapes, n, density, 'auto', 'bfloat16',
                                 'auto')
  table = analysis.format_table(cols)
  assert {c.dtype for c in cols if c.kind == 'all-to-all'} == {'u16'}, table
  assert by_kind['all-to-all'] == pytest.approx(an['alltoall_bytes']), table
  assert by_kind['all-gather'] == pytest.approx(
      an['mask_bytes'] + an['payload_gather_bytes']), table
  assert by_kind['all-reduce'] == pytest.approx(an['allreduce_bytes']), table
  assert analysis.bytes_sent(cols) == pytest.approx(an['bytes'])
  fp32 = cost.scape_bytes(shapes, n, density, 'auto')
  assert an['bytes'] < 0.55 * fp32['bytes']


@pytest.mark.parametrize('kwargs,match', [
    (dict(payload_dtype='bf16'), "payload_dtype='bf16'"),
    (dict(payload_dtype='int8'), "payload_dtype='int8'"),
    (dict(offset_bits=8), 'offset_bits=8'),
    (dict(offset_bits='sixteen'), "offset_bits='sixteen'"),
    (dict(offset_bits=' 16'), "offset_bits=' 16'"),
    (dict(offset_bits=True), 'offset_bits=True'),
])
def test_bad_options_are_named(kwargs, match):
  with pytest.raises(ValueError, match=match) as e:
    scape_jax.scape(1e-2, density=0.1, **kwargs)
  assert 'allowed' in str(e.value)


@pytest.mark.parametrize('override,match', [
    ('payload_dtype=bf16', "payload_dtype='bf16'.*allowed"),
    ('offset_bits=24', "offset_bits='24'.*allowed"),
    ('offset_bits=wide', "offset_bits='wide'.*allowed"),
])
def test_config_rejects_bad_wire_options(override, match):
  with pytest.raises(config.ConfigError, match=match):
    config.load(None, [f'--config.optimizer.scape.{override}'])


def test_config_sets_the_wire():
  cfg = config.load(None, ['--config.optimizer.scape.payload_dtype=bfloat16',
                           '--config.optimizer.scape.offset_bits=auto'])
  assert cfg.optimizer.scape.payload_dtype == 'bfloat16'
  assert cfg.optimizer.scape.offset_bits == 'auto'
  cfg = config.load(None, ['--config.optimizer.scape.offset_bits=16'])
  assert cfg.optimizer.scape.offset_bits == '16'
  assert config.Config().optimizer.scape.payload_dtype == 'float32'
