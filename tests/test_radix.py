"""Many chunks in one set of radix passes ('pallas_radix', and its jnp
reference `radix.radix_topk_words_many(use_pallas=False)`): each
chunk's words against NumPy, and one launch per pass for an update's
leaves. (SCAPE's updates with the radix selects against the other selects:
tests/test_scape.py and tests/test_alg2.py.)"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scape_jax
from scape_jax.comm import radix, topk
from tests.test_topk import _data, _numpy_words

# Sizes off the block (4096) and the row (128), one chunk of one entry.
SIZES = (37, 4096, 9000, 1, 300)


def _chunks(seed, kinds):
  rng = np.random.default_rng(seed)
  xs = [_data(kinds[i % len(kinds)], c, rng) for i, c in enumerate(SIZES)]
  num_valid = [c if i % 2 else max(1, (2 * c) // 3)
               for i, c in enumerate(SIZES)]
  return xs, num_valid


@pytest.mark.parametrize('use_pallas', [False, True])
@pytest.mark.parametrize('kinds', [('normal',), ('equal', 'quantised'),
                                   ('zeros', 'denormal', 'normal')])
def test_many_chunks_each_equal_numpy(use_pallas, kinds):
  xs, num_valid = _chunks(3, kinds)
  run = jax.jit(lambda xs, ns, ks: radix.radix_topk_words_many(
      xs, ns, ks, use_pallas=use_pallas))
  # k = 1, k = c, past num_valid (padding chosen last), and densities.
  for ks in ([1] * len(SIZES), list(SIZES),
             [min(c, n + 1) for c, n in zip(SIZES, num_valid)],
             [max(1, c // 10) for c in SIZES],
             [max(1, c // 100) for c in SIZES]):
    got = run([jnp.asarray(x) for x in xs], jnp.asarray(num_valid),
              jnp.asarray(ks))
    for x, n, k, words in zip(xs, num_valid, ks, got):
      np.testing.assert_array_equal(np.asarray(words), _numpy_words(x, n, k),
                                    err_msg=f'{kinds} c={x.size} k={k}')


def test_many_chunks_with_nan_and_inf_and_every_binade():
  rng = np.random.default_rng(5)
  x = np.ldexp(rng.random(9000) + 0.5, rng.integers(-149, 128, 9000))
  x = (x * rng.choice([-1.0, 1.0], 9000)).astype(np.float32)
  x[rng.choice(9000, 30, replace=False)] = np.inf
  y = rng.normal(size=5000).astype(np.float32)
  y[rng.choice(5000, 40, replace=False)] = np.nan
  run = jax.jit(lambda xs, ks: radix.radix_topk_words_many(
      xs, [9000, 5000], ks))
  for ks in ((1, 1), (29, 39), (31, 41), (4500, 4999)):
    got = run([jnp.asarray(x), jnp.asarray(y)], jnp.asarray(ks))
    for data, k, words in zip((x, y), ks, got):
      np.testing.assert_array_equal(np.asarray(words),
                                    _numpy_words(data, data.size, k))


def test_no_chunks_no_words():
  for select in ('threshold', 'pallas_radix', 'sort'):
    assert topk.chunks_topk_words([], [], [], [], select=select) == []


def test_chunks_topk_words_checks_each_width():
  with pytest.raises(ValueError, match=r'width=0 must be in \[1, 5\]'):
    topk.chunks_topk_words([jnp.ones(8), jnp.ones(5)], [8, 5], [8, 0],
                           [1, 1], select='pallas_radix')


def test_every_leaf_in_one_set_of_passes():
  # 'pallas_radix' on three leaves: one count kernel per pass (the 8 radix
  # passes and the tie cut) and one mask kernel, not one per leaf.
  params = {n: jnp.zeros(s) for n, s in {'a': (40, 25), 'b': (7, 300),
                                          'c': (64, 64)}.items()}
  tx = scape_jax.scape(1e-2, density=0.1, axis_name=None,
                       select='pallas_radix')
  state = tx.init(params)
  text = jax.jit(lambda g, s, p: tx.update(g, s, p, density_level=1)).trace(
      params, state, params).lower(lowering_platforms=('cuda',)).as_text()
  calls = re.findall(r'call @(count_rows|mask_rows)\w*\(', text)
  assert calls.count('count_rows') == radix.RADIX_PASSES + 1, calls
  assert calls.count('mask_rows') == 1, calls
