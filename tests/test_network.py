"""bench/network.py and bench/netlab.py: train.py across network namespaces.

Two workers, each in its own network namespace, train llama-tiny with AdamW
for a few steps as one jax.distributed job (gloo) over links shaped to
100 Mb/s with tbf. The bytes the kernel counted on each worker's link must
match the bytes the compiled step's HLO predicts, and nothing may be left
behind: not on success, not on an exception, not on SIGTERM, and a SIGKILLed
owner's namespaces are removed by the next cluster.

These need root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2; where
namespaces cannot be created they are skipped with the reason. The refusal
without privileges is tested everywhere.
"""

import importlib
import math
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from scape_jax.analysis import runs

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / 'bench'))
netlab = importlib.import_module('netlab')
network = importlib.import_module('network')

STEPS, WARMUP = 6, 2
# Cuts each worker's XLA:CPU compile time about in half.
FAST_COMPILE = ('--xla_backend_optimization_level=0 '
                '--xla_llvm_disable_expensive_passes=true')
# Counted TCP payload vs the HLO's bytes: the acceptance's 10%, and a floor
# for the interpolation of the counters at the window's ends.
TOLERANCE, FLOOR = 0.10, 0.97


@pytest.fixture(scope='module')
def namespaces():
  """Skips the test, with the reason, where namespaces cannot be created."""
  try:
    netlab.require_privileges()
    with netlab.Cluster(1, prefix='scapeprobe'):
      pass
  except (netlab.NetlabError, OSError) as e:
    pytest.skip(f'network namespaces unavailable: {e}')


def _ours(tag: str) -> list:
  """Namespaces and /etc/netns folders whose names start with `tag`."""
  found = [n for n in netlab._namespaces() if n.startswith(tag)]
  if os.path.isdir('/etc/netns'):
    found += [f'/etc/netns/{n}' for n in os.listdir('/etc/netns')
              if n.startswith(tag)]
  return found


def test_refuses_without_privileges(monkeypatch, capsys):
  monkeypatch.setattr(netlab, '_effective_caps', lambda: 0)
  monkeypatch.setattr(netlab, '_tool', lambda name: name)  # iproute2 or not
  with pytest.raises(netlab.NetlabError, match='CAP_NET_ADMIN and '
                     'CAP_SYS_ADMIN.*sudo .*bench-network'):
    netlab.require_privileges()
  assert network.main(['--workers', '2']) == 2
  err = capsys.readouterr().err
  assert err.startswith('error: ') and 'Nothing was created' in err
  with pytest.raises(netlab.NetlabError, match='CAP_NET_ADMIN'):
    netlab.Cluster(2).create()  # refuses before creating anything


def test_two_workers_over_a_shaped_link(namespaces, tmp_path):
  args = network.parse_args([
      '--workers', '2', '--steps', str(STEPS), '--warmup', str(WARMUP),
      '--set', 'model.preset=llama-tiny', 'data.seq_len=32',
      '--run-dir', str(tmp_path), '--xla-flags', FAST_COMPILE,
      '--job-timeout', '120'])
  args.data_dir = network.prepare_data(args.run_dir)
  args.env = network.worker_env(args.xla_flags)
  with netlab.Cluster(2) as cluster:
    tag = cluster.tag
    assert cluster.shape(netlab.Link('test', 100.0)) is True
    job = network.run_cluster_job(cluster, 'AdamW', network.METHODS['AdamW'],
                                  'test', args, 29501)
    pids = [p.pid for p in cluster._procs]
  # Training ran across the namespaces: every step logged, the model moved.
  metrics = job['metrics']
  assert sorted(metrics) == list(range(1, STEPS + 1))
  losses = [metrics[s]['loss'] for s in sorted(metrics)]
  assert np.all(np.isfinite(losses)) and losses[-1] != losses[0], losses
  assert [q['kinds'] for q in job['qdisc']] == ['tbf', 'tbf']
  # The kernel's counts against the HLO's bytes: the dense ring all-reduce
  # and the metrics' (it follows the update: it carries the non-finite count
  # of the new parameters, so XLA cannot combine the two).
  hlo = job['hlo_bytes']
  assert hlo > 0 and [c.kind for c in job['collectives']] == ['all-reduce'] * 2
  for i, w in enumerate(job['per_worker']):
    assert FLOOR * hlo <= w['payload'] <= (1 + TOLERANCE) * hlo, (i, w, hlo)
    headers = w['tx_bytes'] - w['payload']
    assert headers == pytest.approx(netlab.HEADER_BYTES * w['tx_frames'])
    assert w['tx_frames'] >= hlo / 1448  # at most one MSS per frame
  sent = [w['tx_bytes'] for w in job['per_worker']]
  received = [w['rx_bytes'] for w in job['per_worker']]
  np.testing.assert_allclose(received, sent[::-1], rtol=0.01)  # 0 <-> 1
  # Nothing left: namespaces, their /etc/netns files, processes.
  assert not _ours(tag)
  for pid in pids:
    with pytest.raises(ProcessLookupError):
      os.kill(pid, 0)


