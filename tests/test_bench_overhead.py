"""bench/optimizer_overhead.py runs end to end on its smoke settings."""

import importlib.util
import json
import os

import jax
import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), 'bench',
                     'optimizer_overhead.py')
_spec = importlib.util.spec_from_file_location('optimizer_overhead', _PATH)
oo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oo)


def _tiny_tree(name, seed=0):
  del name
  shapes = {'w': (64, 48), 'v': (40, 33), 'b': (48,)}
  keys = iter(jax.random.split(jax.random.key(seed), 2 * len(shapes)))
  return tuple({k: scale * jax.random.normal(next(keys), s)
                for k, s in shapes.items()} for scale in (0.02, 1e-3))


def test_quick_run_has_every_column(tmp_path, monkeypatch):
  monkeypatch.setattr(oo, 'param_tree', _tiny_tree)  # compiles in seconds
  rows = oo.main(['--quick', '--densities', '1', '0.01', '--out',
                  str(tmp_path)])
  by = {r['method']: r for r in rows}
  assert list(by) == ['optax.adamw', 'adams', 'scape d=1', 'scape d=0.01']
  assert by['optax.adamw']['ratio_vs_adamw'] == 1.0
  assert all(r['tree'] == 'llama-tiny' and r['repeats'] == 3 for r in rows)
  sparse = by['scape d=0.01']
  for how in oo.SELECTIONS:
    for n in (1, 32):
      assert sparse[f'{how}_ms_N{n}'] > 0
  # The one-of-32 selection's ratio is to adamw's update timed beside it,
  # in the selection's own loop, not to the table's adamw row.
  beside = sparse['select_N32_adamw_ms']
  assert beside > 0 and beside != by['optax.adamw']['median_ms']
  assert sparse['select_N32_vs_adamw'] == pytest.approx(
      sparse['select_ms_N32'] / beside)
  assert sparse['temp_bytes'] > 0 and sparse['temp_bytes_sort'] > 0
  assert by['scape d=1']['topk_ms_N1'] is None  # nothing is selected
  assert by['scape d=1']['temp_bytes_sort'] is None
  meta = json.loads((tmp_path / 'optimizer_overhead.json').read_text())
  assert meta['meta']['command'].endswith(f'--out {tmp_path}')
  table = (tmp_path / 'optimizer_overhead.md').read_text()
  assert table.count('| llama-tiny |') == 4
