"""SCAPE (Algorithm 1) against AdamS and an independent NumPy simulation."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import scape_jax
from scape_jax import analysis
from scape_jax.comm import masks
from scape_jax.optim import _norms
from tests.constant_folding import constant_reductions
from tests.mesh_runner import MeshRunner, assert_same_states, make_mesh
from tests.mesh_runner import random_params
from tests.mesh_runner import worker_grads as _worker_grads
from tests.reference import ScapeReference
from tests.reference import adams_reference, k_of


_SHAPES = {'w1': (64, 40), 'w2': (13, 7), 'b': (7,), 's': (40,)}


def _params(seed=0, shapes=None):
  return random_params(shapes or _SHAPES, seed)


def Runner(tx, params, n):  # pylint: disable=invalid-name
  """`tx` on an n-worker mesh, one program per density level."""
  return MeshRunner(tx, params, n, static_name='density_level')


def _scape_state(state):
  return state[0]


def test_density_one_equals_adams_on_mean_gradient():
  params = _params()
  grads = _worker_grads(params, 8, 20)
  tx = scape_jax.scape(1e-2, density=1.0, clip_norm=None)
  run = Runner(tx, params, 8)
  ref = scape_jax.adams(1e-2)
  rp = {k: jnp.asarray(v) for k, v in params.items()}
  rs = ref.init(rp)
  for g in grads:
    run.step(g)
    u, rs = ref.update(jax.tree.map(lambda x: x.mean(0), g), rs, rp)
    rp = optax.apply_updates(rp, u)
    for k in params:
      np.testing.assert_allclose(np.asarray(run.params[k]), rp[k],
                                 rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('density', [0.1, 0.01])
def test_matches_numpy_simulation_of_algorithm_1(density):
  params = _params()
  n, steps, clip = 8, 20, 2.0
  grads = _worker_grads(params, n, steps)
  names = sorted(params)  # jax flattens dicts in sorted key order
  compressed = [params[k].ndim >= 2 for k in names]
  lr_fn = optax.linear_schedule(1e-2, 1e-3, steps)
  tx = scape_jax.scape(lr_fn, density=density, clip_norm=clip)
  run = Runner(tx, params, n)
  ref = ScapeReference([params[k] for k in names], compressed, n,
                       density=density, lr_fn=lambda i: float(lr_fn(i)),
                       clip=clip)
  clipped, restarted, carried = 0, 0, 0
  for g in grads:
    run.step(g)
    in_force = [ref.mask[j][:p.size].reshape(p.shape) if compressed[j] else
                np.zeros(p.shape, bool) for j, p in enumerate(ref.w)]
    restarted += sum(int(np.sum((m == 0) & c))
                     for m, c in zip(ref.m, in_force))
    clipped += ref.step([[g[k][w] for k in names] for w in range(n)]) > clip
    # Compressed coordinates outside this step's M that still have m != 0.
    carried += sum(int(np.sum((m != 0) & ~c)) for m, c, z in
                   zip(ref.m, in_force, compressed) if z)
    st = _scape_state(run.state)
    for j, k in enumerate(names):
      np.testing.assert_allclose(np.asarray(run.params[k]), ref.w[j],
                                 rtol=2e-5, atol=2e-6, err_msg=k)
      np.testing.assert_allclose(np.asarray(st.mu[k]), ref.m[j],
                                 rtol=2e-5, atol=2e-6, err_msg=k)
      if not compressed[j]:
        continue
      c = ref.chunk[j]
      bits = np.asarray(masks.unpack_bits(st.mask[k], c))
      for w in range(n):
        np.testing.assert_allclose(np.asarray(st.residual[k])[w], ref.e[w][j],
                                   rtol=2e-5, atol=2e-6, err_msg=k)
        np.testing.assert_array_equal(bits[w], ref.chunk_mask(j, w))
    # The logged norm: ||e^n|| over the compressed leaves, per worker.
    np.testing.assert_allclose(
        np.asarray(st.residual_norm).reshape(-1),
        [np.sqrt(sum(np.sum(np.square(ref.e[w][j], dtype=np.float64))
                     for j in range(len(names)) if compressed[j]))
         for w in range(n)], rtol=1e-4)
  # The test must exercise sparsity and clipping, not only the dense path.
  assert float(st.density) == pytest.approx(density)
  assert float(jnp.mean(st.residual_norm)) > 0
  assert clipped > steps // 2
  assert restarted > 0  # coordinates entered M with m = 0
  assert carried == 0  # Algorithm 1 zeroes m outside M


@pytest.mark.parametrize('n', [1, 2, 4, 8])
def test_chunk_mask_invariants(n):
  shapes = {'a': (10, 3), 'b': (7, 5), 'c': (33,), 'n': (5,)}
  params = _params(2, shapes)
  compress = {'a': True, 'b': True, 'c': True, 'n': False}
  density = 0.3
  tx = scape_jax.scape(1e-2, density=density, compress=compress)
  run = Runner(tx, params, n)
  for g in _worker_grads(params, n, 3, seed=3):
    run.step(g)
  st = _scape_state(run.state)
  assert isinstance(st.residual['n'], optax.MaskedNode)
  assert np.all(np.asarray(st.mu['n']) != 0)  # dense leaf: mask of all ones
  for name in ('a', 'b', 'c'):
    size = params[name].size
    c = -(-size // n)
    k = k_of(density, c)
    bits = np.asarray(masks.unpack_bits(st.mask[name], c))
    assert bits.shape == (n, c)
    union = np.zeros(c * n, int)
    for w in range(n):
      assert bits[w].sum() == k  # static shape: exactly k, padding included
      real = max(0, min(c, size - w * c))
      assert bits[w][:real].sum() == min(k, real)
      union[w * c:(w + 1) * c] += bits[w]
    assert union.max() <= 1  # disjoint by construction
    assert union[:size].sum() == sum(
        min(k, max(0, min(c, size - w * c))) for w in range(n))


def test_wire_bytes_from_compiled_step():
  from scape_jax import analysis
  params = _params(0, {'w1': (256, 64), 'w2': (128, 96), 'b': (64,),
                       's': (96,)})
  n, density = 8, 0.01
  for encoding in ('bitmap', 'indices', 'auto'):
    tx = scape_jax.scape(1e-2, density=density, mask_encoding=encoding)
    run = Runner(tx, params, n)
    cols = analysis.collectives(run.compiled(1), run.params, run.state,
                                run.abstract_grads(params))
    selected, words = 0, 0
    for name in ('w1', 'w2'):
      lay = masks.LeafLayout.create(params[name].size, n)
      k = k_of(density, lay.chunk_size)
      selected += n * k
      words += lay.mask_words(k, encoding)
    dense = params['b'].size + params['s'].size
    reduce = [c for c in cols if c.kind == 'all-reduce']
    gather = [c for c in cols if c.kind == 'all-gather']
    assert sum(c.elements for c in reduce) <= 1.05 * (selected + dense)
    assert sum(c.elements for c in reduce) >= selected + dense
    smallest = min(params['w1'].size, params['w2'].size)
    assert all(c.elements < smallest for c in cols), analysis.format_table(cols)
    assert len(gather) == 1 and gather[0].elements == n * words
    assert gather[0].dtype in ('u32', 's32')
  # At 1% auto sends offsets: k words per leaf instead of c/32.
  assert encoding == 'auto' and words == k_of(density, 2048) + k_of(
      density, 1536) < (2048 + 1536) // 32


def test_density_warmup_compiles_one_program_per_level():
  params = _params(0, {'w': (64, 40), 'b': (40,)})
  warmup = 100
  sched = scape_jax.DensitySchedule(0.01, warmup)
  assert len(sched.levels) <= 8
  assert sched.levels[0] == 1.0 and sched.levels[-1] == 0.01
  assert all(a > b for a, b in zip(sched.levels, sched.levels[1:]))
  tx = scape_jax.scape(1e-3, density=0.01, density_warmup_steps=warmup)
  run = Runner(tx, params, 8)
  grads = _worker_grads(params, 8, 1)[0]
  seen = []
  for step in range(warmup + 5):
    level = sched.level(step)
    run.step(grads, level)
    seen.append(float(_scape_state(run.state).density))
  assert run.traces == len(sched.levels) <= 8
  assert seen[0] == 1.0 and seen[-1] == pytest.approx(0.01)
  assert all(a >= b for a, b in zip(seen, seen[1:]))


def test_switch_fallback_equals_static_levels():
  params = _params(0, {'w': (24, 10), 'b': (10,)})
  grads = _worker_grads(params, 4, 8)
  tx = scape_jax.scape(1e-2, density=0.1, density_warmup_steps=4)
  sched = scape_jax.DensitySchedule(0.1, 4)
  a, b = Runner(tx, params, 4), Runner(tx, params, 4)
  for i, g in enumerate(grads):
    a.step(g, sched.level(i))
    b.step(g)  # no density_level: lax.switch on the state's count
  for x, y in zip(jax.tree.leaves((a.params, a.state)),
                  jax.tree.leaves((b.params, b.state))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


_RANGE_CASES = [
    ('scape', {}), ('scape', {'mask_encoding': 'indices', 'offset_bits': 16}),
    ('scape', {'payload_dtype': 'bfloat16'}), ('scape_local_adam', {}),
    ('scape_dist', {})]


@pytest.mark.parametrize('method, wire', _RANGE_CASES)
def test_the_warmup_levels_share_one_program_of_the_same_numbers(method,
                                                                 wire):
  """`shared_warmup`: `density_level=(1, last - 1)` is one program for
  every sparse level before the last (its buffers sized for level 1, the
  level traced from the count, the offsets past a level's k repeating its
  last); the states equal those of each level's own program."""
  sched = scape_jax.DensitySchedule(0.1, 5, shared_warmup=True)
  kwargs = [sched.update_kwargs(i) for i in range(8)]
  assert [k['density_level'] for k in kwargs] == [
      0, (1, 4), (1, 4), (1, 4), (1, 4), 5, 5, 5]
  assert [scape_jax.DensitySchedule(0.1, 5).update_kwargs(i)['density_level']
          for i in range(8)] == [0, 1, 2, 3, 4, 5, 5, 5]
  _assert_range_equals_levels(
      getattr(scape_jax, method)(1e-2, density=sched, **wire), sched, 8,
      (3, 6))


