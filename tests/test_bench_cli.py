"""The bench scripts' command lines: a bad value is a usage error (exit 2,
naming the option and the value) before any work, never a traceback after
minutes of compiling, a silent default or an empty table."""

import argparse
import importlib
import os
import re
import sys

import jax
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'bench'))

cli_types = importlib.import_module('cli_types')


@pytest.mark.parametrize('fn, text, want', [
    ('positive_int', '3', 3), ('non_negative_int', '0', 0),
    ('positive_float', '0.5', 0.5), ('non_negative_float', '0', 0.0),
    ('density', '1', 1.0), ('density', '1e-3', 1e-3),
    ('seeds', '0,1,4', (0, 1, 4)), ('positive_floats', '0.25,2', (0.25, 2.0)),
])
def test_types_accept(fn, text, want):
  assert getattr(cli_types, fn)(text) == want


@pytest.mark.parametrize('fn, text, message', [
    ('positive_int', '0', 'must be an integer >= 1'),
    ('positive_int', '1.5', 'is not an integer'),
    ('non_negative_int', '-1', 'must be an integer >= 0'),
    ('positive_float', '0', 'must be > 0'),
    ('positive_float', 'inf', 'must be finite'),
    ('non_negative_float', 'nan', 'must be finite'),
    ('non_negative_float', '-50', 'must be >= 0'),
    ('density', '0', 'must be in (0, 1]'), ('density', '1.5', '(0, 1]'),
    ('density', 'abc', 'is not a number'),
    ('seeds', '1,a', 'comma-separated'), ('seeds', '-1', 'must be >= 0'),
    ('positive_floats', '1,-1', 'must be > 0'),
])
def test_types_refuse(fn, text, message):
  with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
    getattr(cli_types, fn)(text)


def test_write_markdown_writes_prints_and_returns_the_lines(tmp_path,
                                                            capsys):
  text = cli_types.write_markdown(str(tmp_path), 't.md', ['# a', '| b |'])
  assert text == '# a\n| b |\n'
  assert (tmp_path / 't.md').read_text() == text
  assert capsys.readouterr().out == text + '\n'


def _main(module, entry='main'):
  return getattr(importlib.import_module(module), entry)


@pytest.fixture(name='a_file')
def _a_file(tmp_path):
  path = tmp_path / 'a_file'
  path.write_text('')
  return str(path)