def test_cleanup_on_exception_sigterm_and_after_sigkill(namespaces):
  with pytest.raises(RuntimeError, match='boom'):
    with netlab.Cluster(2) as cluster:
      tag = cluster.tag
      assert len(_ours(tag)) == 3 + 2  # 3 namespaces, 2 hosts folders
      # A worker has a route to the other worker and to nothing else (a
      # route lookup; nothing is sent).
      route = lambda to: subprocess.run(  # noqa: E731
          cluster.exec_argv(0, ['ip', 'route', 'get', to]),
          capture_output=True, text=True)
      assert route(cluster.address(1)).returncode == 0
      outside = route('192.0.2.1')  # TEST-NET-1
      assert outside.returncode != 0, outside.stdout
      assert 'unreachable' in outside.stderr.lower(), outside.stderr
      raise RuntimeError('boom')
  assert not _ours(tag)

  holder = (
      'import sys, time; sys.path.insert(0, sys.argv[1]); import netlab\n'
      'with netlab.signals_raise(), netlab.Cluster(2) as c:\n'
      '  print(c.tag, flush=True); time.sleep(60)\n')
  for sig in (signal.SIGTERM, signal.SIGKILL):
    proc = subprocess.Popen([sys.executable, '-c', holder, str(REPO / 'bench')],
                            stdout=subprocess.PIPE, text=True)
    tag = proc.stdout.readline().strip()
    assert tag and len(_ours(tag)) == 5, tag
    proc.send_signal(sig)
    proc.wait(timeout=30)
    if sig == signal.SIGKILL:  # the owner could not clean up: the next does
      assert len(_ours(tag)) == 5
      deadline = time.monotonic() + 10
      while not netlab.cleanup_stale() and time.monotonic() < deadline:
        time.sleep(0.1)  # until the kernel has reaped the owner
    assert not _ours(tag), (sig, _ours(tag))


# ----------------------------------------------------------------------------
# The arithmetic, without namespaces (runs everywhere).


def test_collectives_table_round_trips_through_the_log(tmp_path):
  from scape_jax import analysis
  cols = [analysis.Collective('all-gather', 'u32', 191480, 4, 1, 'ag.7'),
          analysis.Collective('all-reduce', 'f32', 198138, 4, 2, 'all-reduce')]
  log = tmp_path / 'worker0.log'
  log.write_text('[Gloo] noise\ncollectives of the train step, per device per '
                 f'step:\n{analysis.format_table(cols)}\nstep 1 | loss 5\n')
  assert runs.collective_tables(str(log)) == [(None, cols)]
  (tmp_path / 'empty.log').write_text('Traceback\n')
  with pytest.raises(ValueError, match='no collectives table'):
    runs.collective_tables(str(tmp_path / 'empty.log'))


def test_kernel_bytes_interpolate_the_counters(tmp_path):
  # Two ports; p0 sends 1000 B in 10 frames per second, p1 nothing; both
  # counters sampled at t = 0, 1, 2, 3 s.
  path = tmp_path / 'counters.txt'
  lines = ['{"devices": ["p0", "p1"], "counters": '
           '["rx_bytes", "rx_packets", "tx_bytes", "tx_packets"]}']
  for t in range(4):
    lines.append(f'{100 + t} {1000 * t} {10 * t} 0 0 0 0 {1000 * t} {10 * t}')
  path.write_text('\n'.join(lines) + '\n12 3')  # a cut last line is ignored
  got = network.kernel_bytes(str(path), 100.5, 102.5, steps=4)
  assert got[0]['tx_bytes'] == pytest.approx(500)  # 2000 B over 4 steps
  assert got[0]['tx_frames'] == pytest.approx(5)
  assert got[0]['payload'] == pytest.approx(500 - 5 * netlab.HEADER_BYTES)
  assert got[1]['tx_bytes'] == 0 and got[1]['rx_bytes'] == pytest.approx(500)
  with pytest.raises(ValueError, match='outside the samples'):
    network.kernel_bytes(str(path), 99.0, 102.0, steps=1)


