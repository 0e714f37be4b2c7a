"""Pallas kernels: bit for bit against their references (interpreted on CPU),
and lowering for cuda (Triton) and tpu (Mosaic) from this machine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scape_jax.kernels import pack_bits, topk_mask, topk_segments, unpack_bits
from tests import one_chunk

TRITON = '__gpu$xla.gpu.triton'
MOSAIC_TPU = 'tpu_custom_call'


def _scores(c, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=c).astype(np.float32)
  x[rng.random(c) < 0.05] = 0.0
  special = np.array([np.nan, -np.inf, -0.0], np.float32)
  x[:3] = special[:c]
  return jnp.asarray(x)


# num_valid > c (the last two) means the whole chunk is real.
@pytest.mark.parametrize('c, num_valid', [(1, 1), (200, 150), (4096, 4096),
                                          (9000, 8001), (33, 40), (1, 201)])
def test_count_at_least_matches_reference(c, num_valid):
  x = _scores(c)
  keys = np.asarray(topk_mask.magnitude_key(x))
  thresholds = jnp.asarray([-1, 0, int(np.median(keys)), 0x7F800000,
                            topk_mask.NAN_KEY], jnp.int32)
  got = one_chunk.count_at_least(x, num_valid, thresholds, interpret=True)
  expected = one_chunk.count_at_least_reference(x, num_valid, thresholds)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
  # Totals against NumPy: padding (PAD_KEY = -1) counts at threshold -1 only.
  rows = got.shape[0]
  real = keys[:num_valid]
  totals = [rows * 128] + [int(np.sum(real >= t)) for t in thresholds[1:]]
  np.testing.assert_array_equal(np.asarray(got).sum(0), totals)


# num_valid > c (the last two) means the whole chunk is real.
@pytest.mark.parametrize('c, num_valid', [(1, 1), (200, 150), (4096, 4096),
                                          (9000, 8001), (33, 40), (1, 201)])
def test_threshold_mask_words_matches_reference(c, num_valid):
  x = _scores(c, 1)
  keys = np.asarray(topk_mask.magnitude_key(x))
  lo, hi = int(np.quantile(keys, 0.3)), int(np.quantile(keys, 0.8))
  for args in [(lo, hi, c // 2), (-1, 0, num_valid + 1), (lo, lo + 1, c)]:
    got = one_chunk.threshold_mask_words(x, num_valid, *args, interpret=True)
    expected = one_chunk.threshold_mask_words_reference(x, num_valid, *args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    # Against NumPy, bit by bit.
    index = np.arange(c)
    key = np.where(index < num_valid, keys, -1)
    lo_, hi_, cut = args
    bits = (key >= hi_) | ((key >= lo_) & (index < cut))
    bits = np.pad(bits, (0, -c % 32))
    np.testing.assert_array_equal(
        np.asarray(got), np.packbits(bits, bitorder='little').view('<u4'))


def test_magnitude_key_orders_like_the_magnitude():
  x = np.array([0.0, -0.0, 1e-45, -1e-40, 1e-38, 1.0, -2.0, 3.4e38, np.inf,
                -np.inf, np.nan, -np.nan], np.float32)
  keys = np.asarray(topk_mask.magnitude_key(jnp.asarray(x)))
  assert keys[0] == keys[1] == 0
  assert 0 < keys[2] < keys[3] < keys[4] < keys[5] < keys[6] < keys[7]
  assert keys[7] < keys[8] == keys[9] == 0x7F800000
  assert keys[10] == keys[11] == topk_mask.NAN_KEY


@pytest.mark.parametrize('n, c', [(1, 1), (3, 31), (2, 128), (4, 1000)])
def test_pack_and_unpack_match_references_and_numpy(n, c):
  rng = np.random.default_rng(c)
  bits = rng.random((n, c)) < 0.4
  words = pack_bits.pack_bits(jnp.asarray(bits), interpret=True)
  padded = np.pad(bits, ((0, 0), (0, -c % 32)))
  expected = np.packbits(padded, axis=1, bitorder='little').view('<u4')
  np.testing.assert_array_equal(np.asarray(words), expected)
  np.testing.assert_array_equal(
      np.asarray(pack_bits.pack_bits_reference(jnp.asarray(bits))), expected)
  back = unpack_bits.unpack_bits(words, c, interpret=True)
  np.testing.assert_array_equal(np.asarray(back), bits)
  np.testing.assert_array_equal(
      np.asarray(unpack_bits.unpack_bits_reference(words, c)), bits)
  # Words past the c bits (all ones here) are ignored.
  extra = jnp.concatenate([words, jnp.full((n, 3), 0xFFFFFFFF, jnp.uint32)], 1)
  np.testing.assert_array_equal(
      np.asarray(unpack_bits.unpack_bits(extra, c, interpret=True)), bits)
  np.testing.assert_array_equal(
      np.asarray(unpack_bits.unpack_bits_reference(extra, c)), bits)


@pytest.mark.parametrize('c', [1, 33, 4097])
def test_all_equal_chunk(c):
  """Every key ties: counts are all or nothing, and the cut alone decides
  which entries a [lo, hi) band takes."""
  x = jnp.full((c,), -1.5, jnp.float32)
  key = int(topk_mask.magnitude_key(x)[0])
  thresholds = jnp.asarray([key, key + 1], jnp.int32)
  got = one_chunk.count_at_least(x, c, thresholds, interpret=True)
  np.testing.assert_array_equal(np.asarray(got).sum(0), [c, 0])
  np.testing.assert_array_equal(
      np.asarray(got),
      np.asarray(one_chunk.count_at_least_reference(x, c, thresholds)))
  cut = (c + 1) // 2
  words = one_chunk.threshold_mask_words(x, c, key, key + 1, cut,
                                         interpret=True)
  bits = np.pad(np.arange(c) < cut, (0, -c % 32))
  np.testing.assert_array_equal(
      np.asarray(words), np.packbits(bits, bitorder='little').view('<u4'))
  np.testing.assert_array_equal(
      np.asarray(words), np.asarray(
          one_chunk.threshold_mask_words_reference(x, c, key, key + 1, cut)))


def _two_chunks():
  """Rows of two chunks end to end (5000 and 3000 entries, each padded to
  whole blocks of 32 x 128), per block: first row in its chunk, num_valid."""
  a, b = _scores(5000, 1), _scores(3000, 2)
  x = jnp.concatenate([topk_mask.as_rows(a), topk_mask.as_rows(b)])
  row0 = jnp.asarray([0, 32, 0], jnp.int32)
  num_valid = jnp.asarray([4900, 4900, 3000], jnp.int32)
  return (a, b), x, row0, num_valid


def test_count_rows_matches_reference_and_numpy_per_chunk():
  (a, b), x, row0, num_valid = _two_chunks()
  keys = [np.asarray(topk_mask.magnitude_key(v)) for v in (a, b)]
  med = [int(np.median(k)) for k in keys]
  thresholds = jnp.asarray([[-1, 0, med[0]], [-1, 0, med[0]],
                            [-1, 0x7F800000, med[1]]], jnp.int32)
  got = topk_segments.count_rows(x, row0, num_valid, thresholds,
                                 interpret=True)
  expected = topk_segments.count_rows_reference(x, row0, num_valid,
                                                thresholds)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
  got = np.asarray(got)
  # Per chunk against NumPy: padding (key -1) counts at threshold -1 only.
  real = (keys[0][:4900], keys[1][:3000])
  np.testing.assert_array_equal(got[:64].sum(0), [64 * 128, np.sum(
      real[0] >= 0), np.sum(real[0] >= med[0])])
  np.testing.assert_array_equal(got[64:].sum(0), [32 * 128, np.sum(
      real[1] >= 0x7F800000), np.sum(real[1] >= med[1])])


def test_mask_rows_matches_reference_and_numpy_per_chunk():
  (a, b), x, row0, num_valid = _two_chunks()
  lo = [int(np.median(np.asarray(topk_mask.magnitude_key(v)))) for v in (a, b)]
  got = topk_segments.mask_rows(
      x, row0, num_valid, jnp.asarray([lo[0], lo[0], -1]),
      jnp.asarray([lo[0] + 1, lo[0] + 1, 0]), jnp.asarray([5000, 5000, 10]),
      interpret=True)
  expected = topk_segments.mask_rows_reference(
      x, row0, num_valid, jnp.asarray([lo[0], lo[0], -1]),
      jnp.asarray([lo[0] + 1, lo[0] + 1, 0]), jnp.asarray([5000, 5000, 10]))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
  # Chunk a: the keys above the median; chunk b: every real key, and the
  # padding (key -1 = lo) before offset 10: none, its 3000 are all real.
  words = np.asarray(got)
  first = np.asarray(one_chunk.threshold_mask_words_reference(
      a, 4900, lo[0], lo[0] + 1, 5000))
  np.testing.assert_array_equal(words[:64].reshape(-1)[:157], first)
  bits = np.unpackbits(words[64:].reshape(-1).view(np.uint8),
                       bitorder='little')
  np.testing.assert_array_equal(np.flatnonzero(bits), np.arange(3000))


def test_unpack_rejects_too_few_words():
  with pytest.raises(ValueError, match='2 words hold 64 bits < c=65'):
    unpack_bits.unpack_bits(jnp.zeros((1, 2), jnp.uint32), 65)


def _kernel_calls():
  x = _scores(5000)
  bits = jnp.asarray(np.random.default_rng(0).random((2, 300)) < 0.5)
  words = pack_bits.pack_bits_reference(bits)
  thresholds = jnp.asarray([0, 5], jnp.int32)
  return {
      'count_at_least': (one_chunk.count_at_least, (x, 4000, thresholds)),
      # Triton needs power-of-two blocks: 5 thresholds are padded to 8.
      'count_at_least_5': (one_chunk.count_at_least,
                           (x, 4000, jnp.arange(5, dtype=jnp.int32))),
      'threshold_mask_words': (one_chunk.threshold_mask_words,
                               (x, 4000, 1, 2, 3)),
      'count_rows': (topk_segments.count_rows,
                     (x[:4096].reshape(32, 128), jnp.zeros(1, jnp.int32),
                      jnp.full(1, 4000), jnp.arange(15).reshape(1, 15))),
      'mask_rows': (topk_segments.mask_rows,
                    (x[:4096].reshape(32, 128), jnp.zeros(1, jnp.int32),
                     jnp.full(1, 4000), jnp.ones(1, jnp.int32),
                     jnp.full(1, 2), jnp.full(1, 3))),
      'pack_bits': (pack_bits.pack_bits, (bits,)),
      'unpack_bits': (lambda w: unpack_bits.unpack_bits(w, 300), (words,)),
  }


@pytest.mark.parametrize('name', sorted(_kernel_calls()))
def test_kernels_lower_for_cuda_with_triton(name):
  fn, args = _kernel_calls()[name]
  text = jax.jit(fn).trace(*args).lower(
      lowering_platforms=('cuda',)).as_text()
  assert TRITON in text


@pytest.mark.parametrize('name', sorted(_kernel_calls()))
def test_kernels_lower_for_tpu_with_mosaic(name):
  fn, args = _kernel_calls()[name]
  # Mosaic reads the TPU generation from the mesh's abstract device.
  device = jax.sharding.AbstractDevice(device_kind='TPU v5 lite',
                                       num_cores=1, platform='tpu')
  mesh = jax.sharding.AbstractMesh((1,), ('x',), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    text = jax.jit(fn).trace(*args).lower(
        lowering_platforms=('tpu',)).as_text()
  assert MOSAIC_TPU in text
