"""The jnp mask primitives (future Pallas references) against NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scape_jax.comm import masks
from scape_jax.optim import _radius as radius_lib


@pytest.mark.parametrize('c', [1, 31, 32, 33, 100])
def test_pack_bits_is_little_endian_uint32_and_round_trips(c):
  rng = np.random.default_rng(c)
  bits = rng.random((3, c)) < 0.3
  words = np.asarray(masks.pack_bits(jnp.asarray(bits)))
  assert words.dtype == np.uint32 and words.shape == (3, -(-c // 32))
  padded = np.zeros((3, words.shape[1] * 32), bool)
  padded[:, :c] = bits
  expected = np.packbits(padded, axis=1, bitorder='little').view('<u4')
  np.testing.assert_array_equal(words, expected)
  np.testing.assert_array_equal(
      np.asarray(masks.unpack_bits(jnp.asarray(words), c)), bits)


def test_offsets_and_bits_are_inverse():
  rng = np.random.default_rng(0)
  c, k = 50, 7
  offs = np.sort(np.stack([rng.choice(c, k, replace=False) for _ in range(4)]),
                 axis=1)
  bits = np.asarray(masks.offsets_to_bits(jnp.asarray(offs), c))
  assert bits.sum(axis=1).tolist() == [k] * 4
  np.testing.assert_array_equal(
      np.asarray(masks.bits_to_offsets(jnp.asarray(bits), k)), offs)


@pytest.mark.parametrize('width, k', [(5, 5), (5, 2), (40, 3), (40, 40)])
def test_chunk_topk_matches_stable_numpy_ranking(width, k):
  rng = np.random.default_rng(width + k)
  scores = np.abs(rng.normal(size=40)).astype(np.float32)
  scores[[3, 9, 17]] = 0.5  # ties go to the lower offset
  valid = np.arange(40) < 33  # the last 7 positions are padding
  bits = np.asarray(masks.chunk_topk_bits(
      jnp.asarray(scores), jnp.asarray(valid), width, jnp.int32(k)))
  order = np.argsort(-np.where(valid, scores, -1.0), kind='stable')
  expected = np.zeros(40, bool)
  expected[order[:k]] = True
  np.testing.assert_array_equal(bits, expected)


def test_padding_is_chosen_only_after_every_real_entry():
  scores = jnp.zeros(8)
  valid = jnp.arange(8) < 3
  bits = np.asarray(masks.chunk_topk_bits(scores, valid, 5, jnp.int32(5)))
  assert bits[:3].all() and bits.sum() == 5


@pytest.mark.parametrize('density, chunk, k', [
    (0.1, 30, 3), (0.1, 31, 4), (0.01, 2048, 21), (1.0, 7, 7), (1e-9, 10, 1)])
def test_chunk_k_is_exact_ceiling(density, chunk, k):
  assert masks.chunk_k(density, chunk) == k


def test_auto_encoding_sends_the_smaller_mask():
  lay = masks.LeafLayout.create(size=7 * 2340, num_chunks=8)
  assert lay.chunk_size == 2048 and lay.words == 64 and lay.padded == 2048 * 8
  assert lay.encoding(63, 'auto') == 'indices'
  assert lay.encoding(64, 'auto') == 'bitmap'
  assert lay.mask_words(21, 'auto') == 21
  assert lay.mask_words(21, 'bitmap') == 64
  x = jnp.arange(lay.size, dtype=jnp.float32).reshape(-1, 7)
  np.testing.assert_array_equal(
      np.asarray(lay.from_chunks(lay.to_chunks(x), x.shape)), np.asarray(x))


@pytest.mark.parametrize('c, k', [(1, 1), (31, 5), (32, 32), (33, 10),
                                  (1000, 1), (1000, 999), (5000, 37)])
def test_words_to_offsets_and_back_match_the_bit_versions(c, k):
  rng = np.random.default_rng(c + k)
  bits = np.zeros((3, c), bool)
  for row in bits:
    row[rng.choice(c, k, replace=False)] = True
  words = jax.jit(masks.pack_bits)(jnp.asarray(bits))
  offsets = np.asarray(jax.jit(masks.words_to_offsets, static_argnums=1)(
      words, k))
  np.testing.assert_array_equal(offsets,
                                np.stack([np.flatnonzero(r) for r in bits]))
  np.testing.assert_array_equal(
      np.asarray(jax.jit(masks.offsets_to_words, static_argnums=1)(
          jnp.asarray(offsets), c)),
      np.asarray(words))


def test_many_leaves_decoded_in_one_call_give_each_leafs_offsets():
  rng = np.random.default_rng(0)
  bits = []
  # Leaves of one (c, k) are decoded together, their rows stacked (the
  # first and fourth; the second and last, of other row counts).
  for c, k, n in [(1000, 100, 3), (64, 64, 3), (5000, 50, 3), (1000, 100, 3),
                  (33, 16, 3), (2048, 600, 3), (64, 64, 5)]:
    b = np.zeros((n, c), bool)
    for row in b:
      row[rng.choice(c, k, replace=False)] = True
    bits.append(b)
  parts = [masks.pack_bits(jnp.asarray(b)) for b in bits]
  ks = [int(b[0].sum()) for b in bits]
  decoded = jax.jit(lambda *p: masks.words_to_offsets_many(p, ks))(*parts)
  for offsets, b in zip(decoded, bits):
    np.testing.assert_array_equal(
        np.asarray(offsets), np.stack([np.flatnonzero(r) for r in b]))


def test_words_to_offsets_is_decoded_once_for_a_gather_and_a_scatter(
    monkeypatch):
  # SCAPE's update reads the offsets twice: the payload gather and the
  # scatters' index. XLA:CPU fused the whole decode into both, doubling its
  # population counts; the offsets are now stored once. Compiled with
  # XLA:CPU's default fusion emitters, which conftest.py turns off for the
  # other tests (the loop emitters never fused the decode twice).
  c, k = 4096, 400
  words = jax.ShapeDtypeStruct((2, c // 32), jnp.uint32)
  x = jax.ShapeDtypeStruct((2 * c,), jnp.float32)
  lay = masks.LeafLayout.create(2 * c, 2)

  def popcounts(uses_twice):  # Traced afresh: the switch is read then.
    def alone(w):
      return masks.words_to_offsets(w, k)

    def both(w, x):
      offsets = masks.words_to_offsets(w, k)
      values = masks.gather_at(x, lay, offsets)
      return masks.set_at(x, lay, offsets, 2.0 * values)

    fn, args = (both, (words, x)) if uses_twice else (alone, (words,))
    return jax.jit(fn).lower(*args).compile(
        {'xla_cpu_use_fusion_emitters': True}).as_text().count(' popcnt(')

  assert popcounts(False) > 0
  assert popcounts(True) == popcounts(False)
  monkeypatch.setattr(masks, '_STORE_OFFSETS', False)  # as before
  assert popcounts(True) > popcounts(False)


def test_chunk_topk_ranks_magnitudes_and_puts_nan_first():
  scores = jnp.array([1.0, jnp.nan, -3.0, jnp.inf, -0.0, 2.0])
  valid = jnp.ones(6, bool)
  for width, k, chosen in [(6, 2, [1, 3]), (3, 2, [1, 3]), (3, 3, [1, 2, 3])]:
    bits = np.asarray(masks.chunk_topk_bits(scores, valid, width,
                                            jnp.int32(k)))
    assert np.flatnonzero(bits).tolist() == chosen


@pytest.mark.parametrize('density, chunk, k', [
    (0.1, 10, 1), (0.1, 30, 3), (0.1, 320, 32), (0.05, 20, 1),
    (0.3, 10, 3), (0.01, 700, 7)])
def test_a_numpy_density_is_its_decimal_too(density, chunk, k):
  """np.float32(0.1) widened to a double is 0.10000000149..., whose ceiling
  over 10 entries was 2: a NumPy scalar reads as its own shortest decimal."""
  for x in (np.float32(density), np.float64(density), density):
    assert masks.chunk_k(x, chunk) == k, x
    assert radius_lib.top_k_count(x, chunk) == k, x