def test_step_times_are_differences_of_wall_times():
  metrics = {s: {'wall_time': t} for s, t in
             [(1, 10.0), (2, 11.5), (3, 12.0), (4, 14.0), (5, 15.0)]}
  assert runs.step_times(metrics, warmup=2) == [0.5, 2.0, 1.0]
  with pytest.raises(ValueError, match='need more than --warmup 5'):
    runs.step_times(metrics, warmup=5)


def test_report_verdicts(tmp_path):
  report = importlib.import_module('network_report')
  args = network.parse_args(['--run-dir', str(tmp_path),
                             '--out', str(tmp_path / 'out')])
  from scape_jax import analysis
  dense = [analysis.Collective('all-reduce', 'f32', 1000, 4, 1, 'ar')]

  def job(step_s, hlo, payload):
    return {'step_s': step_s, 'step_s_min': step_s, 'step_s_max': step_s,
            'timed_steps': 9, 'hlo_bytes': hlo, 'final_loss': 5.0,
            'collectives': dense, 'qdisc': [{'drops': 0}] * 4,
            'per_worker': [{'tx_bytes': payload + 66, 'tx_frames': 1,
                            'payload': payload, 'rx_bytes': payload}] * 4}

  def ref(step_s):
    return {'step_s': step_s, 'step_s_min': step_s, 'step_s_max': step_s,
            'timed_steps': 9, 'final_loss': 5.0}

  probe = {'rtt_ms': 0.1, 'mbit': 95.0, 'delay_applied': False}
  results = {
      'links': {'100mbit': probe, 'unlimited': dict(probe, mbit=1e9)},
      'jobs': {('100mbit', 'AdamS'): job(10.0, 6000, 6100),
               ('100mbit', 'SCAPE d=0.01'): job(2.0, 100, 30_000),
               ('unlimited', 'SCAPE d=0.01'): job(1.5, 100, 100)},
      'reference': {'AdamS': ref(1.0), 'SCAPE d=0.01': ref(4.0)},
      'in_memory': {'SCAPE d=0.01': ref(1.2)},
      'failed': {}, 'seconds': 60.0, 'command': 'python bench/network.py'}
  rows = report.build_rows(results, args, network.PROFILES, 'AdamS')
  sparse = report._find(rows, '100mbit', 'SCAPE d=0.01')
  assert sparse['speedup_vs_baseline'] == pytest.approx(5.0)
  assert sparse['vs_nocomm'] == pytest.approx(2.0)
  text = '\n'.join(report.acceptance(rows, 'AdamS'))
  assert '5.00x per step (needs >= 4x): **met**' in text
  assert '2.00x (needs <= 1.3x): **not met**' in text
  # The parts of SCAPE's 2000 ms: 1000 + 200 (update) + 300 (gloo) + 500.
  assert ('1000 ms forward/backward' in text and '+200 ms SCAPE\'s own '
          'update' in text and '+300 ms gloo and TCP' in text and
          '+500 ms for the 100mbit link\'s rate' in text), text
  # 29.9 kB over 100 B of HLO: beyond 10% + 16 kB of framing.
  assert '**not met** (not by: SCAPE d=0.01 100mbit)' in text
  report.write(results, args, network.PROFILES, 'AdamS')
  for ext in ('csv', 'md', 'png'):
    assert (tmp_path / 'out' / f'network.{ext}').stat().st_size > 0


# ----------------------------------------------------------------------------
# DiLoCo and Pier: two-level mesh, sync intervals, per-phase model.