@pytest.mark.parametrize('method', ['scape', 'scape_local_adam', 'scape_dist'])
def test_no_program_reduces_constants(method):
  """No update folds a reduction of constants, which XLA does element by
  element: at the dense level 0, the all-ones masks' words and the norm of
  residuals that stay zero (seconds per leaf on a GPU). Every program of a
  shared warmup is checked."""
  params = _params(0, {'w': (64, 32), 'b': (32,)})
  sched = scape_jax.DensitySchedule(0.1, 5, shared_warmup=True)
  tx = getattr(scape_jax, method)(1e-2, density=sched, axis_name=None)
  state = tx.init(params)
  for level in {repr(sched.update_kwargs(i)['density_level']):
                sched.update_kwargs(i)['density_level']
                for i in range(8)}.values():
    jaxpr = jax.make_jaxpr(lambda g, s, p, level=level: tx.update(
        g, s, p, density_level=level))(params, state, params)
    assert constant_reductions(jaxpr.jaxpr) == [], level


def test_a_range_below_one_32nd_clips_by_the_full_norm():
  # Level 1 at d = 0.0215 <= 1/32: a level's own program sums the clip's
  # norm over its N*k values, which the range's repeat: it sums over gbar.
  sched = scape_jax.DensitySchedule(1e-5, 3, shared_warmup=True)
  assert sched.levels[1] < 1 / 32 and sched.update_kwargs(1) == {
      'density_level': (1, 2)}
  _assert_range_equals_levels(scape_jax.scape(1e-2, density=sched), sched, 5,
                              (3, 4))


