"""Tests for bench/comm_volume.py: the analytic bytes, and the measured bytes
of a compiled llama-tiny train step against them."""

import importlib.util
import os

import pytest

from scape_jax import analysis

_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), 'bench',
                     'comm_volume.py')
_spec = importlib.util.spec_from_file_location('comm_volume', _PATH)
cv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cv)


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


def test_measured_llama_tiny_matches_analytic():
  cfg = cv.make_config('llama-tiny', 8, 'scape', 0.01, 'auto')
  m = cv.measure(cfg)
  shapes = [tuple(s) for s in m['shapes']]
  an = cv.scape_bytes(shapes, 8, 0.01, 'auto')
  assert m['complete']
  assert m['measured_bytes'] == pytest.approx(an['bytes'], rel=0.05)
  assert m['by_kind']['all-gather'] == pytest.approx(an['mask_bytes'])
  # The all-reduce also carries the train step's 3-float metrics pmean
  # (loss, squared gradient norm, non-finite count).
  assert m['by_kind']['all-reduce'] == pytest.approx(
      an['payload_bytes'] + analysis.ring_all_reduce_bytes(3 * 4, 8))


def test_outer_table_amortises_the_sync_over_r():
  """DiLoCo rows: across groups (sync - inner) / r, total inner + that."""
  row = {'model': 'm', 'params': 1e6, 'N': 8, 'groups': 2,
         'measured_bytes': 6e6, 'analytic': 6e6, 'sync_bytes': 10e6,
         'analytic_sync': 10e6, 'dense_over_n': 7e6}
  cells = cv.outer_markdown([row]).splitlines()[2].split(' | ')
  assert cv.SYNC_EVERY == (50, 500)
  # inner, (analytic), sync, (analytic), across r=50, r=500, total r=50, r=500
  assert cells[4:12] == ['6.000', '6.000', '10.000', '10.000', '0.080',
                         '0.008', '6.080', '6.008']
  cfg = cv.outer_config('llama-tiny', 32)
  assert (cfg.mesh.replica, cfg.mesh.data) == (8, cv.GROUP_SIZE)