def test_outer_methods_split_the_workers_into_replica_groups():
  for label in ('DiLoCo', 'Pier'):
    method = network.METHODS[label]
    job = network.job_overrides(method, network.SHARED, 4, 1, 12, 'd', 'o')
    assert (job['mesh.replica'], job['mesh.data']) == (2, 2), label
    assert job['steps'] == method['steps'] and job['data.batch_size'] == 4
    one = network.job_overrides(method, network.SHARED, 1, 1, 12, 'd', 'o')
    assert (one['mesh.replica'], one['mesh.data']) == (1, 1)  # one group of 1
  plain = network.job_overrides(network.METHODS['AdamW'], network.SHARED, 4,
                                1, 12, 'd', 'o')
  assert (plain['mesh.replica'], plain['mesh.data'], plain['steps']) == (
      1, 4, 12)
  with pytest.raises(ValueError, match='3 workers do not split into '
                     'mesh.replica=2'):
    network.job_overrides(network.METHODS['DiLoCo'], network.SHARED, 3, 1,
                          12, 'd', 'o')


def _write_run(out_dir, overrides, wall, comm):
  """A run directory as the bench leaves it: its config and metrics."""
  import json
  out_dir.mkdir(parents=True, exist_ok=True)
  network.write_config(str(out_dir), overrides)
  with open(out_dir / 'metrics.jsonl', 'w') as f:
    for t in sorted(wall):
      f.write(json.dumps({'step': t, 'split': 'train', 'wall_time': wall[t],
                          'comm_bytes': comm(t), 'loss': 5.0}) + '\n')


def test_pier_window_is_whole_sync_intervals_after_the_lazy_start(tmp_path):
  # Pier as benchmarked: 21 steps, r = 3, L = floor(0.4 * 21) = 8. Inner
  # steps take 1 s, sync steps 4 s, lazy-start steps 2 s (lazy_sync 2.5 s).
  over = network.job_overrides(network.METHODS['Pier'], network.SHARED, 4,
                               1, 12, 'd', str(tmp_path))
  _write_run(tmp_path, over, {}, None)
  phases = network.step_phases(str(tmp_path))
  assert [phases[t] for t in range(1, 10)] == [
      'lazy', 'lazy', 'lazy_sync', 'lazy', 'lazy', 'lazy_sync', 'lazy',
      'switch', 'sync']
  assert [t for t in phases if phases[t] == 'sync'] == [9, 12, 15, 18, 21]
  cost = {'inner': 1.0, 'sync': 4.0, 'lazy': 2.0, 'lazy_sync': 2.5,
          'switch': 2.0}
  byte = {'inner': 100, 'sync': 300, 'lazy': 150, 'lazy_sync': 150,
          'switch': 150}
  wall, clock = {}, 1000.0
  for t in range(1, 22):
    clock += cost[phases[t]] + (7.0 if t == 9 else 0.0)  # first sync: slow
    wall[t] = clock
  _write_run(tmp_path, over, wall, lambda t: byte[phases[t]])
  job = network.summarize_job(str(tmp_path), warmup=3)
  # The window: after the first sync at/after the warm-up (t = 9), to t = 21.
  assert job['window'] == (10, 21) and job['intervals'] == 4
  assert job['timed_steps'] == 12 and job['sync_every'] == 3
  assert job['step_stat'] == 'mean'
  assert job['step_s'] == pytest.approx((8 * 1.0 + 4 * 4.0) / 12)
  assert job['phase_s'] == {'inner': 1.0, 'sync': 4.0, 'lazy': 2.0}
  assert job['lazy_steps'] == 5  # t = 4..8
  assert job['hlo_bytes'] == pytest.approx((8 * 100 + 4 * 300) / 12)
  assert job['hlo_phase_bytes'] == {'inner': 100, 'sync': 300}
  assert (job['t0'], job['t1']) == (wall[9], wall[21])
  # A plain method's run (no phases): the median, as before.
  _write_run(tmp_path / 'adamw', network.job_overrides(
      network.METHODS['AdamW'], network.SHARED, 4, 1, 12, 'd', 'o'),
             wall, lambda t: 7)
  assert network.summarize_job(str(tmp_path / 'adamw'), 3)['step_stat'] == (
      'median')


def test_collectives_tables_per_program(tmp_path):
  from scape_jax import analysis
  inner = [analysis.Collective('all-reduce', 'f32', 1000, 2, 1, 'ar')]
  sync = inner + [analysis.Collective('all-reduce', 'f32', 1000, 2, 1, 'ar.1')]
  log = tmp_path / 'worker0.log'
  log.write_text(
      'collectives of the train step (phase=sync), per device per step:\n'
      f'{analysis.format_table(sync)}\n'
      'collectives of the train step (density_level=1, phase=inner), per '
      f'device per step:\n{analysis.format_table(inner)}\nstep 1 | loss 5\n')
  assert runs.collective_tables(str(log)) == [('sync', sync),
                                               ('inner', inner)]


