"""bench/fidelity_tools.py: the study's compressor against NumPy, and probes
that observe without changing the trajectory."""

import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scape_jax
from scape_jax.optim import _scape_local_adam
from tests.reference import k_of
from tests.test_scape import check_local_adam

_BENCH = os.path.join(os.path.dirname(os.path.dirname(__file__)), 'bench')
sys.path.insert(0, _BENCH)
_spec = importlib.util.spec_from_file_location(
    'fidelity_tools', os.path.join(_BENCH, 'fidelity_tools.py'))
ft = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ft)


def _tree(seed, shapes):
  rng = np.random.default_rng(seed)
  return {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}


def topk_ef_reference(grads_seq, density, sparse_from):
  """NumPy: per leaf with ndim >= 2, keep the k largest |g + e| from a step."""
  e = None
  for t, grads in enumerate(grads_seq):
    e = e or {k: np.zeros_like(g) for k, g in grads.items()}
    out = {}
    for name, g in grads.items():
      if t < sparse_from:
        out[name] = g
        continue
      acc = g + e[name]
      if g.ndim < 2:
        out[name], e[name] = acc, np.zeros_like(acc)
        continue
      k = k_of(density, acc.size)
      order = np.argsort(-np.abs(acc).reshape(-1), kind='stable')[:k]
      keep = np.zeros(acc.size, bool)
      keep[order] = True
      keep = keep.reshape(acc.shape)
      out[name] = np.where(keep, acc, 0)
      e[name] = np.where(keep, 0, acc)
    yield out, e


def test_topk_error_feedback_matches_numpy():
  shapes = {'w': (12, 9), 'v': (5, 4, 3), 'b': (9,)}
  seq = [_tree(s, shapes) for s in range(6)]
  density, sparse_from = 0.2, 2
  tx = ft.topk_error_feedback()
  state = tx.init(seq[0])
  step = jax.jit(tx.update, static_argnames='density')
  sent_total = 0.0
  for t, ((want, want_e), g) in enumerate(
      zip(topk_ef_reference(seq, density, sparse_from), seq)):
    got, state = step(g, state, density=density if t >= sparse_from else 1.0)
    for k in shapes:
      np.testing.assert_allclose(got[k], want[k], rtol=1e-6, err_msg=k)
      np.testing.assert_allclose(state.residual[k], want_e[k], rtol=1e-6)
    norm_e = np.sqrt(sum(np.sum(x**2) for x in want_e.values()))
    np.testing.assert_allclose(state.residual_norm, norm_e, rtol=1e-5)
    sent_total += float(np.sum(got['w'] != 0))
  # Sparse steps keep exactly k of the 108 entries of w.
  assert sent_total == 2 * 108 + 4 * k_of(density, 108)
  assert float(state.residual_norm) > 0


@pytest.mark.parametrize('rule,step_scale', [('current', 1.0),
                                             ('pending', 2.0)])
def test_topk_error_feedback_rules_match_numpy(rule, step_scale):
  """'current' picks the k largest |g| of this step, then sends g + e there;
  step_scale multiplies what is sent, never the residual."""
  shapes = {'w': (12, 9), 'b': (9,)}
  seq = [_tree(s, shapes) for s in range(5)]
  tx = ft.topk_error_feedback(rule, step_scale)
  state = tx.init(seq[0])
  step = jax.jit(tx.update, static_argnames='density')
  e = np.zeros(shapes['w'], np.float32)
  for g in seq:
    got, state = step(g, state, density=0.2)
    acc = g['w'] + e
    score = g['w'] if rule == 'current' else acc
    order = np.argsort(-np.abs(score).reshape(-1), kind='stable')
    keep = np.zeros(acc.size, bool)
    keep[order[:k_of(0.2, acc.size)]] = True
    keep = keep.reshape(acc.shape)
    e = np.where(keep, 0, acc)
    np.testing.assert_allclose(got['w'], np.where(keep, step_scale * acc, 0),
                               rtol=1e-6)
    np.testing.assert_allclose(state.residual['w'], e, rtol=1e-6)
    np.testing.assert_allclose(got['b'], g['b'], rtol=1e-6)