# (module, entry, argv, what stderr says). {file} is a regular file, {missing}
# a path that does not exist.
USAGE_ERRORS = [
    ('optimizer_overhead', 'main', ['--repeats', '0'],
     'argument --repeats: 0: must be an integer >= 1'),
    ('optimizer_overhead', 'main', ['--number', '-1'], 'argument --number'),
    ('optimizer_overhead', 'main', ['--densities', '0'], 'density 0.0'),
    ('optimizer_overhead', 'main', ['--quick', '--out', '{file}/x'],
     'cannot create it'),
    # Checked before compiling (it ended a run's hour with a traceback).
    ('comm_volume', 'main', ['--out', '{file}/x'], 'cannot create it'),
    ('projected_step_time', 'main', ['--out', '{file}/x'], 'cannot create it'),
    ('fcdp_volume', 'main', ['--out', '{file}/x'], 'cannot create it'),
    ('memory_table', 'main', ['--out', '{file}/x'], 'cannot create it'),
    ('select_crossover', 'main', ['--selects', 'sort'],
     'name at least two selects'),
    ('select_crossover', 'main', ['--out', '{file}/x'], 'cannot create it'),
    ('update_profile', 'main', ['--calls', '0'], 'argument --calls'),
    ('alloc_cost', 'main', ['--repeats', '0'], 'argument --repeats'),
    ('alloc_cost', 'main', ['--sizes-mib', '0'], 'argument --sizes-mib'),
    ('alloc_cost', 'main', ['--out', '{file}/x'], 'cannot create it'),
    ('sample_size', 'main', ['--samples', '0'], 'argument --samples'),
    ('sample_size', 'main', ['--densities', '2'], 'density 2.0'),
    ('norm_at_m', 'main', ['--repeats', '0'], 'argument --repeats'),
    ('norm_at_m', 'main', ['--densities', '2'], 'density 2.0'),
    ('ab_noise', 'main', ['--copies', '0'], 'argument --copies'),
    ('update_ab', 'main', ['--variants', 'both undone'], "'as is'"),
    ('update_ab', 'main', ['--variants', 'no such'], 'argument --variants'),
    ('ab_noise', 'main', ['--programs', '0'], 'argument --programs'),
    ('update_profile', 'main', ['--top', '0'], 'argument --top'),
    ('update_phases', 'main', ['--repeats', '0'], 'argument --repeats'),
    ('update_temps', 'main', ['--src', '{missing}'],
     'no scape_jax/ or models/ there'),
    ('update_temps', 'main', ['--densities', 'nan'], 'must be finite'),
    ('projected_step_time', 'main', ['--compute-ms', '-50'],
     'argument --compute-ms: -50.0: must be >= 0'),
    ('projected_step_time', 'main', ['--compute-ms', 'nan'], 'must be finite'),
    ('projected_step_time', 'main',
     ['--effective-tflops', '0', '--tokens-per-worker', '1000'],
     'argument --effective-tflops: 0.0: must be > 0'),
    ('projected_step_time', 'main',
     ['--compute-ms', '1', '--comm-json', '{missing}'], 'no such file'),
    ('projected_step_time', 'main', ['--compute-ms', '1', '--model', 'bogus'],
     "--model 'bogus': "),
    ('comm_volume', 'main', ['--no-outer', '--outer-only'],
     'not allowed with argument --no-outer'),
    ('comm_volume', 'main', ['--outer-only', '--workers', '4'],
     'nothing to measure: --outer-only needs'),
    ('comm_volume', 'main',
     ['--models', 'bogus', '--workers', '2', '--methods', 'adamw'],
     "unknown model 'bogus'"),
    ('comm_volume', 'main',
     ['--models', 'llama-tiny', '--workers', '64', '--methods', 'adamw'],
     f'--workers 64: at most {jax.device_count()}'),
    ('memory_table', 'main', ['--configs', 'bogus', '--no-compile'],
     'no configs/bogus.py; allowed: gpt345m'),
    ('memory_table', 'main',
     ['--configs', 'gpt345m', '--modes', 'scape', '--no-compile'],
     f'devices, and {jax.device_count()} are simulated'),
    ('fcdp_volume', 'main', ['--models', 'bogus'], "invalid choice: 'bogus'"),
    ('eval_downstream', 'main', ['--run', '{missing}', '--limit', '0'],
     'leave --limit out for every example'),
    ('netlab', 'main',
     ['probe-client', '--host', 'h', '--port', '1', '--pings', '0'],
     'argument --pings'),
    ('netlab', 'main', ['sample', '--out', '{missing}', '--interval', '-1',
                        'lo'], 'argument --interval'),
    ('network', 'parse_args', ['--set', 'optimzer.lr=1'],
     "unknown config key 'optimzer'"),
    ('network', 'parse_args', ['--workers', '1'], '--workers 1: at least 2'),
    ('network', 'parse_args', ['--warmup', '-3'], 'argument --warmup'),
    ('network', 'parse_args', ['--job-timeout', '-5'],
     'argument --job-timeout'),
    ('network', 'parse_args', ['--workers', '3', '--methods', 'DiLoCo'],
     'do not split into mesh.replica=2'),
]


@pytest.mark.parametrize('module, entry, argv, message', USAGE_ERRORS)
def test_bad_values_are_usage_errors(module, entry, argv, message, a_file,
                                     tmp_path, capsys, monkeypatch):
  # comm_volume and fcdp_volume add a compile flag to XLA_FLAGS: keep it out
  # of the other tests' subprocesses.
  monkeypatch.setenv('XLA_FLAGS', os.environ.get('XLA_FLAGS', ''))
  fill = {'file': a_file, 'missing': str(tmp_path / 'missing')}
  argv = [a.format(**fill) for a in argv]
  with pytest.raises(SystemExit) as e:
    _main(module, entry)(argv)
  assert e.value.code == 2
  assert message in capsys.readouterr().err


