"""bench/optimizer_overhead.py runs end to end on its smoke settings, as a
user runs it."""

import functools
import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import optax
import numpy as np
import pytest

import scape_jax
from tests import bench_scripts
LOCAL_ADAM = hasattr(scape_jax, 'scape_local_adam')


def test_quick_run_has_every_column(tmp_path):
  argv = ['--quick', '--repeats', '4', '--densities', '1', '0.01', '--step',
          '--out', str(tmp_path)]
  if LOCAL_ADAM:
    argv += ['--methods', 'adams', 'scape', 'scape_local_adam']
  bench_scripts.check('optimizer_overhead', *argv)
  out = json.loads((tmp_path / 'optimizer_overhead.json').read_text())
  by = {r['method']: r for r in out['rows']}
  want = ['optax.adamw', 'adams', 'scape d=1', 'scape d=0.01']
  if LOCAL_ADAM:
    want[3:3] = ['scape_local_adam d=1']
    want += ['scape_local_adam d=0.01']
  plain = list(want)
  want += [label + ' (step)' for label in plain]
  assert list(by) == want
  # --quick fills in only what was not given: llama-tiny, 2 calls a sample.
  assert {(r['tree'], r['repeats'], r['number']) for r in by.values()} == {
      ('llama-tiny', 4, 2)}
  assert by['optax.adamw']['ratio_vs_adamw'] == 1.0
  # --step: ratios to adamw's step; the state column is the optimizer's
  # state alone, not the params the step carries beside it.
  assert by['optax.adamw (step)']['ratio_vs_adamw'] == 1.0
  for label in plain:
    assert by[label + ' (step)']['state_bytes'] == by[label]['state_bytes']
  # State: adamw's two fp32 moments, AdamS's one, each with a step count.
  params = by['optax.adamw']['params']
  assert by['optax.adamw']['state_bytes'] == 8 * params + 4
  assert by['adams']['state_bytes'] == 4 * params + 4
  sparse = by['scape d=0.01']
  for how in ('topk', 'select'):
    for n in (1, 32):
      assert sparse[f'{how}_ms_N{n}'] > 0
  # The one-of-32 selection's ratio is to adamw's update timed beside it,
  # in the selection's own loop, not to the table's adamw row.
  beside = sparse['select_N32_adamw_ms']
  assert beside > 0 and beside != by['optax.adamw']['median_ms']
  assert sparse['select_N32_vs_adamw'] == pytest.approx(
      sparse['select_ms_N32'] / beside)
  assert sparse['temp_bytes'] > 0 and sparse['temp_bytes_sort'] > 0
  # Bytes accessed: adamw reads g, m, v and the params and writes m, v and
  # the update, at least (a fusion may read an operand twice).
  assert by['optax.adamw']['accessed_bytes'] >= 7 * 4 * params
  assert sparse['accessed_bytes'] > by['adams']['accessed_bytes']
  assert by['scape d=1']['topk_ms_N1'] is None  # nothing is selected
  assert by['scape d=1']['temp_bytes_sort'] is None
  assert out['meta']['command'].endswith(' '.join(argv))
  table = (tmp_path / 'optimizer_overhead.md').read_text()
  assert table.count('| llama-tiny |') == len(want)


def _bench_module(name: str):
  spec = importlib.util.spec_from_file_location(
      name, pathlib.Path(__file__).parents[1] / 'bench' / f'{name}.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_whole_step_is_the_update_applied_or_nothing():
  """--step times `whole_step`: optax's own adamw update applied to the
  params, and with a non-finite gradient the params and state unchanged."""
  bench = _bench_module('optimizer_overhead')
  params, grads = bench.param_tree('llama-tiny')
  method = bench.methods([])['optax.adamw']
  state = method.tx.init(params)
  updates, want_state = method.tx.update(grads, state, params)
  want = optax.apply_updates(params, updates)
  step = jax.jit(bench.whole_step(method))
  _, (got, got_state) = step(grads, (params, state), None)
  close = functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-8)
  jax.tree.map(close, (got, got_state), (want, want_state))
  bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads)
  _, (got, got_state) = step(bad, (params, state), None)
  jax.tree.map(np.testing.assert_array_equal, (got, got_state),
               (params, state))