def test_topk_error_feedback_random_rule_sends_k_fresh_draws():
  shapes = {'w': (30, 20)}
  tx = ft.topk_error_feedback('random')
  g = _tree(0, shapes)
  state = tx.init(g)
  step = jax.jit(tx.update, static_argnames='density')
  sent, e = [], np.zeros(shapes['w'], np.float32)
  for _ in range(3):
    out, state = step(g, state, density=0.1)
    keep = np.asarray(out['w']) != 0
    assert keep.sum() == k_of(0.1, 600)
    acc = g['w'] + e
    np.testing.assert_allclose(out['w'][keep], acc[keep], rtol=1e-6)
    e = np.where(keep, 0, acc)
    np.testing.assert_allclose(state.residual['w'], e, rtol=1e-6)
    sent.append(keep)
  assert not np.array_equal(sent[0], sent[1])  # a new draw each step
  with pytest.raises(ValueError, match="rule='best'.*allowed"):
    ft.topk_error_feedback('best')


def test_oracle_names_match_the_registry():
  import fidelity  # pylint: disable=g-import-not-at-top
  for alt, extra in fidelity.ORACLES.items():
    for density in (0.1, 0.01):
      assert fidelity.oracle_method(density, alt) == ft.register_topk(
          'adams', 'update', density, warmup_steps=50, **extra)


def test_first_moment_overlap_counts_shared_topk():
  shapes = {'w': (10, 10), 'b': (10,)}
  tx = ft.first_moment_overlap(scape_jax.scale_by_adams(), density=0.1)
  g = _tree(0, shapes)
  state = tx.init(g)
  update = jax.jit(tx.update)
  _, state = update(g, state)
  assert float(state.overlap['w']) == 0.0  # nothing before the first step
  _, state = update(g, state)  # same gradient: same ranking of |m|
  assert float(state.overlap['w']) == 1.0
  _, state = update(jax.tree.map(lambda x: -30 * x[::-1], g), state)
  assert float(state.overlap['w']) < 1.0
  assert set(state.overlap) == {'w'}


def test_probe_changes_no_update_and_measures_the_fresh_step():
  """Single worker, no clipping: the probe returns scale_by_scape's updates,
  and a coordinate selected after waiting moves by (1-b1)/sqrt(1-b2)."""
  shapes = {'w': (40, 10), 'b': (10,)}
  b1, b2, eps = 0.9, 0.95, 1e-8
  inner = scape_jax.scale_by_scape(0.1, b1=b1, b2=b2, eps=eps, clip_norm=None,
                                   axis_name=None)
  probe = ft.scape_probe(inner, b1=b1, b2=b2, eps=eps, clip_norm=None,
                         axis_name=None)
  params = _tree(0, shapes)
  s_plain, s_probe = inner.init(params), probe.init(params)
  plain_step, probe_step = jax.jit(inner.update), jax.jit(probe.update)
  fresh_steps = []
  for t in range(30):
    g = _tree(t + 1, shapes)
    u_plain, s_plain = plain_step(g, s_plain)
    u_probe, s_probe = probe_step(g, s_probe)
    for k in shapes:
      np.testing.assert_array_equal(u_plain[k], u_probe[k])
    stats = s_probe.stats
    if float(stats['fresh_frac']) > 0:
      fresh_steps.append((float(stats['step_fresh']),
                          float(stats['step_fresh_pred'])))
  assert fresh_steps
  for got, want in fresh_steps[-5:]:
    assert got == pytest.approx(want, rel=1e-4)
  hist = sum(float(v) for k, v in s_probe.stats.items()
             if k.startswith('selected/'))
  assert hist == pytest.approx(1.0)
  assert 0 < float(s_probe.stats['cos_adams']) < 1


