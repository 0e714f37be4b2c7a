"""bench/fcdp_volume.py on gpt-tiny, run as a user runs it: its columns are
the sums of the collectives it read, and each FCDP switch's claim, checked
here on those collectives, holds in the compiled programs."""

import json

import pytest

from tests import bench_scripts


@pytest.fixture(scope='module')
def rows(tmp_path_factory):
  out = tmp_path_factory.mktemp('fcdp')
  bench_scripts.check('fcdp_volume', '--models', 'gpt-tiny', '--out', out)
  with open(out / 'fcdp_volume.json') as f:
    return {(r['workload'], r['variant']): r for r in json.load(f)['rows']}


def _sum(row, phase=None, kind=None, level=None):
  """Bytes of `row` over the (phase, kind, level) keys that match."""
  total = 0.0
  for key, value in row['bytes'].items():
    p, k, lv = key.split('/')
    if p != 'boundary' and (phase in (None, p) and kind in (None, k) and
                            level in (None, lv)):
      total += value
  return total


def test_columns_are_sums_of_the_collectives(rows):
  for row in rows.values():
    f = row['figures']
    assert f['inter'] == pytest.approx(_sum(row, level='inter'))
    assert f['intra'] == pytest.approx(_sum(row, level='intra'))
    assert f['backward_ag_inter'] == pytest.approx(
        _sum(row, 'backward', 'all-gather', 'inter'))
    assert f['rs_inter'] == pytest.approx(
        _sum(row, kind='reduce-scatter', level='inter'))


def test_each_switch_does_what_it_claims(rows):
  for workload in ('full', 'lora'):
    zero3 = rows[workload, 'ZeRO-3']
    assert _sum(zero3, 'backward', 'all-gather', 'inter') > 0  # re-gathers
    cached = rows[workload, 'FCDP host cache']
    assert _sum(cached, 'backward', 'all-gather', 'inter') == 0
    hier = rows[workload, 'FCDP hierarchical']
    assert hier['inter_all_gather_axes'] in ([], ['node'])
    assert _sum(hier, level='inter') < _sum(zero3, level='inter')
  aware = rows['lora', 'FCDP LoRA-aware']
  # Only the adapters cross nodes: at most every trainable fp32 element
  # gathered twice (forward, backward) over the 8 devices' ring.
  assert _sum(aware, kind='all-gather', level='inter') <= (
      2 * 4 * aware['trainable'] * 7 / 8)
  # The script's own verdicts agree.
  for row in rows.values():
    assert 'NO' not in row['holds']
  assert all(row['holds'] for (_, v), row in rows.items()
             if v.startswith('FCDP'))