def _assert_range_equals_levels(tx, sched, steps, traces):
  params = _params(0, {'w': (40, 24), 'v': (9, 13), 'b': (24,)})
  grads = _worker_grads(params, 4, steps)
  ours, each = Runner(tx, params, 4), Runner(tx, params, 4)
  for i, g in enumerate(grads):
    ours.step(g, sched.update_kwargs(i)['density_level'])
    each.step(g, sched.level(i))
  assert (ours.traces, each.traces) == traces
  assert_same_states(jax.tree.leaves((ours.params, ours.state)),
                     jax.tree.leaves((each.params, each.state)))


def test_a_range_of_levels_sends_level_ones_bytes_and_refuses_bad_ranges():
  params = _params(0, {'w': (64, 40), 'b': (40,)})
  sched = scape_jax.DensitySchedule(0.1, 5)
  tx = scape_jax.scape(1e-2, density=sched)
  run = Runner(tx, params, 4)
  args = (run.params, run.state, run.abstract_grads(params))
  sent = [analysis.bytes_sent(analysis.collectives(run.compiled(level), *args))
          for level in ((1, 4), 1, 4)]
  assert sent[0] == sent[1] > sent[2]
  for bad in ((0, 4), (2, 1), (1, 6), (1.5, 4), (1,)):
    with pytest.raises(ValueError, match=re.escape(f'density_level={bad!r}')):
      run.compiled(bad).trace(*args)


