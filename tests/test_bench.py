"""bench/comm_volume.py run as a user runs it, on llama-tiny over 8 workers:
the bytes read from the compiled train steps against the analytic bytes of
`scape_jax.analysis.cost`, and the DiLoCo/Pier table's amortisation."""

import json
import math

from flax import nnx
import jax
import pytest

import models
from scape_jax import analysis
from scape_jax.analysis import cost
from tests import bench_scripts


@pytest.fixture(scope='module')
def comm_volume(tmp_path_factory):
  """The script's JSON files: SCAPE d=0.01 'auto' and DiLoCo 2 x 4."""
  out = tmp_path_factory.mktemp('comm_volume')
  bench_scripts.check('comm_volume', '--models', 'llama-tiny', '--workers', 8,
                      '--methods', 'scape', '--densities', 0.01,
                      '--encodings', 'auto', '--no-plot', '--jobs', 1,
                      '--out', out)
  with open(out / 'comm_volume.json') as f:
    main = json.load(f)
  with open(out / 'comm_volume_outer.json') as f:
    outer = json.load(f)
  return main, outer, (out / 'comm_volume_outer.md').read_text()


def test_measured_llama_tiny_matches_analytic(comm_volume):
  (row,) = comm_volume[0]['rows']
  assert (row['method'], row['N'], row['density']) == ('scape', 8, 0.01)
  # The JSON leaves the shapes out: the model's own, from its definition.
  abstract = nnx.eval_shape(lambda: models.build(
      models.get_config('llama-tiny'), rngs=nnx.Rngs(0)))
  shapes = [x.shape for x in jax.tree.leaves(nnx.to_pure_dict(
      nnx.state(abstract, nnx.Param)))]
  an = cost.scape_bytes(shapes, 8, 0.01, 'auto')
  assert row['complete']
  assert row['params'] == sum(math.prod(s) for s in shapes)
  assert row['analytic'] == pytest.approx(an['bytes'])
  assert row['measured_bytes'] == pytest.approx(an['bytes'], rel=0.05)
  assert row['by_kind']['all-gather'] == pytest.approx(an['mask_bytes'])
  # The all-reduce also carries the train step's 2-float metrics pmean
  # (loss, squared gradient norm).
  assert row['by_kind']['all-reduce'] == pytest.approx(
      an['payload_bytes'] + analysis.ring_all_reduce_bytes(2 * 4, 8))


def test_outer_table_amortises_the_sync_over_r(comm_volume):
  """DiLoCo 2 groups x 4: the inner step all-reduces within a group, the
  sync step adds the mean over the 2 groups; the table amortises it."""
  _, outer, table = comm_volume
  (row,) = outer['rows']
  assert (row['groups'], outer['group_size'], outer['sync_every']) == (
      2, 4, [50, 500])
  params = row['params']
  assert row['analytic'] == pytest.approx(
      cost.ring_all_reduce_bytes(4 * params, 4))
  assert row['analytic_sync'] == pytest.approx(
      row['analytic'] + cost.ring_all_reduce_bytes(4 * params, 2))
  assert row['sync_bytes'] == pytest.approx(row['analytic_sync'], rel=0.01)
  extra = row['sync_bytes'] - row['measured_bytes']
  cells = table.splitlines()[-1].split(' | ')
  # inner, (analytic), sync, (analytic), across r=50, r=500, total r=50, r=500
  want = [row['measured_bytes'], row['analytic'], row['sync_bytes'],
          row['analytic_sync'], extra / 50, extra / 500,
          row['measured_bytes'] + extra / 50,
          row['measured_bytes'] + extra / 500]
  assert cells[4:12] == [f'{b / 1e6:.3f}' for b in want]