@pytest.mark.parametrize('script, argv, message', [
    (s, ['table', '--out', '{missing}'], 'no AdamS runs of the grid there')
    for s in ('fidelity_temper', 'fidelity_leaves')] + [
    ('fidelity_temper', ['run', '--scales=-1,nan', '--out', '{missing}'],
     'argument --scales'),
    ('fidelity_temper', ['run', '--seeds', '1,x', '--out', '{missing}'],
     'argument --seeds'),
    ('fidelity_leaves', ['run', '--seeds', '1,x', '--out', '{missing}'],
     'argument --seeds'),
    ('fidelity_leaves', ['run', '--methods', 'AdamS', '--out', '{missing}'],
     'argument --methods'),
])
def test_fidelity_studies_refuse(script, argv, message, tmp_path, capsys,
                                 monkeypatch):
  argv = [a.format(missing=str(tmp_path / 'missing')) for a in argv]
  monkeypatch.setattr(sys, 'argv', [f'{script}.py', *argv])
  with pytest.raises(SystemExit) as e:
    _main(script)()
  assert e.value.code == 2
  assert message in capsys.readouterr().err


def test_convergence_and_wire_fidelity_write_docs_of_this_checkout(
    monkeypatch, capsys):
  convergence = importlib.import_module('convergence')
  assert convergence.DOCS == os.path.join(ROOT, 'docs')
  monkeypatch.setattr(sys, 'argv', ['convergence.py'])
  assert convergence.arguments('', 'x').out == os.path.join(ROOT, 'runs', 'x')
  monkeypatch.setattr(sys, 'argv', ['convergence.py', '--steps', '0'])
  with pytest.raises(SystemExit):
    convergence.arguments('', 'x')
  assert 'argument --steps' in capsys.readouterr().err


def test_select_crossover_writes_its_table_with_its_command(tmp_path,
                                                           capsys):
  argv = ['--chunks', '1024', '--widths', '10', '100', '--out', str(tmp_path)]
  _main('select_crossover')(argv)
  text = (tmp_path / 'select_crossover.md').read_text()
  lines = text.splitlines()
  assert lines[0] == ('<!-- python bench/select_crossover.py '
                      + ' '.join(argv) + ' -->')
  rows = [line for line in lines if line.startswith('| 1,024 |')]
  assert [r.split(' | ')[1] for r in rows] == ['102', '10']
  assert all(r.endswith('| sort |') for r in rows)  # auto's choice on cpu
  assert rows[0] in capsys.readouterr().out  # printed as measured


@pytest.mark.parametrize('label, message', [
    ('scape d=abc', "'abc' is not a number"),
    ('scape d=0', 'density 0.0: must be in (0, 1]'),
    ('scape d=0.1 select=bogus', "select='bogus'"),
    ('nope', "allowed: 'optax.adamw', 'adams' or 'scape d=X' with X in "
     "(0, 1], optionally followed by ' select=S'"),
])
def test_update_profile_names_a_bad_method(label, message):
  with pytest.raises(SystemExit, match=re.escape(message)):
    _main('update_profile', 'method')(label)


def test_update_profile_counts_ops_running_at_once():
  # us: A [0, 10) and B [5, 15) overlap; C [20, 30) runs alone after a gap;
  # the while loop around them and the end marker are not ops.
  events = [{'name': 'a_fusion.3', 'ts': 0, 'dur': 10},
            {'name': 'b_fusion', 'ts': 5, 'dur': 10},
            {'name': 'c_fusion.1', 'ts': 20, 'dur': 10},
            {'name': 'while.2', 'ts': 0, 'dur': 30},
            {'name': 'end: a_fusion.3', 'ts': 10, 'dur': 1}]
  got = _main('update_profile', 'concurrency')(events, 1)
  assert got['alone'] == [('c_fusion', 0.01), ('a_fusion', 0.005),
                          ('b_fusion', 0.005)]
  del got['alone']
  assert got == pytest.approx({'span': 0.03, 'idle': 0.005, 'one': 0.02,
                               'several': 0.005, 'busy': 0.03})
  halved = _main('update_profile', 'concurrency')(events, 2)
  assert halved['one'] == pytest.approx(0.01)


