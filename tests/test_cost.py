"""scape_jax.analysis.cost: the analytic bytes of each method, by hand and
against comm.masks (bench/comm_volume.py puts them beside the compiled
programs' bytes; tests/test_bench.py checks that on llama-tiny)."""

import pytest

from scape_jax.analysis import cost as cv


def test_dense_bytes():
  assert cv.dense_bytes(100, 4) == pytest.approx(2 * 3 / 4 * 400)
  assert cv.dense_bytes(100, 1) == 0.0


# Hand computation, N=4, density 0.25:
#   (8, 4):  32 elements, chunk 8, k = 2, bitmap 1 word, offsets 2 words.
#   (16,):   dense, 16 values, no mask.
#   (3, 5):  15 elements, chunk 4 (one padding slot), k = 1, 1 word either way.
# Payload 4*2 + 16 + 4*1 = 28 values; 'auto' picks the bitmap (k >= words).
SHAPES = [(8, 4), (16,), (3, 5)]


@pytest.mark.parametrize('encoding,words', [('bitmap', 2), ('indices', 3),
                                            ('auto', 2)])
def test_scape_bytes_by_hand(encoding, words):
  got = cv.scape_bytes(SHAPES, 4, 0.25, encoding)
  assert got['payload_values'] == 28
  assert got['mask_words'] == words
  assert got['payload_bytes'] == pytest.approx(2 * 3 / 4 * 4 * 28)
  assert got['mask_bytes'] == pytest.approx(3 / 4 * 4 * words * 4)
  assert got['bytes'] == pytest.approx(168 + 3 * 4 * words)
  assert got['per_leaf'] == ('indices' if encoding == 'indices' else 'bitmap',
                             None, 'indices' if encoding == 'indices'
                             else 'bitmap')


def test_scape_bytes_auto_picks_offsets_and_density_one_is_dense():
  # (64, 32) over N=2: chunk 1024, 32 bitmap words, k = ceil(10.24) = 11.
  got = cv.scape_bytes([(64, 32)], 2, 0.01, 'auto')
  assert (got['payload_values'], got['mask_words']) == (22, 11)
  assert got['per_leaf'] == ('indices',)
  assert cv.scape_bytes([(64, 32)], 2, 0.01, 'bitmap')['mask_words'] == 32
  dense = cv.scape_bytes([(64, 32), (7,)], 2, 1.0, 'bitmap')
  assert (dense['payload_values'], dense['mask_words']) == (2048 + 7, 0)
  assert dense['bytes'] == pytest.approx(cv.dense_bytes(2048 + 7, 2))


@pytest.mark.parametrize('encoding, offset_bits', [
    ('auto', 32), ('auto', 16), ('auto', 'auto'), ('bitmap', 32),
    ('indices', 32), ('indices', 16), ('indices', 'auto')])
def test_analytic_masks_agree_with_the_library(encoding, offset_bits):
  """The analytic side computes k, the chunks and the mask encodings itself
  (it shares no code with what it checks); they agree with comm.masks on
  leaves up to two 16-bit sub-blocks per chunk."""
  from scape_jax.comm import masks  # pylint: disable=g-import-not-at-top
  for size in (15, 1000, 4096, 131_072, 1_000_003):
    for n in (1, 3, 8):
      for density in (0.001, 0.01, 0.03, 0.1, 0.5):
        lay = masks.LeafLayout.create(size, n)
        k = masks.chunk_k(density, lay.chunk_size)
        got = cv.scape_bytes([(size, 1)], n, density, encoding, 'float32',
                             offset_bits)
        if k == lay.chunk_size:
          assert got['per_leaf'] == (None,)
          continue
        assert got['payload_values'] == n * k
        assert got['per_leaf'] == (lay.encoding(k, encoding, offset_bits),)
        assert got['mask_words'] == lay.mask_words(k, encoding, offset_bits)


def test_radius_bytes_by_hand():
  # N=4, d=0.1: (20, 10) sends ceil(20) = 20 of 200; (7, 3) sends 3 of 21;
  # (9,) is dense. r=1 widens to min(size, 3k): 60 and 9.
  shapes = [(20, 10), (7, 3), (9,)]
  ring = 2 * 3 / 4 * 4  # bytes per all-reduced fp32 value
  got = cv.radius_bytes(shapes, 4, 0.1, interval=10)
  assert got['sparse_values'] == 20 + 3 + 9
  assert got['dense'] == got['resample'] == pytest.approx(ring * 230)
  assert got['sparse'] == pytest.approx(ring * 32)
  assert got['period'] == pytest.approx(ring * (9 * 32 + 230) / 10)
  assert cv.radius_bytes(shapes, 4, 0.1, 1)['sparse_values'] == 60 + 9 + 9
  # Density 1 (or widening past the leaf) sends every entry.
  assert cv.radius_bytes(shapes, 4, 1.0)['sparse_values'] == 230
  assert cv.radius_bytes(shapes, 4, 0.1, 5)['sparse_values'] == 200 + 21 + 9


def test_demo_bytes_by_hand():
  # chunk 64, topk 32, N=8:
  #   (128, 64): 2 chunks of 64x64 (4096 entries: int16), 32 each -> 64 x 6 B
  #   (10, 6, 5): viewed (60, 5), one 60x5 chunk (300: int16), 32 -> 32 x 6 B
  #   (40,): one 1x40 chunk (int8), 32 -> 32 x 5 B
  #   (3,): one 1x3 chunk, all 3 sent (int8) -> 3 x 5 B
  #   (): one 1x1 chunk -> 1 x 5 B
  shapes = [(128, 64), (10, 6, 5), (40,), (3,), ()]
  got = cv.demo_bytes(shapes, 8, 32)
  assert got['entries'] == 64 + 32 + 32 + 3 + 1
  assert got['worker_bytes'] == 64 * 6 + 32 * 6 + 32 * 5 + 3 * 5 + 5
  assert got['bytes'] == pytest.approx(7 * got['worker_bytes'])
  # A prime side is cut into chunks of 1 along it.
  assert cv.demo_bytes([(67, 64)], 2, 8)['entries'] == 67 * 8