def test_composes_with_optax_chain_and_clipping():
  params = _params(0, {'w': (16, 8), 'b': (8,)})
  grads = _worker_grads(params, 8, 3)
  chained = optax.chain(optax.clip_by_global_norm(0.1),
                        scape_jax.scape(1e-2, density=0.25))
  plain = scape_jax.scape(1e-2, density=0.25)
  a, b = Runner(chained, params, 8), Runner(plain, params, 8)
  for g in grads:
    a.step(g)
    clipped = {}
    norms = np.sqrt(sum(np.sum(g[k]**2, axis=tuple(range(1, g[k].ndim)))
                        for k in g))
    for k in g:
      shape = (-1,) + (1,) * (g[k].ndim - 1)
      clipped[k] = (g[k] * np.minimum(1, 0.1 / norms).reshape(shape)).astype(
          np.float32)
    b.step(clipped)
  for k in params:
    np.testing.assert_allclose(np.asarray(a.params[k]),
                               np.asarray(b.params[k]), rtol=1e-5, atol=1e-7)


def test_inject_hyperparams_learning_rate():
  params = _params(0, {'w': (16, 8), 'b': (8,)})
  grads = _worker_grads(params, 8, 2)
  injected = optax.inject_hyperparams(
      scape_jax.scape, static_args=('density', 'density_warmup_steps'))(
          learning_rate=0.5, density=0.25)
  a = Runner(injected, params, 8)
  a.state.hyperparams['learning_rate'] = jnp.asarray(1e-2)
  b = Runner(scape_jax.scape(1e-2, density=0.25), params, 8)
  for g in grads:
    a.step(g)
    b.step(g)
  for k in params:
    np.testing.assert_allclose(np.asarray(a.params[k]),
                               np.asarray(b.params[k]), rtol=1e-5, atol=1e-7)


def test_state_type_is_stable_and_init_is_abstract():
  params = _params(0, {'w': (16, 8), 'b': (8,)})
  tx = scape_jax.scape(1e-2, density=0.25)
  mesh = make_mesh(8)

  def body(p, g):
    s0 = tx.init(p)
    _, s1 = tx.update(jax.tree.map(lambda x: x[0], g), s0, p)
    assert jax.tree.map(jax.typeof, s0) == jax.tree.map(jax.typeof, s1)
    return p

  g = jax.device_put(_worker_grads(params, 8, 1)[0],
                     NamedSharding(mesh, P('data')))
  p = jax.device_put(params, NamedSharding(mesh, P()))
  jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P('data')),
                        out_specs=P()))(p, g)

  single = scape_jax.scape(1e-2, density=0.25, axis_name=None)
  s0 = single.init(params)
  _, s1 = single.update(params, s0, params)
  _, s2 = jax.jit(single.update)(params, s0, params)
  types = [jax.tree.map(jax.typeof, s) for s in (s0, s1, s2)]
  assert types[0] == types[1] == types[2]

  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                          params)
  with jax.set_mesh(mesh):
    shapes = jax.eval_shape(tx.init, abstract)
  assert shapes[0].residual['w'].shape == (8, 16, 8)
  assert shapes[0].mask['w'].shape == (8, 1)  # 128 / 8 = 16 bits -> 1 word