def _tiny_tree(name, seed=0):
  del name
  keys = jax.random.split(jax.random.key(seed), 2)
  return tuple({'w': scale * jax.random.normal(k, (64, 48))}
               for scale, k in zip((0.02, 1e-3), keys))


def test_sample_size_times_each_sample_and_restores_the_default(
    monkeypatch):
  bench = importlib.import_module('sample_size')
  topk = importlib.import_module('scape_jax.comm.topk')
  default = topk.SAMPLE
  leaves = [np.random.default_rng(0).normal(size=(300, 200)).astype(
      np.float32)]
  ms = bench.measure(leaves, [(2, 0.5)], [4096, 64], 1)
  assert sorted(ms) == [(64, (2, 0.5)), (4096, (2, 0.5))]
  assert topk.SAMPLE == default
  # A sample size that changed the bits would be reported.
  real = bench.selection
  monkeypatch.setattr(bench, 'selection', lambda xs, n, d: real(
      xs, n, d if topk.SAMPLE == 4096 else d / 2))
  with pytest.raises(AssertionError, match='SAMPLE=64 changed the bits'):
    bench.measure(leaves, [(1, 0.1)], [4096, 64], 1)
  assert topk.SAMPLE == default


def test_norm_at_m_compares_both_sums_and_restores_the_rule(monkeypatch):
  bench = importlib.import_module('norm_at_m')
  scape = importlib.import_module('scape_jax.optim._scape_clip')
  rule = scape._NORM_AT_M_MAX_DENSITY  # pylint: disable=protected-access
  # Gradients large enough that the clip acts, so its norm matters.
  params, grads = ({'w': scale * jax.random.normal(jax.random.key(i),
                                                   (64, 48))}
                   for i, scale in enumerate((0.02, 1.0)))
  prep = bench.prepared([0.01], params, grads, programs=2)
  assert sorted(prep) == [('optax.adamw', None, 0),
                          ('scape d=0.01', 'at M', 0),
                          ('scape d=0.01', 'at M', 1),
                          ('scape d=0.01', 'full shape', 0),
                          ('scape d=0.01', 'full shape', 1)]
  assert (prep['scape d=0.01', 'at M', 0].fn
          is not prep['scape d=0.01', 'at M', 1].fn)
  bench.check_same(prep, [0.01], params, grads)
  assert bench.summary({('a', 'x', 0): 2.0, ('a', 'x', 1): 3.0,
                        ('a', 'x', 2): 6.0}) == {('a', 'x'): (3.0, 3.0)}
  assert scape._NORM_AT_M_MAX_DENSITY == rule  # pylint: disable=protected-access
  # A sum at M that differed from the full one would be reported.
  real = scape.squared_norms
  monkeypatch.setattr(scape, 'squared_norms', lambda *a: [
      4 * s if scape._NORM_AT_M_MAX_DENSITY == 1 else s  # pylint: disable=protected-access
      for s in real(*a)])
  prep = bench.prepared([0.01], params, grads)
  with pytest.raises(AssertionError, match='d=0.01'):
    bench.check_same(prep, [0.01], params, grads)


def test_update_ab_shares_one_state_and_restores_the_switches():
  bench = importlib.import_module('update_ab')
  masks = importlib.import_module('scape_jax.comm.masks')
  scape = importlib.import_module('scape_jax.optim._scape_clip')
  norms = importlib.import_module('scape_jax.optim._norms')
  # pylint: disable=protected-access
  default = (masks._STORE_OFFSETS, scape._NORM_FUSED, masks._SCATTER_AFTER,
             norms.OWN_REDUCTION, masks.BATCH_DECODE)
  # Gradients large enough that the clip acts, so its norm matters; two
  # compressed leaves, so that 'decode batched' decodes them in one call.
  params, grads = ({name: scale * jax.random.normal(jax.random.key(i + j),
                                                    shape)
                    for j, (name, shape) in enumerate([('w', (64, 48)),
                                                       ('v', (32, 40))])}
                   for i, scale in zip((0, 10), (0.02, 1.0)))
  prep = bench.prepared([0.1], list(bench.VARIANTS), params, grads,
                        programs=2)
  assert (masks._STORE_OFFSETS, scape._NORM_FUSED, masks._SCATTER_AFTER,
          norms.OWN_REDUCTION, masks.BATCH_DECODE) == default
  assert len(prep) == 1 + 2 * len(bench.VARIANTS)
  scape_keys = [k for k in prep if k[1] is not None]
  assert len({id(prep[k].state) for k in scape_keys}) == 1
  assert len({id(prep[k].fn) for k in scape_keys}) == len(scape_keys)
  bench.check_same(prep, params, grads)
  # A variant whose update differed would be reported.
  bad = prep['scape d=0.1', 'decode twice', 1]
  prep['scape d=0.1', 'decode twice', 1] = bad._replace(
      fn=lambda g, s, p: jax.tree.map(lambda x: 2 * x, bad.fn(g, s, p)))
  with pytest.raises(AssertionError, match='decode twice, program 2'):
    bench.check_same(prep, params, grads)


