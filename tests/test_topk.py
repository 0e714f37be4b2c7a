"""Exact chunk top-k: the sort-free selections against the sort path and NumPy."""

import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from scape_jax.comm import masks, radix, search, topk

NAN_KEY = 0x7F800001


def _numpy_words(x, num_valid, k):
  """Independent reference: stable argsort of -key, packed little-endian."""
  c = x.size
  key = (np.abs(x).astype(np.float32).view(np.int32) & 0x7FFFFFFF)
  key = np.minimum(key, NAN_KEY).astype(np.int64)
  key[np.arange(c) >= num_valid] = -1  # padding after every real entry
  bits = np.zeros(-(-c // 32) * 32, bool)
  bits[np.argsort(-key, kind='stable')[:k]] = True
  return np.packbits(bits, bitorder='little').view('<u4')


@functools.cache
def _selector(select, width=None):
  """One jitted program per chunk size: num_valid and k are traced.
  'radix': the jnp reference of 'pallas_radix''s passes."""

  def run(x, num_valid, k):
    if select == 'radix':
      return radix.radix_topk_words_many([x], [num_valid], [k])[0]
    return topk.chunk_topk_words(x, num_valid, width or x.shape[0], k,
                                 select=select)

  return jax.jit(run)


def _data(kind, c, rng):
  x = rng.normal(size=c).astype(np.float32)
  if kind == 'equal':
    return np.full(c, -0.75, np.float32)
  if kind == 'quantised':  # a few distinct magnitudes: heavy ties
    return (np.round(x * 2) / 2).astype(np.float32)
  if kind == 'zeros':  # mostly +-0.0, a few nonzero
    return np.where(rng.random(c) < 0.03, x, np.where(x > 0, 0.0, -0.0)
                    ).astype(np.float32)
  if kind == 'denormal':
    return (x * 1e-40).astype(np.float32)
  return x


def _cases(c):
  """(num_valid, k): k = 1, k = chunk, densities, padded chunks."""
  out = set()
  for num_valid in {c, max(1, (2 * c) // 3)}:
    for k in {1, c, max(1, c // 10), max(1, c // 100), num_valid,
              min(c, num_valid + 1)}:
      out.add((num_valid, k))
  return sorted(out)


@pytest.mark.parametrize('select', ['threshold', 'radix'])
@pytest.mark.parametrize('kind', ['normal', 'equal', 'quantised', 'zeros',
                                  'denormal'])
@pytest.mark.parametrize('c', [1, 37, 1000, 20_011, 70_000])
def test_sort_free_selects_equal_sort_and_numpy(select, kind, c):
  rng = np.random.default_rng(c)
  x = _data(kind, c, rng)
  for num_valid, k in _cases(c):
    args = (jnp.asarray(x), jnp.int32(num_valid), jnp.int32(k))
    got = np.asarray(_selector(select)(*args))
    np.testing.assert_array_equal(got, _numpy_words(x, num_valid, k),
                                  err_msg=f'{kind} c={c} n={num_valid} k={k}')
    np.testing.assert_array_equal(got, np.asarray(_selector('sort')(*args)))


def test_sort_path_equals_the_mask_reference_and_its_top_k_width():
  # masks.chunk_topk_bits is the pre-existing top-k; with width < c it is
  # lax.top_k, and k a traced prefix of that width (SCAPE's next level).
  rng = np.random.default_rng(0)
  x = rng.normal(size=500).astype(np.float32)
  x[[3, 40, 77]] = 0.5  # ties
  valid = np.arange(500) < 450
  for width, k in [(500, 500), (60, 60), (60, 7), (1, 1)]:
    expected = np.asarray(jax.jit(
        lambda x, valid, k: masks.pack_bits(masks.chunk_topk_bits(
            x, valid, width, k)))(jnp.asarray(x), jnp.asarray(valid),
                                  jnp.int32(k)))
    np.testing.assert_array_equal(expected, _numpy_words(x, 450, k))
    for select in ('sort', 'threshold', 'radix'):
      got = _selector(select, width)(jnp.asarray(x), jnp.int32(450),
                                     jnp.int32(k))
      np.testing.assert_array_equal(np.asarray(got), expected)


@pytest.mark.parametrize('kind', ['equal', 'quantised', 'zeros'])
def test_sort_below_full_width_cuts_ties_at_the_kth_offset(kind):
  """lax.top_k (width < c) with ties straddling the k-th key: the bits are
  the keys above it and the ties at it up to the k-th's offset."""
  x = _data(kind, 1000, np.random.default_rng(1))
  for num_valid in (1000, 700):
    for k in (1, 37, 200):
      got = _selector('sort', 200)(jnp.asarray(x), jnp.int32(num_valid),
                                   jnp.int32(k))
      np.testing.assert_array_equal(np.asarray(got),
                                    _numpy_words(x, num_valid, k),
                                    err_msg=f'{kind} n={num_valid} k={k}')


def test_sort_below_full_width_stores_one_chunk_sized_array():
  """The top-k's fp32 operand is the only chunk-sized temporary: the tie
  compare reads it back as int32 keys, where a second stored int32 copy
  of the keys made the update's 'sort' temporaries 1.08x the fp32 tree."""
  c = 1 << 20
  fn = jax.jit(lambda x, k: topk.sort_topk_words(x, c - 3, 1 << 14, k))
  temps = fn.lower(jax.ShapeDtypeStruct((c,), jnp.float32),
                   jax.ShapeDtypeStruct((), jnp.int32)).compile(
                   ).memory_analysis().temp_size_in_bytes
  assert 4 * c <= temps < 1.5 * 4 * c


def test_nan_and_inf_rank_above_every_finite_value():
  # Documented order: NaN (any sign or payload) > +-inf > finite, by |x|;
  # ties (NaN with NaN, -inf with +inf) to the lower offset.
  nan2 = np.array([0x7FC00123], np.uint32).view(np.float32)[0]  # a payload
  x = np.array([1.0, np.nan, -np.inf, 3.0, -nan2, 0.0, np.inf, -5.0],
               np.float32)
  order = [1, 4, 2, 6, 7, 3, 0, 5]
  for k in range(1, 9):
    expected = np.zeros(32, bool)
    expected[order[:k]] = True
    expected = np.packbits(expected, bitorder='little').view('<u4')
    for select in ('sort', 'threshold', 'radix', 'pallas_radix'):
      got = _selector(select)(jnp.asarray(x), jnp.int32(8), jnp.int32(k))
      np.testing.assert_array_equal(np.asarray(got), expected,
                                    err_msg=f'{select} k={k}')
    # lax.top_k (width < c) on the fp32 view of the keys, with padding.
    got = _selector('sort', 7)(jnp.asarray(x), jnp.int32(8),
                               jnp.int32(min(k, 7)))
    expected = np.zeros(32, bool)
    expected[order[:min(k, 7)]] = True
    np.testing.assert_array_equal(
        np.asarray(got), np.packbits(expected, bitorder='little').view('<u4'),
        err_msg=f'top_k k={k}')


def test_nan_and_inf_in_large_chunks():
  rng = np.random.default_rng(1)
  x = rng.normal(size=30_000).astype(np.float32)
  x[rng.choice(30_000, 300, replace=False)] = np.nan
  x[rng.choice(30_000, 300, replace=False)] = -np.inf
  for k in (1, 299, 300, 650, 3000):
    for select in ('threshold', 'radix'):
      got = _selector(select)(jnp.asarray(x), jnp.int32(30_000),
                              jnp.int32(k))
      np.testing.assert_array_equal(np.asarray(got),
                                    _numpy_words(x, 30_000, k), err_msg=select)


@pytest.mark.parametrize('kind', ['normal', 'equal', 'quantised', 'zeros',
                                  'denormal'])
@pytest.mark.parametrize('select, twin', [('pallas_radix', 'radix')])
def test_pallas_selects_equal_their_jnp_twins_and_numpy(select, twin, kind):
  # The Pallas kernels run in the interpreter on CPU.
  rng = np.random.default_rng(7)
  for c in (45, 5000):
    x = _data(kind, c, rng)
    for num_valid, k in _cases(c):
      args = (jnp.asarray(x), jnp.int32(num_valid), jnp.int32(k))
      got = np.asarray(_selector(select)(*args))
      np.testing.assert_array_equal(got, _numpy_words(x, num_valid, k),
                                    err_msg=f'{kind} c={c} k={k}')
      np.testing.assert_array_equal(got, np.asarray(_selector(twin)(*args)))


def test_auto_resolves_per_lowering_platform():
  one = jax.jit(topk.chunk_topk_words, static_argnums=2,
                static_argnames='select')
  x = jnp.ones((100,))
  words = one(x, 100, 10, 10)
  assert int(jnp.sum(jax.lax.population_count(words))) == 10
  for platform, choice in topk.AUTO_SELECT.items():
    assert choice in topk.SELECTS and choice != 'auto', platform
  # A narrow top-k takes the sort on CPU, a wide one the search.
  assert topk.auto_select('cpu', topk.AUTO_SORT_MAX_WIDTH['cpu']) == 'sort'
  assert topk.auto_select('cpu', topk.AUTO_SORT_MAX_WIDTH['cpu'] + 1) == (
      topk.AUTO_SELECT['cpu'])
  assert topk.auto_select('tpu', 1) == topk.AUTO_SELECT['tpu']
  assert topk.backend_platform() == 'cpu'
  x = jax.random.normal(jax.random.key(1), (4096,))
  for width in (16, 2048):
    np.testing.assert_array_equal(
        np.asarray(one(x, 4000, width, width)),
        np.asarray(one(x, 4000, width, width, select='sort')))
  # Many chunks in one call, narrow and wide mixed: each chunk's bits as
  # the sort gives them alone.
  y = jax.random.normal(jax.random.key(2), (3000,))
  chunks, widths = [x, y, x[:2500], y[:900]], [16, 1500, 2000, 900]
  valid, ks = [4000, 2999, 2500, 900], [16, 1234, 1999, 700]
  got = jax.jit(topk.chunks_topk_words, static_argnums=2)(
      chunks, valid, tuple(widths), ks)
  for g, c, n, w, k in zip(got, chunks, valid, widths, ks):
    np.testing.assert_array_equal(
        np.asarray(g), np.asarray(one(c, n, w, k, select='sort')))


def test_auto_lowers_per_platform_for_all_chunks_at_once():
  # One traced program; the platform it is lowered for picks the branch
  # (AUTO_SELECT: measured on an H100, docs/benchmarks.md section 2): the
  # search on cpu, the Triton radix passes on cuda (both chunks in one set
  # of passes), the sort on rocm.
  x, y = jnp.ones((1 << 14,)), jnp.ones((5000,))
  traced = jax.jit(lambda x, y, k: topk.chunks_topk_words(
      [x, y], [x.size, y.size], [4096, 2000], [k, k])).trace(
          x, y, jnp.int32(100))
  text = {p: traced.lower(lowering_platforms=(p,)).as_text()
          for p in ('cpu', 'cuda', 'rocm')}
  assert 'stablehlo.while' in text['cpu']  # the threshold search
  assert '__gpu$xla.gpu.triton' not in text['cpu']
  for gpu in ('cuda', 'rocm'):
    assert 'stablehlo.while' not in text[gpu]
  assert 'chlo.top_k' in text['rocm']  # lax.top_k
  assert 'chlo.top_k' not in text['cuda']
  assert '__gpu$xla.gpu.triton' in text['cuda']
  # One set of passes: the kernels of one chunk's program (count, tie
  # count, mask), where two chunks selected apart lower them per shape.
  one = jax.jit(lambda x, k: topk.chunks_topk_words(
      [x], [x.size], [4096], [k])).trace(x, jnp.int32(100)).lower(
          lowering_platforms=('cuda',)).as_text()
  assert text['cuda'].count('custom_call') == one.count('custom_call') == 3


def test_auto_traces_each_select_once():
  # cpu, tpu and the default branch all take the search: one trace of it
  # per chunk, not one per platform (a trace of a large update costs
  # seconds).
  calls = []
  search = topk.threshold_topk_words

  def counted(*args, **kwargs):
    calls.append(1)
    return search(*args, **kwargs)

  x = jnp.ones((1 << 14,))
  with mock.patch.object(topk, 'threshold_topk_words', counted):
    jax.jit(lambda x, k: topk.chunks_topk_words(
        [x, x[:5000]], [x.size, 5000], [4096, 2000], [k, k])).trace(
            x, jnp.int32(100))
  assert len(calls) == 2


def test_radix_lowers_without_loops_or_branches_and_pins_any_key():
  # Straight-line on every platform: no `while` whose condition XLA's GPU
  # runtime would read on the host, no conditional.
  x = jnp.ones((1 << 14,))
  traced = jax.jit(lambda x, k: radix.radix_topk_words_many(
      [x], [x.size], [k])[0]).trace(x, jnp.int32(100))
  for platform in ('cpu', 'cuda', 'tpu'):
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    for op in ('stablehlo.while', 'stablehlo.case', 'stablehlo.if',
               'stablehlo.sort', 'chlo.top_k'):
      assert op not in text, (platform, op)
  # 'pallas_radix': the same passes as Triton kernels on cuda (its only
  # `case` is pallas_call's switch on the lowering platform, a constant).
  text = jax.jit(lambda x, k: topk.chunk_topk_words(
      x, x.size, 4096, k, select='pallas_radix')).trace(
          x, jnp.int32(100)).lower(lowering_platforms=('cuda',)).as_text()
  assert '__gpu$xla.gpu.triton' in text
  for op in ('stablehlo.while', 'stablehlo.sort', 'chlo.top_k'):
    assert op not in text, op
  # RADIX_PASSES narrow [PAD_KEY, NAN_KEY + 1) to one key, one pass fewer
  # would not.
  span = search.NAN_KEY + 1 - search.PAD_KEY
  assert span <= radix.RADIX ** radix.RADIX_PASSES
  assert span > radix.RADIX ** (radix.RADIX_PASSES - 1)


def test_radix_on_keys_spread_over_every_binade():
  # Magnitudes from denormals to 2**127, +-inf and NaN: the passes must
  # pin T wherever in the key range it lies.
  rng = np.random.default_rng(5)
  c = 10_000
  x = np.ldexp(rng.random(c) + 0.5, rng.integers(-149, 128, c))
  x = (x * rng.choice([-1.0, 1.0], c)).astype(np.float32)
  x[rng.choice(c, 20, replace=False)] = np.inf
  x[rng.choice(c, 20, replace=False)] = np.nan
  for k in (1, 20, 41, 500, 5000, 9999, c):
    got = _selector('radix')(jnp.asarray(x), jnp.int32(c), jnp.int32(k))
    np.testing.assert_array_equal(np.asarray(got), _numpy_words(x, c, k),
                                  err_msg=f'k={k}')


def test_rejects_bad_select_and_width():
  with pytest.raises(ValueError, match=r"select='fast'.*allowed"):
    topk.chunk_topk_words(jnp.ones(8), 8, 2, 2, select='fast')
  with pytest.raises(ValueError, match=r'width=9 must be in \[1, 8\]'):
    topk.chunk_topk_words(jnp.ones(8), 8, 9, 2)


@pytest.mark.parametrize('n', [1, 127, 128, 129, 5000, 16_385, 70_001])
def test_locate_matches_numpy(n):
  # The first i whose inclusive prefix sum reaches `need`, and the sum
  # before it: one level up to 128 entries, then groups of 128 (three
  # levels past 128 * 128), with zeros, prefixes equal to `need`, the last.
  rng = np.random.default_rng(n)
  counts = np.where(rng.random(n) < 0.3, 0, rng.integers(0, 129, n))
  counts[-1] = 1
  prefix = np.cumsum(counts)
  needs = {1, int(prefix[-1]), int(prefix[n // 2]), int(prefix[n // 2]) + 1}
  locate = jax.jit(search._locate)
  for need in sorted(v for v in needs if 1 <= v <= prefix[-1]):
    i, before = locate(jnp.asarray(counts, jnp.int32), jnp.int32(need))
    want = int(np.argmax(prefix >= need))
    assert (int(i), int(before)) == (want, int(prefix[want] - counts[want])), (
        need)


def test_chunk_over_two_million_takes_the_grouped_paths():
  # Past 128 * 128 rows of 128 (2**21 entries) `_locate` finds a tie's row
  # group by group (its long path): a chunk of llama-100m's size class at
  # N=1.
  c = (1 << 21) + 3001
  rng = np.random.default_rng(3)
  x = rng.normal(size=c).astype(np.float32)
  x[rng.random(c) < 0.2] = 0.25  # a heavy tie inside the top 10%
  for num_valid, k in [(c, c // 10), (c - 5000, c // 100), (c, 7)]:
    got = _selector('threshold')(jnp.asarray(x), jnp.int32(num_valid),
                                 jnp.int32(k))
    np.testing.assert_array_equal(np.asarray(got),
                                  _numpy_words(x, num_valid, k),
                                  err_msg=f'n={num_valid} k={k}')


@pytest.mark.parametrize('n,size,p', [(1000, 512, 0.9), (300, 512, 0.5),
                                      (70000, 512, 0.003), (70000, 512, 0.5)])
def test_first_nonzero_matches_numpy(n, size, p):
  # More and fewer nonzero counts than `size`, n below and above it.
  rng = np.random.default_rng(n)
  counts = np.where(rng.random(n) < p, 3, 0)
  counts[rng.integers(0, n)] = 1
  want = np.flatnonzero(counts)[:size]
  want = np.concatenate([want, np.full(size - want.size, n)])
  got = search._first_nonzero(jnp.asarray(counts, jnp.int32), size)
  np.testing.assert_array_equal(np.asarray(got), want)


def _passes(x, k, monkeypatch):
  """Counting passes over the chunk that the 'threshold' search makes."""
  calls = []
  count = topk._jnp_count

  def counted(*args):
    jax.debug.callback(lambda: calls.append(1))
    return count(*args)

  monkeypatch.setattr(topk, '_jnp_count', counted)
  run = jax.jit(lambda x, k: topk.threshold_topk_words(x, x.shape[0], k))
  words = run(jnp.asarray(x), jnp.int32(k))
  jax.effects_barrier()
  np.testing.assert_array_equal(np.asarray(words),
                                _numpy_words(x, x.size, k))
  return len(calls)


@pytest.mark.parametrize('kind', ['normal', 'quantised', 'binades'])
def test_the_search_needs_few_passes(kind, monkeypatch):
  # The cost model of docs/design.md: a handful of counting passes on smooth
  # data, and a bounded number on data made of a few heavy ties spread over
  # many binades (the interpolation is useless there).
  rng = np.random.default_rng(11)
  c = 1 << 20
  x = _data('normal' if kind == 'binades' else kind, c, rng)
  if kind == 'binades':
    x = np.ldexp(1.0, -rng.integers(0, 100, c)).astype(np.float32)
  bound = 6  # 1 to 3 counting passes measured at these seeds
  for k in (c // 10, c // 100, 1):
    assert _passes(x, k, monkeypatch) <= bound, (kind, k)


@pytest.mark.parametrize('kind', ['normal', 'uniform'])
def test_the_curves_straddle_t_in_a_tail_and_in_a_flat_density(
    kind, monkeypatch):
  # After the sample's pass, `_line_probes` takes the outer probes of a flat
  # and a tail-like density model, so that the next pass straddles T under
  # either: three passes at most. The flat model alone took 4 on the normal
  # data here (k = c / 1000), the tail alone 4 on the uniform (k = c / 100).
  rng = np.random.default_rng(5)
  c = 1 << 20
  x = (rng.normal(size=c) if kind == 'normal' else
       rng.uniform(-1.0, 1.0, c)).astype(np.float32)
  for k in (c // 100, c // 1000):
    assert _passes(x, k, monkeypatch) <= 3, (kind, k)


@pytest.mark.parametrize('stride', [7, 9])
def test_the_finish_makes_no_counting_pass_of_its_own(stride, monkeypatch):
  # A chunk sampled whole: the first probes pin T, which is tied with
  # c / stride entries: more than FINISH of them (stride 7: the tie cut)
  # or fewer (stride 9: the candidates' rows). Either finish reuses the
  # per-row counts of the pass that set the bracket: one pass in all.
  x = np.random.default_rng(stride).normal(size=topk.SAMPLE).astype(
      np.float32)
  x[::stride] = x[0]
  ties = topk.SAMPLE // stride + 1
  assert (ties > search.FINISH) == (stride == 7)
  k = int(np.sum(np.abs(x) > abs(x[0]))) + ties // 2  # T = |x[0]|
  assert _passes(x, k, monkeypatch) == 1


@pytest.mark.parametrize('varying', ['scores', 'num_valid', 'k'])
def test_every_select_types_its_words_like_its_inputs_in_shard_map(varying):
  # Inside shard_map the words vary over the mesh axes of any input, for
  # every select and width: 'auto' picks its branch per lowering platform,
  # and the branches must have one type (a chunk above
  # AUTO_SORT_MAX_WIDTH['cpu'] once failed there: the full-width sort's
  # scatter into fresh zeros was typed as not varying).
  c, selects, widths = 2048, ('sort', 'threshold', 'auto'), (2048, 200)
  data = np.random.default_rng(0).normal(size=8 * c).astype(np.float32)

  def per_worker(xs):
    worker = jax.lax.axis_index('data')
    x = xs if varying == 'scores' else jnp.asarray(data[:c])
    n = c - worker if varying == 'num_valid' else c
    k = 100 + worker if varying == 'k' else jnp.int32(100)
    out = []
    for select in selects:
      for width in widths:
        words = topk.chunk_topk_words(x, n, width, k, select=select)
        assert 'data' in jax.typeof(words).manual_axis_type.varying, (
            select, width)
        out.append(words)
    return jnp.stack(out)[None]

  mesh = jax.make_mesh((8,), ('data',))
  with jax.set_mesh(mesh):
    got = jax.jit(jax.shard_map(per_worker, in_specs=P('data'),
                                out_specs=P('data')))(
        jax.device_put(jnp.asarray(data), NamedSharding(mesh, P('data'))))
  for w, words in enumerate(np.asarray(got)):
    x = data[w * c:(w + 1) * c] if varying == 'scores' else data[:c]
    n = c - w if varying == 'num_valid' else c
    k = 100 + w if varying == 'k' else 100
    for row in words:
      np.testing.assert_array_equal(row, _numpy_words(x, n, k))


@pytest.mark.parametrize('select', ['sort', 'threshold'])
def test_chunks_of_one_shape_are_selected_by_one_vmapped_select(select):
  # Three chunks of one size (other data, num_valid and k, the k varying
  # over the mesh) and one of another size: two selects traced, not four,
  # and every chunk's words are its own top-k.
  sizes, valid, ks = (4096, 4096, 4096, 5000), (4096, 4000, 3000, 5000), (
      100, 7, 600, 50)
  data = np.random.default_rng(1).normal(size=(2, sum(sizes)))
  data = data.astype(np.float32)
  bounds = np.cumsum((0,) + sizes)
  traced = []
  one = topk._select_one

  def counted(*args, **kwargs):
    traced.append(1)
    return one(*args, **kwargs)

  def per_worker(xs):
    worker = jax.lax.axis_index('data')
    chunks = [xs[0, a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    words = topk.chunks_topk_words(
        chunks, valid, [min(c, 1024) for c in sizes],
        [k + worker for k in ks], select=select)
    return jnp.concatenate(words)[None]

  mesh = jax.make_mesh((2,), ('data',), devices=jax.devices()[:2])
  with jax.set_mesh(mesh), mock.patch.object(topk, '_select_one', counted):
    got = jax.jit(jax.shard_map(per_worker, in_specs=P('data'),
                                out_specs=P('data')))(
        jax.device_put(jnp.asarray(data), NamedSharding(mesh, P('data'))))
  assert len(traced) == 2
  for w, row in enumerate(np.asarray(got)):
    want = [_numpy_words(data[w, a:b], n, k + w) for a, b, n, k in zip(
        bounds[:-1], bounds[1:], valid, ks)]
    np.testing.assert_array_equal(row, np.concatenate(want))


def test_stacks_hold_at_most_stack_max_entries(monkeypatch):
  # A stack is a copy of its chunks: whole leaves of a large model (N = 1,
  # Radius's resample) are selected one by one.
  monkeypatch.setattr(topk, 'STACK_MAX', 10_000)
  chunks = [jnp.zeros(4096)] * 3 + [jnp.zeros(5000)] + [jnp.zeros(20_000)] * 2
  assert topk.stacks(chunks, [16] * 6) == [[0, 1], [2], [3], [4], [5]]
  assert topk.stacks(chunks, [16, 8, 16, 16, 16, 16]) == [[0, 2], [1], [3],
                                                          [4], [5]]
