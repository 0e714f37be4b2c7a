"""On a GPU: the compiled Pallas kernels (Triton), every `select` and the
SCAPE update, each against a reference. Skipped where JAX has no GPU.

Run on a GPU machine with the CPU backend beside it (the update's reference
runs there):

  JAX_PLATFORMS=cuda,cpu python -m pytest -q tests/test_gpu.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scape_jax
from scape_jax.comm import topk
from scape_jax.kernels import pack_bits, topk_mask, topk_segments, unpack_bits
from tests import one_chunk
from tests.test_kernels import _two_chunks
from tests.test_topk import _numpy_words

pytestmark = pytest.mark.skipif(jax.default_backend() != 'gpu',
                                reason='needs a GPU (jax.default_backend())')

SIZES = [1, 200, 4096, 9000, (1 << 21) + 77]


def _scores(c, seed):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=c).astype(np.float32)
  x[rng.random(c) < 0.05] = 0.0
  x[rng.random(c) < 0.05] = np.round(x[:1])  # ties
  special = np.array([np.nan, -np.inf, -0.0, 1e-41], np.float32)
  x[:4] = special[:c]
  return jnp.asarray(x)


@pytest.mark.parametrize('c', SIZES)
def test_compiled_count_kernel_matches_reference(c):
  x = _scores(c, 0)
  keys = np.sort(np.asarray(topk_mask.magnitude_key(x)))
  thresholds = jnp.asarray([-1, 0, keys[c // 2], keys[-1], 0x7F800000],
                           jnp.int32)
  for num_valid in {c, max(1, c - 150)}:
    got = one_chunk.count_at_least(x, num_valid, thresholds)
    expected = one_chunk.count_at_least_reference(x, num_valid, thresholds)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


@pytest.mark.parametrize('c', SIZES)
def test_compiled_mask_kernel_matches_reference(c):
  x = _scores(c, 1)
  keys = np.sort(np.asarray(topk_mask.magnitude_key(x)))
  lo, hi = int(keys[int(0.3 * (c - 1))]), int(keys[int(0.8 * (c - 1))])
  for num_valid in {c, max(1, c - 150)}:
    for args in [(lo, hi, c // 2), (-1, 0, num_valid + 1),
                 (lo, lo + 1, c)]:
      got = one_chunk.threshold_mask_words(x, num_valid, *args)
      expected = one_chunk.threshold_mask_words_reference(x, num_valid, *args)
      np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_compiled_segment_kernels_match_reference():
  (a, _), x, row0, num_valid = _two_chunks()
  med = int(np.median(np.asarray(topk_mask.magnitude_key(a))))
  thresholds = jnp.asarray([[-1, 0, med]] * 3, jnp.int32)
  np.testing.assert_array_equal(
      np.asarray(topk_segments.count_rows(x, row0, num_valid, thresholds)),
      np.asarray(topk_segments.count_rows_reference(x, row0, num_valid,
                                                    thresholds)))
  bounds = (jnp.asarray([med, med, -1]), jnp.asarray([med + 1, med + 1, 0]),
            jnp.asarray([5000, 2000, 10]))
  np.testing.assert_array_equal(
      np.asarray(topk_segments.mask_rows(x, row0, num_valid, *bounds)),
      np.asarray(topk_segments.mask_rows_reference(x, row0, num_valid,
                                                   *bounds)))


@pytest.mark.parametrize('n, c', [(1, 1), (3, 31), (2, 128), (4, 1000),
                                  (8, 70_001)])
def test_compiled_pack_and_unpack_match_numpy(n, c):
  bits = np.random.default_rng(c).random((n, c)) < 0.4
  words = pack_bits.pack_bits(jnp.asarray(bits))
  padded = np.pad(bits, ((0, 0), (0, -c % 32)))
  expected = np.packbits(padded, axis=1, bitorder='little').view('<u4')
  np.testing.assert_array_equal(np.asarray(words), expected)
  np.testing.assert_array_equal(np.asarray(unpack_bits.unpack_bits(words, c)),
                                bits)


@pytest.mark.parametrize('select', ['sort', 'threshold', 'pallas_radix',
                                    'auto'])
@pytest.mark.parametrize('kind', ['normal', 'quantised', 'equal'])
def test_every_select_equals_numpy_on_gpu(select, kind):
  rng = np.random.default_rng(3)
  for c in (37, 20_011, 1 << 20):
    x = rng.normal(size=c).astype(np.float32)
    if kind == 'quantised':
      x = (np.round(x * 2) / 2).astype(np.float32)
    elif kind == 'equal':
      x = np.full(c, -0.75, np.float32)
    run = jax.jit(lambda x, n, k: topk.chunk_topk_words(
        x, n, c, k, select=select))
    for num_valid in {c, max(1, (2 * c) // 3)}:
      for k in sorted({1, c, max(1, c // 10), max(1, c // 100)}):
        got = run(jnp.asarray(x), jnp.int32(num_valid), jnp.int32(k))
        np.testing.assert_array_equal(np.asarray(got),
                                      _numpy_words(x, num_valid, k))


def _tree(seed=0):
  rng = np.random.default_rng(seed)
  shapes = {'embed': (512, 256), 'w1': (256, 1024), 'w2': (1024, 256),
            'norm': (256,)}
  params = {n: jnp.asarray(0.02 * rng.normal(size=s), jnp.float32)
            for n, s in shapes.items()}
  grads = [{n: jnp.asarray(1e-3 * rng.normal(size=s), jnp.float32)
            for n, s in shapes.items()} for _ in range(4)]
  return params, grads


def _run_scape(select, density, device):
  """Params, state and updates after 4 steps (the first dense) on
  `device`."""
  params, grads = jax.device_put(_tree(), device)
  tx = scape_jax.scape(1e-3, density=density, b1=0.9, b2=0.95,
                       weight_decay=0.1, axis_name=None, select=select)
  state = jax.jit(tx.init)(params)
  level = scape_jax.DensitySchedule(density, 0).level(1)
  step = jax.jit(tx.update, static_argnames=('density_level',))
  for i, g in enumerate(grads):
    updates, state = step(g, state, params, density_level=0 if i == 0
                          else level)
    params = optax.apply_updates(params, updates)
  return jax.device_get((params, state, updates))


@pytest.mark.parametrize('density', [0.1, 0.01])
def test_scape_update_is_the_same_with_every_select_on_gpu(density):
  gpu = jax.devices('gpu')[0]
  base = _run_scape('sort', density, gpu)
  for select in ('threshold', 'pallas_radix', 'auto'):
    got = _run_scape(select, density, gpu)
    jax.tree.map(np.testing.assert_array_equal, got, base)


@pytest.mark.parametrize('density', [0.1, 0.01])
def test_scape_update_on_gpu_matches_the_cpu_run(density):
  """The same 4 steps on the CPU backend: the masks agree, and the
  parameters agree to float rounding."""
  gpu = _run_scape('auto', density, jax.devices('gpu')[0])
  cpu = _run_scape('auto', density, jax.devices('cpu')[0])
  params_gpu, params_cpu = gpu[0], cpu[0]
  for name in params_cpu:
    np.testing.assert_allclose(params_gpu[name], params_cpu[name],
                               rtol=1e-5, atol=1e-7, err_msg=name)
  masks_gpu = [x for x in jax.tree.leaves(gpu[1]) if x.dtype == np.uint32]
  masks_cpu = [x for x in jax.tree.leaves(cpu[1]) if x.dtype == np.uint32]
  assert masks_cpu and len(masks_gpu) == len(masks_cpu)
  for a, b in zip(masks_gpu, masks_cpu):
    differing = np.unpackbits(np.bitwise_xor(a, b).view(np.uint8)).sum()
    assert differing <= 2, differing  # a near-tie may swap one pair