def test_ab_noise_copies_state_into_fresh_buffers():
  bench = importlib.import_module('ab_noise')
  params, grads = _tiny_tree('llama-tiny')
  prep = bench.prepared([0.1], params, grads, programs=2, copies=2)
  keys = [(m, (a, i)) for m in ('optax.adamw', 'scape d=0.1')
          for a in range(2) for i in range(2)]
  assert list(prep) == keys
  big = [[x for x in jax.tree.leaves(prep['scape d=0.1', c].state)
          if x.size > 100][0] for c in ((0, 0), (0, 1), (1, 0))]
  assert len({x.unsafe_buffer_pointer() for x in big}) == 3
  assert prep['scape d=0.1', (0, 0)].fn is prep['scape d=0.1', (0, 1)].fn
  assert prep['scape d=0.1', (0, 0)].fn is not prep['scape d=0.1', (1, 0)].fn
  bench.check_same(prep, params, grads)
  # A copy whose state differed would be reported.
  bad = prep['scape d=0.1', (1, 1)]
  prep['scape d=0.1', (1, 1)] = bad._replace(
      state=jax.tree.map(lambda x: x + 1 if x.dtype == np.float32 else x,
                         bad.state))
  with pytest.raises(AssertionError, match='scape d=0.1, program 2, copy 2'):
    bench.check_same(prep, params, grads)
  table = bench.spread({('a', 0): 2.0, ('a', 1): 3.0, ('b', 0): 5.0})
  assert table == {'a': ([2.0, 3.0], 1.5), 'b': ([5.0], 1.0)}


def test_quick_keeps_the_options_given(tmp_path, monkeypatch):
  oo = importlib.import_module('optimizer_overhead')
  monkeypatch.setattr(oo, 'param_tree', _tiny_tree)
  rows = oo.main(['--quick', '--repeats', '4', '--densities', '1', '--out',
                  str(tmp_path)])
  assert {(r['tree'], r['repeats'], r['number']) for r in rows} == {
      ('llama-tiny', 4, 2)}


def test_search_steer_counts_passes_both_ways_and_restores_the_steering():
  bench = importlib.import_module('search_steer')
  search = importlib.import_module('scape_jax.comm.search')
  masks = importlib.import_module('scape_jax.comm.masks')
  # pylint: disable=protected-access
  default = search._line_probes, search._SAMPLED_MIN
  x = np.random.default_rng(3).normal(size=1 << 16).astype(np.float32)
  k = 655
  want = np.zeros(x.size, bool)
  want[np.argsort(-np.abs(x), kind='stable')[:k]] = True
  for name in bench.STEERINGS:
    per_leaf, words = bench.passes([(jax.numpy.asarray(x), k)], name)
    assert len(per_leaf) == 1 and per_leaf[0] >= 1, name
    np.testing.assert_array_equal(
        words[0], np.asarray(masks.pack_bits(jax.numpy.asarray(want))), name)
    assert (search._line_probes, search._SAMPLED_MIN) == default
  with bench.steering('flat line'):
    assert search._line_probes is bench._flat_line
    assert search._SAMPLED_MIN == 16
  assert (search._line_probes, search._SAMPLED_MIN) == default