def test_grid_keys_share_identical_runs_and_every_point_has_adams():
  spec = importlib.util.spec_from_file_location(
      'fidelity', os.path.join(_BENCH, 'fidelity.py'))
  fidelity = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(fidelity)
  runs = fidelity.grid_runs()
  keys = {}
  for point, method, seed, overrides in runs:
    keys.setdefault((point, method, seed), fidelity.run_key(overrides))
  # AdamS ignores SCAPE's warmup: the warmup points reuse the base AdamS run.
  assert (keys[(('warmup', '0'), 'AdamS', 0)] ==
          keys[(('base', ''), 'AdamS', 0)] == 'name=adams,seed=0')
  assert keys[(('warmup', '0'), 'SCAPE d=0.1', 0)] != keys[
      (('base', ''), 'SCAPE d=0.1', 0)]
  assert len(set(keys.values())) < len(keys)
  # Only the seed the diagnosis reads goes through the probe.
  assert keys[(('base', ''), 'fresh d=0.1', 0)] == (
      'name=probe_scape,density=0.1,variant=fresh,seed=0')
  assert keys[(('base', ''), 'SCAPE d=0.01', 1)] == (
      'name=scape,density=0.01,variant=faithful,seed=1')
  # A '+il' study name is its library variant with the embedding interleaved.
  assert keys[(('base', ''), 'local_adam_shrunk+il d=0.01', 1)] == (
      'name=scape,density=0.01,interleaved_leaves=embed_tokens,'
      'variant=local_adam_shrunk,seed=1')
  for axis, value, _, names in fidelity.POINTS:
    assert 'AdamS' in names and len(fidelity.SEEDS) == 2, (axis, value)


@pytest.mark.parametrize('kind,variant', [('mask', 'local_adam_now'),
                                          ('v', 'local_adam_now'),
                                          ('mask', 'local_adam_smoothv')])
def test_informed_local_adam_matches_numpy(kind, variant, monkeypatch):
  """bench/fidelity_information.py: a variant with the workers' mean
  update as the mask's scores, or the mean gradient in v, against
  `reference.LocalAdamReference(informed=kind)`."""
  spec = importlib.util.spec_from_file_location(
      'fidelity_information', os.path.join(_BENCH, 'fidelity_information.py'))
  info = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(info)
  monkeypatch.setattr(_scape_local_adam, *info.REPLACEMENTS[kind])
  check_local_adam(0.1, variant, informed=kind)
  with pytest.raises(ValueError, match="kind='x'; allowed: mask, v"):
    info.inform('x')


def test_run_locks_are_held_by_live_or_fresh_claims_only(tmp_path):
  """`_claim`: a live pid or a lock still being written (empty, new) holds
  the run; a dead pid or an old empty lock is taken over."""
  spec = importlib.util.spec_from_file_location(
      'fidelity', os.path.join(_BENCH, 'fidelity.py'))
  fidelity = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(fidelity)
  lock = str(tmp_path / 'run.json.lock')
  assert fidelity._claim(lock)
  assert open(lock).read() == str(os.getpid())
  assert not fidelity._claim(lock)  # we are alive
  open(lock, 'w').close()  # created, pid not written yet
  assert not fidelity._claim(lock)
  os.utime(lock, (0, 0))  # ... a long time ago: its writer died
  assert fidelity._claim(lock)
  with open(lock, 'w') as f:
    f.write('999999999')  # no such process
  assert fidelity._claim(lock)
  assert open(lock).read() == str(os.getpid())