def _run_single(tx, params, grads):
  """One worker (axis_name=None), no shard_map: every state after each step."""
  state, out = tx.init(params), []
  update = jax.jit(tx.update)
  for g in grads:
    u, state = update(jax.tree.map(lambda x: x[0], g), state, params)
    params = optax.apply_updates(params, u)
    out.append(jax.tree.leaves((params, state)))
  return out


_SELECT_PARAMS = {'w': (40, 25), 'v': (7, 300), 'b': (25,)}


def test_every_select_gives_the_same_masks_and_updates():
  # The sort path and the sort-free jnp path on 4 workers: the same masks
  # to the last bit, over a density warmup, so the same states (the floats
  # to a few ulp: `assert_same_states`). (The encodings decode to the same
  # offsets whatever the select: test_bitmap_and_indices_agree.)
  params = _params(4, _SELECT_PARAMS)
  grads = _worker_grads(params, 4, 3, seed=5)
  schedule = scape_jax.DensitySchedule(0.1, 2)
  runs = []
  for select in ('sort', 'threshold'):
    run = Runner(scape_jax.scape(1e-2, density=schedule,
                                 mask_encoding='indices', select=select),
                 params, 4)
    for i, g in enumerate(grads):
      run.step(g, schedule.level(i))
    runs.append((run.params, run.state))
  assert_same_states(*runs)


def test_the_pallas_select_gives_the_sort_run():
  # The Pallas kernels on one worker (Pallas' interpreter, which runs them
  # on CPU, does not support shard_map's varying types) against the sort:
  # the same masks to the last bit, over a density warmup, so the same
  # states (`assert_same_states`).
  params = _params(4, _SELECT_PARAMS)
  grads = _worker_grads(params, 4, 3, seed=5)
  schedule = scape_jax.DensitySchedule(0.1, 2)
  sort, pallas = [_run_single(scape_jax.scape(
      1e-2, density=schedule, axis_name=None, mask_encoding='indices',
      select=select), params, grads) for select in ('sort', 'pallas_radix')]
  assert_same_states(sort, pallas)


def test_pallas_select_lowers_the_update_for_cuda():
  params = _params(0, {'w': (64, 40), 'b': (40,)})
  tx = scape_jax.scape(1e-2, density=0.1, select='pallas_radix')
  mesh = make_mesh(4)
  with jax.set_mesh(mesh):
    state = tx.init(params)
  specs = scape_jax.state_partition_specs(state)
  step = jax.jit(jax.shard_map(
      lambda p, s, g: tx.update(jax.tree.map(lambda x: x[0], g), s, p,
                                density_level=1),
      mesh=mesh, in_specs=(P(), specs, P('data')), out_specs=(P(), specs)))
  put = lambda x, spec: jax.device_put(x, jax.tree.map(
      lambda s: NamedSharding(mesh, s), spec))
  grads = put(_worker_grads(params, 4, 1)[0], P('data'))
  text = step.trace(put(params, P()), put(state, specs), grads).lower(
      lowering_platforms=('cuda',)).as_text()
  assert '__gpu$xla.gpu.triton' in text
  assert 'scape_count_rows' in text and 'scape_mask_rows' in text


@pytest.mark.parametrize('density', [0.0, -0.1, 1.5, float('nan'), '0.1', True])
def test_rejects_density_outside_unit_interval(density):
  with pytest.raises(ValueError, match=r'density=.*\(0, 1\]'):
    scape_jax.scape(1e-2, density=density)


def test_rejects_unbound_axis():
  tx = scape_jax.scape(1e-2, density=0.1, axis_name='data')
  with pytest.raises(ValueError, match="axis_name='data' is not bound"):
    tx.init({'w': jnp.zeros((4, 4))})


def test_rejects_mismatched_compress_tree():
  tx = scape_jax.scape(1e-2, density=0.1, axis_name=None,
                       compress={'w': True})
  with pytest.raises(ValueError, match='compress tree does not match'):
    tx.init({'w': jnp.zeros((4, 4)), 'b': jnp.zeros((4,))})



