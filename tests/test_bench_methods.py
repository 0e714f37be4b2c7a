"""bench/comm_volume.py's analytic bytes of Radius and DeMo, by hand."""

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), 'bench',
                     'comm_volume.py')
_spec = importlib.util.spec_from_file_location('comm_volume_methods', _PATH)
cv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cv)


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