def test_horizon_gaps_compare_each_run_with_adams_on_its_seed(tmp_path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import fidelity_horizon  # pylint: disable=g-import-not-at-top
  steps = np.arange(1, 401, 10)
  adams = {s: {'curve': [(int(t), 2.0 + s) for t in steps], 'steps': 400}
           for s in (0, 1)}
  scape = {s: {'curve': [(int(t), (2.0 + s) * (1.5 - t / 800))
                         for t in steps], 'steps': 400} for s in (0, 1)}
  grid = {('steps', '400'): {'AdamS': adams, 'SCAPE d=0.1': scape}}
  gaps = fidelity_horizon.horizon_gaps(grid)
  assert sorted(gaps) == [(400, 'SCAPE d=0.1', 0), (400, 'SCAPE d=0.1', 1)]
  for pts in gaps.values():  # a running mean of a line is the line
    for t, g in pts:
      np.testing.assert_allclose(g, 0.5 - t / 800, atol=1e-9)
  saved = []
  table = fidelity_horizon.plot_horizon(
      grid, str(tmp_path / 'h.png'), lambda fig, path: saved.append(path))
  assert saved and table[2].startswith('| 400 steps | 0 | SCAPE d=0.1 | ')
  assert f'{100 * (0.5 - 301 / 800):+.1f}%' in table[2]


def test_targets_table_judges_every_seed_and_the_mean(monkeypatch):
  """`fidelity_variants.targets_text`: a cell's mean and standard error
  against `statistics`, and the three verdicts."""
  import statistics  # pylint: disable=g-import-not-at-top
  import fidelity_variants  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(fidelity_variants.fidelity, 'VARIANTS', ('v',))
  adams = {s: {'eval_loss': 2.0} for s in range(5)}
  gaps = {  # per-seed gap at d = 0.1 (target 2%) and d = 0.01 (5%)
      'SCAPE d=0.1': [0.10, 0.20], 'SCAPE d=0.01': [0.01, 0.04],
      'v d=0.1': [-0.01, 0.05, 0.0, 0.02, 0.01], 'v d=0.01': [0.06, 0.09]}
  base = {'AdamS': adams, **{m: {s: {'eval_loss': 2.0 * (1 + g)}
                                 for s, g in enumerate(v)}
                             for m, v in gaps.items()}}
  lines = fidelity_variants.targets_text({('base', ''): base})
  values = gaps['v d=0.1']
  error = statistics.stdev(values) / len(values) ** 0.5
  mean = f'{100 * statistics.mean(values):+.1f}% +- {100 * error:.1f}'
  row = lines[3].split(' | ')
  assert row[1].startswith(mean) and 'meets on the mean**, not every' in row[1]
  assert 's1 +5.0' in row[1] and 'misses' in row[2] and row[3] == 'not run'
  faithful = lines[2].split(' | ')
  assert 'misses' in faithful[1] and '**meets**, every seed' in faithful[2]
  assert lines[5] == ('Targets met on every seed run: SCAPE at b2 = 0.95, '
                      'd = 0.01 (2 seeds).')
  assert lines[6].startswith('Targets met by the mean gap over the seeds '
                             'run, not on every seed: v at b2 = 0.95, d = '
                             '0.1 (5 seeds)')


def test_targets_section_leaves_out_methods_not_run(monkeypatch):
  """`fidelity_variants.targets_section`: only methods with a run get a
  row, and each run's eval loss is listed under its b2 and seed."""
  import fidelity_variants  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(fidelity_variants.fidelity, 'VARIANTS', ('v', 'w'))
  grid = {('base', ''): {'AdamS': {0: {'eval_loss': 2.0}},
                         'v d=0.1': {0: {'eval_loss': 2.02}, 3: {
                             'eval_loss': 2.1}}},
          ('warmup', '0'): {'AdamS': {1: {'eval_loss': 9.0}}}}
  lines = fidelity_variants.targets_section(grid, 'runs/x')
  rows = [x for x in lines if x.startswith('| ')]
  assert [r.split(' | ')[0] for r in rows[:2]] == ['| method', '| v']
  assert '+1.0% (s0 +1.0; **meets**, every seed)' in rows[1]
  assert rows[1].count('not run') == 3  # d = 0.01 and b2 = 0.999
  rest = ' | -' * (len(fidelity_variants.fidelity.ALL_SEEDS) - 4) + ' |'
  assert rows[-2:] == ['| 0.95 | AdamS | 2.0000 | - | - | -' + rest,
                       '| 0.95 | v d=0.1 | 2.0200 | - | - | 2.1000' + rest]
  assert not any('9.0000' in x for x in lines)  # not a targets point
  # The section says how many runs it was made from (`targets` refuses to
  # replace it from fewer).
  assert fidelity_variants.targets_runs(grid) == 3
  assert fidelity_variants.targets_runs_in('\n'.join(lines)) == 3
  assert fidelity_variants.targets_runs_in('no table') == 0


def test_noise_scale_of_the_temper_study_is_shrunk_at_1_and_tempered_at_half(
    monkeypatch):
  import fidelity_temper  # pylint: disable=g-import-not-at-top
  scores = _scape_local_adam._SCORES  # pylint: disable=protected-access
  rng = np.random.default_rng(0)
  u = jnp.asarray(rng.normal(size=(64, 8)), jnp.float32)
  noise = jnp.asarray(rng.uniform(0, 2, size=(64, 8)), jnp.float32)
  expected = {1.0: _scape_local_adam.shrunk_score(u, noise),
              0.5: _scape_local_adam.tempered_score(u, noise)}
  for kappa, score in expected.items():
    monkeypatch.setitem(scores, 'local_adam_shrunk',
                        scores['local_adam_shrunk'])
    fidelity_temper.scale_noise(kappa)
    np.testing.assert_array_equal(scores['local_adam_shrunk'](u, noise),
                                  score)
  assert not np.array_equal(expected[0.5], expected[1.0])


def test_paired_text_subtracts_gaps_seed_by_seed(monkeypatch):
  """`fidelity_variants.paired_text`: the mean and standard error of the
  per-seed difference of gaps against NumPy, over the common seeds only."""
  import fidelity_variants  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(fidelity_variants, 'PAIRS',
                      (('v d=0.01', 'w d=0.01', None),
                       ('v d=0.01', 'w d=0.01', (0, 2))))
  adams = {s: {'eval_loss': 2.0} for s in range(4)}
  v, w = [0.05, 0.02, 0.07, 0.04], [0.03, 0.04, 0.06]  # w has no seed 3
  runs = {'AdamS': adams,
          'v d=0.01': {s: {'eval_loss': 2.0 * (1 + g)} for s, g in
                       enumerate(v)},
          'w d=0.01': {s: {'eval_loss': 2.0 * (1 + g)} for s, g in
                       enumerate(w)}}
  lines = fidelity_variants.paired_text(runs)
  diffs = 100 * (np.array(v[:3]) - np.array(w))
  error = np.std(diffs, ddof=1) / np.sqrt(3)
  assert lines[0] == (f'- v d=0.01 minus w d=0.01: {diffs.mean():+.2f} +- '
                      f'{error:.2f} points over 3 seeds, ahead on 1.')
  assert lines[1].startswith('- v d=0.01 minus w d=0.01 (seeds 0, 2): '
                             f'{diffs[[0, 2]].mean():+.2f}')
  assert len(lines) == 2  # no method has ten seeds


def test_report_refuses_to_replace_results_with_fewer_runs(tmp_path,
                                                            monkeypatch):
  """`fidelity_report.write` on a checkout holding part of the runs stops
  before it touches docs/results.md or a plot, unless told to go on."""
  import fidelity  # pylint: disable=g-import-not-at-top
  import fidelity_report  # pylint: disable=g-import-not-at-top
  doc, plots, out = tmp_path / 'results.md', tmp_path / 'plots', tmp_path
  text = ('# Results\n<!-- begin fidelity -->\n## Fidelity\n'
          f'Generated. {fidelity_report.FINISHED.format(100, 900)}.\n'
          '<!-- end fidelity -->\n')
  doc.write_text(text)
  monkeypatch.setattr(fidelity_report, 'DOC', str(doc))
  monkeypatch.setattr(fidelity_report, 'PLOTS', str(plots))
  (out / 'runs').mkdir()
  _, _, _, overrides = fidelity.grid_runs()[0]
  (out / 'runs' / (fidelity.run_key(overrides) + '.json')).write_text(
      '{"eval_loss": 2.0}')
  with pytest.raises(SystemExit, match=r'holds [1-9] finished grid runs and '
                     r'0 of \d+ figure runs; .* made from 100 grid runs'):
    fidelity_report.write(str(out))
  assert doc.read_text() == text and not plots.exists()
  with pytest.raises(SystemExit, match='0 of'):  # the figures' runs lack
    fidelity_report.check_not_fewer(str(out), 100)
  monkeypatch.setattr(fidelity, 'figure_runs', lambda: [])
  fidelity_report.check_not_fewer(str(out), 100)  # as many: it may write
  with pytest.raises(SystemExit, match='holds 99 finished'):
    fidelity_report.check_not_fewer(str(out), 99)
  doc.write_text('# Results\n')  # no section yet: nothing to lose
  fidelity_report.check_not_fewer(str(out), 0)


def test_probe_interleaves_as_the_trainer_and_refuses_dense_leaves():
  """`probe_scape` takes `optimizer.scape.interleaved_leaves` as `scape`
  does (same collectives and bytes as with contiguous chunks) and refuses
  `dense_leaves` by name instead of ignoring it."""
  from scape_jax import analysis  # pylint: disable=g-import-not-at-top
  from scape_jax import train as trainer  # pylint: disable=g-import-not-at-top
  from scape_jax.train import config as config_lib  # pylint: disable=g-import-not-at-top
  ft.register_study_methods()

  def build(*overrides):
    return trainer.build_program(config_lib.load(None, [
        '--config.model.preset=llama-tiny', '--config.data.seq_len=16',
        '--config.data.batch_size=16', '--config.steps=10',
        '--config.optimizer.name=probe_scape',
        '--config.optimizer.scape.density=0.1', *overrides]))

  def walks(program):
    return [(c.kind, c.elements) for c in
            analysis.collectives_from_hlo(program.compile_step(5).as_text())]

  key = '--config.optimizer.scape.'
  interleaved = build(key + 'interleaved_leaves=embed_tokens')
  assert interleaved.method.tx.update.__qualname__.startswith(
      'interleave_chunks.')
  assert walks(interleaved) == walks(build())
  with pytest.raises(ValueError, match="dense_leaves='embed_tokens'"):
    build(key + 'dense_leaves=embed_tokens')


def test_leaves_study_counts_the_embedding_rows_each_chunk_holds(tmp_path):
  """`fidelity_leaves.chunks`: per contiguous chunk of the embedding's rows,
  the rows that hold a token of train.bin and their share of the tokens."""
  spec = importlib.util.spec_from_file_location(
      'fidelity_leaves', os.path.join(_BENCH, 'fidelity_leaves.py'))
  leaves = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(leaves)
  (tmp_path / 'meta.json').write_text('{"vocab_size": 16, "dtype": "uint16"}')
  np.array([1, 1, 2, 9, 15, 15, 15, 3], np.uint16).tofile(
      tmp_path / 'train.bin')
  rows = [line for line in leaves.chunks(str(tmp_path), 4).splitlines()
          if line.startswith('| ') and line[2].isdigit()]
  assert rows == ['| 0 | 0-3 | 3 | 0.500 | 5 |', '| 1 | 4-7 | 0 | 0.000 | 5 |',
                  '| 2 | 8-11 | 1 | 0.125 | 5 |',
                  '| 3 | 12-15 | 1 | 0.375 | 5 |']