def test_rejects_bad_mask_encoding():
  with pytest.raises(ValueError, match="mask_encoding='zip'"):
    scape_jax.scape(1e-2, density=0.1, mask_encoding='zip')


def test_rejects_bad_select():
  with pytest.raises(ValueError, match=r"select='heap'.*'threshold'"):
    scape_jax.scape(1e-2, density=0.1, select='heap')


def test_sum_squares_is_the_sum_of_squares_outside_ynnpack():
  rng = np.random.default_rng(0)
  # One running sum over 4M entries was off by 2e-5 to 1e-4 relative.
  for shape in ((300, 70), (2048, 2048), (1 << 22,), (2049,), (0,), (5, 0)):
    y = rng.normal(size=shape).astype(np.float32)
    np.testing.assert_allclose(float(jax.jit(_norms.sum_squares)(y)),
                               np.sum(y.astype(np.float64)**2), rtol=2e-6,
                               err_msg=str(shape))
  x = rng.normal(size=(300, 70)).astype(np.float32)
  plain = jax.jit(lambda y: jnp.sum(y * y)).lower(x).compile().as_text()
  ours = jax.jit(_norms.sum_squares).lower(x).compile().as_text()
  if '%ynn_fusion' in plain:  # XLA:CPU builds with YNNPACK fusions
    assert '%ynn_fusion' not in ours


def test_a_dense_step_before_a_dense_one_compiles_no_mask_search():
  """`next_dense=True` (what the trainer passes in a warmup's first steps):
  the masks are all ones, no search is compiled (no `while` in the
  program: 'auto' on CPU is the threshold search), and the numbers are the
  same as without it. At a sparse level it is refused."""
  params = _params(0, {'w': (256, 64), 'b': (64,)})
  schedule = scape_jax.DensitySchedule(0.1, 50)  # level 0 for 4 updates
  assert schedule.update_kwargs(2) == {'density_level': 0, 'next_dense': True}
  assert schedule.update_kwargs(3) == {'density_level': 0}  # then level 1
  assert schedule.update_kwargs(4) == {'density_level': 1}
  tx = scape_jax.scape(1e-2, density=schedule)
  grads = _worker_grads(params, 4, 2)
  runs = []
  for next_dense in (False, True):
    run = MeshRunner(tx, params, 4, static_name='next_dense')
    original = run.tx.update
    run.tx = run.tx._replace(update=lambda g, s, p, **kw: original(
        g, s, p, density_level=0, **kw))
    text = run.compiled(next_dense).lower(
        run.params, run.state, run.abstract_grads(params)).as_text()
    assert ('stablehlo.while' in text) != next_dense
    for g in grads:
      run.step(g, next_dense)
    runs.append((run.params, run.state))
  assert_same_states(*runs)
  single = scape_jax.scape(1e-2, density=schedule, axis_name=None)
  with pytest.raises(ValueError, match='next_dense=True with density_level=1'):
    single.update(params, single.init(params), params, density_level=1,
                  next_dense=True)


def test_a_dense_step_averages_the_leaves_as_they_are():
  """Where every leaf is dense (level 0), the payload all-reduce averages
  the leaves as they are (XLA combines them), the tree's elements and no
  more, with no buffer as large as the tree that they were copied into. A
  sparse level sends one buffer: one all-reduce."""
  params = _params(0, {'w': (256, 64), 'v': (64, 32), 'b': (64,)})
  total = sum(np.size(p) for p in params.values())
  schedule = scape_jax.DensitySchedule(0.1, 50)
  run = MeshRunner(scape_jax.scape(1e-2, density=schedule), params, 4,
                   static_name='density_level')
  for level in (0, len(schedule.levels) - 1):
    hlo = run.compiled(level).lower(
        run.params, run.state, run.abstract_grads(params)).compile().as_text()
    sums = [c for c in analysis.collectives_from_hlo(hlo)
            if c.kind == 'all-reduce']
    if level == 0:
      assert sum(c.elements for c in sums) == total
      assert f'f32[{total}]' not in hlo
    else:
      assert len(sums) == 1 and sums[0].elements < total