def test_report_of_outer_rows(tmp_path):
  report = importlib.import_module('network_report')
  args = network.parse_args(['--run-dir', str(tmp_path),
                             '--out', str(tmp_path / 'out')])
  from scape_jax import analysis
  inner = [analysis.Collective('all-reduce', 'f32', 250_000, 2, 1, 'ar')]
  sync = inner + [analysis.Collective('all-reduce', 'f32', 250_000, 2, 1,
                                      'ar.1')]

  def job(mean_s, inner_s, sync_s):
    return {'step_s': mean_s, 'step_s_min': inner_s, 'step_s_max': sync_s,
            'step_stat': 'mean', 'timed_steps': 9, 'window': (4, 12),
            'intervals': 3, 'sync_every': 3, 'lazy_steps': 0,
            'phase_s': {'inner': inner_s, 'sync': sync_s, 'lazy': math.nan},
            'phase_mean_s': {'inner': inner_s, 'sync': sync_s},
            'phase_counts': {'inner': 6, 'sync': 3},
            'hlo_bytes': 2e6, 'hlo_phase_bytes': {'inner': 1e6, 'sync': 2e6},
            'final_loss': 5.0, 'collectives': inner, 'qdisc': [{'drops': 0}],
            'phase_collectives': {'inner': inner, 'sync': sync},
            'per_worker': [{'tx_bytes': 1.34e6, 'tx_frames': 1,
                            'payload': 1.34e6, 'rx_bytes': 1}]}

  probe = {'rtt_ms': 0.0, 'mbit': 8.0, 'delay_applied': True}
  fast = {'rtt_ms': 0.0, 'mbit': 8e12, 'delay_applied': True}
  results = {
      'links': {'unlimited': fast, '100mbit': probe},
      'jobs': {('unlimited', 'DiLoCo'): job(0.2, 0.1, 0.4),
               ('100mbit', 'DiLoCo'): job(2.0, 1.1, 2.4)},
      'reference': {}, 'in_memory': {}, 'failed': {}}
  rows = report.build_rows(results, args, network.PROFILES, 'AdamS')
  slow = report._find(rows, '100mbit', 'DiLoCo')
  # 1 MB at 8 Mb/s = 1 s per inner step, 2 s per sync step, plus each
  # phase's compute from the unlimited link: (6 * 1.1 + 3 * 2.4) / 9.
  assert slow['model_comm_ms'] == pytest.approx(1e3 * 4 / 3, rel=1e-6)
  assert slow['proj_step_ms'] == pytest.approx(1e3 * (6 * 1.1 + 3 * 2.4) / 9,
                                               rel=1e-6)
  assert (slow['inner_step_ms'], slow['sync_step_ms']) == (
      pytest.approx(1100), pytest.approx(2400))
  text = report.markdown(rows, results, args, 'AdamS')
  assert '| 100mbit | DiLoCo | 2,000 † |' in text
  assert ('| 100mbit | DiLoCo | 3 | 4-12 | 3 | 2,000 | 1,100 | 2,400 |  | '
          '1,000,000 | 2,000,000 | 2,000,000 | 1,340,000 |') in text
  # Without the unlimited link's job the model is left blank.
  del results['jobs'][('unlimited', 'DiLoCo')]
  rows = report.build_rows(results, args, network.PROFILES, 'AdamS')
  assert math.isnan(report._find(rows, '100mbit', 'DiLoCo')['proj_step_ms'])


def test_run_json_keeps_the_earlier_runs(tmp_path):
  report = importlib.import_module('network_report')
  (tmp_path / 'run.json').write_text('{"seconds": 60, "command": "old"}')
  report.record_run(str(tmp_path), {'seconds': 120, 'command': 'new',
                                    'commit': 'abc1234'})
  args = network.parse_args(['--report-only', '--run-dir', str(tmp_path)])
  results = network.collect(args)
  assert (results['command'], results['earlier']) == (
      'new', [{'seconds': 60, 'command': 'old'}])
  intro = '\n'.join(report._intro(results, args, 'AdamS'))
  assert ('Command: `new` (2.0 min on' in intro and 'commit abc1234). Rows '
          'this command did not run come from earlier runs' in intro and
          '`old` (1.0 min, commit not recorded)' in intro), intro
