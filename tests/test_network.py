"""bench/network.py and bench/netlab.py, run as a user runs them: train.py
across network namespaces, and what a run's files say.

Two workers, each in its own network namespace, train llama-tiny with AdamW
for a few steps as one jax.distributed job (gloo) over links shaped to
100 Mb/s. The bytes the kernel counted on each worker's link must match the
bytes the compiled step's HLO predicts, and nothing may be left behind: not
on success, not on SIGTERM, and a SIGKILLed owner's namespaces are removed by
`netlab.py cleanup`.

These need root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2; where
namespaces cannot be created they are skipped with the reason. The refusal
without privileges is tested wherever setpriv can drop them.
"""

import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from scape_jax import analysis
from scape_jax.analysis import runs
from tests import fast_compile

REPO = pathlib.Path(__file__).resolve().parents[1]
NETLAB = str(REPO / 'bench' / 'netlab.py')
NETWORK = str(REPO / 'bench' / 'network.py')
STEPS, WARMUP = 6, 2
# Counted TCP payload vs the HLO's bytes: the acceptance's 10%, and a floor
# for the interpolation of the counters at the window's ends.
TOLERANCE, FLOOR = 0.10, 0.97
HEADER_BYTES = 66  # Ethernet 14 + IPv4 20 + TCP 20 + timestamps 12, a frame


def _run(argv, **kwargs):
  return subprocess.run([sys.executable, *argv], capture_output=True,
                        text=True, timeout=600, **kwargs)


def _namespaces() -> set:
  out = subprocess.run(['ip', 'netns', 'list'], capture_output=True,
                       text=True, check=False).stdout
  return {line.split()[0] for line in out.splitlines() if line.strip()}


def _ours(tag: str) -> list:
  """Namespaces and /etc/netns folders whose names start with `tag`."""
  found = [n for n in _namespaces() if n.startswith(tag)]
  if os.path.isdir('/etc/netns'):
    found += [f'/etc/netns/{n}' for n in os.listdir('/etc/netns')
              if n.startswith(tag)]
  return found


@pytest.fixture(scope='module')
def namespaces():
  """Skips the test, with the reason, where namespaces cannot be created."""
  held = subprocess.Popen([sys.executable, NETLAB, 'hold', '1'],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
  line = held.stdout.readline()
  if not line:
    pytest.skip(f'network namespaces unavailable: {held.stderr.read()}')
  held.send_signal(signal.SIGTERM)
  held.wait(timeout=30)


@pytest.mark.skipif(not shutil.which('setpriv'), reason='no setpriv')
def test_refuses_without_privileges(tmp_path):
  drop = ['setpriv', '--bounding-set', '-all', '--inh-caps', '-all', '--',
          sys.executable]
  for argv in ([NETWORK, '--workers', '2', '--run-dir', str(tmp_path / 'r')],
               [NETLAB, 'hold', '2']):
    proc = subprocess.run(drop + argv, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith('error: ')
    assert 'CAP_NET_ADMIN' in proc.stderr
    assert 'Nothing was created' in proc.stderr
  assert not (tmp_path / 'r').exists()


def _counted(samples: pathlib.Path, t0: float, t1: float, steps: int):
  """Per port: (bytes, frames) received per step between t0 and t1, the
  counters interpolated linearly between their samples."""
  lines = samples.read_text().splitlines()
  head = json.loads(lines[0])
  width = 1 + len(head['devices']) * len(head['counters'])
  rows = np.array([[float(v) for v in line.split()] for line in lines[1:]
                   if len(line.split()) == width])
  at = lambda t: np.array([np.interp(t, rows[:, 0], rows[:, j])  # noqa: E731
                           for j in range(1, width)])
  delta = ((at(t1) - at(t0)) / steps).reshape(len(head['devices']), -1)
  col = {c: j for j, c in enumerate(head['counters'])}
  return [(d[col['rx_bytes']], d[col['rx_packets']], d[col['tx_bytes']])
          for d in delta]


def test_two_workers_over_a_shaped_link(namespaces, tmp_path):
  before = _namespaces()
  proc = _run([NETWORK, '--workers', '2', '--profiles', '100mbit',
               '--methods', 'AdamW', '--steps', str(STEPS), '--warmup',
               str(WARMUP), '--no-reference', '--set',
               'model.preset=llama-tiny', 'data.seq_len=32', '--run-dir',
               str(tmp_path), '--out', str(tmp_path / 'out'), '--xla-flags',
               fast_compile.FLAGS, '--job-timeout', '180'])
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  job = tmp_path / '100mbit' / 'adamw'
  # Training ran across the namespaces: every step logged, the model moved.
  metrics = {}
  for line in (job / 'metrics.jsonl').read_text().splitlines():
    r = json.loads(line)
    if r['split'] == 'train':
      metrics[r['step']] = r
  assert sorted(metrics) == list(range(1, STEPS + 1))
  losses = [metrics[s]['loss'] for s in sorted(metrics)]
  assert np.all(np.isfinite(losses)) and losses[-1] != losses[0], losses
  assert all('tbf' in q['kinds'] for q in json.loads(
      (job / 'qdisc.json').read_text()))
  # The kernel's counts against the HLO's bytes: the dense ring all-reduce
  # and the metrics' (it decides whether the update runs, so XLA cannot
  # combine the two).
  hlo = metrics[STEPS]['comm_bytes']
  ((_, cols),) = runs.collective_tables(str(job / 'worker0.log'))
  assert hlo > 0 and [c.kind for c in cols] == ['all-reduce'] * 2
  assert analysis.bytes_sent(cols) == pytest.approx(hlo)
  counted = _counted(job / 'counters.txt', metrics[WARMUP]['wall_time'],
                     metrics[STEPS]['wall_time'], STEPS - WARMUP)
  for i, (sent, frames, _) in enumerate(counted):
    payload = sent - HEADER_BYTES * frames
    assert FLOOR * hlo <= payload <= (1 + TOLERANCE) * hlo, (i, payload, hlo)
    assert frames >= hlo / 1448  # at most one MSS per frame
  np.testing.assert_allclose([c[2] for c in counted],
                             [c[0] for c in counted][::-1], rtol=0.01)
  # The report says what the files say.
  with open(tmp_path / 'out' / 'network.csv') as f:
    header, row = f.readline().strip().split(','), f.readline().split(',')
  row = dict(zip(header, row))
  assert float(row['hlo_bytes']) == pytest.approx(hlo)
  assert float(row['kernel_payload_bytes']) == pytest.approx(
      np.mean([s - HEADER_BYTES * n for s, n, _ in counted]), rel=1e-6)
  assert (tmp_path / 'out' / 'network.png').stat().st_size > 0
  # Nothing left: namespaces, their /etc/netns files, processes.
  assert _namespaces() <= before
  assert not subprocess.run(['pgrep', '-f', str(tmp_path)],
                            capture_output=True).stdout


def test_cleanup_on_sigterm_and_after_sigkill(namespaces):
  for sig in (signal.SIGTERM, signal.SIGKILL):
    proc = subprocess.Popen([sys.executable, NETLAB, 'hold', '2'],
                            stdout=subprocess.PIPE, text=True)
    tag, *addresses = proc.stdout.readline().split()
    assert tag and len(_ours(tag)) == 3 + 2, tag  # 3 namespaces, 2 folders
    if sig == signal.SIGTERM:
      # A worker has a route to the other worker and to nothing else (a
      # route lookup; nothing is sent).
      def route(to):
        return subprocess.run(['ip', 'netns', 'exec', f'{tag}-w0', 'ip',
                               'route', 'get', to], capture_output=True,
                              text=True)
      assert route(addresses[1]).returncode == 0
      outside = route('192.0.2.1')  # TEST-NET-1
      assert outside.returncode != 0, outside.stdout
      assert 'unreachable' in outside.stderr.lower(), outside.stderr
    proc.send_signal(sig)
    proc.wait(timeout=30)
    if sig == signal.SIGKILL:  # the owner could not clean up: the next does
      assert len(_ours(tag)) == 5
      deadline = time.monotonic() + 10
      while _ours(tag) and time.monotonic() < deadline:
        _run([NETLAB, 'cleanup'])  # until the kernel has reaped the owner
    assert not _ours(tag), (sig, _ours(tag))


# ----------------------------------------------------------------------------
# What a run's files say (scape_jax.analysis.runs), without namespaces.


def test_collectives_tables_round_trip_through_the_log(tmp_path):
  inner = [analysis.Collective('all-gather', 'u32', 191480, 4, 1, 'ag.7'),
           analysis.Collective('all-reduce', 'f32', 198138, 4, 2, 'ar')]
  sync = inner + [analysis.Collective('all-reduce', 'f32', 1000, 2, 1, 'a1')]
  log = tmp_path / 'worker0.log'
  log.write_text(
      '[Gloo] noise\ncollectives of the train step (phase=sync), per device '
      f'per step:\n{analysis.format_table(sync)}\n'
      'collectives of the train step (density_level=1, phase=inner), per '
      f'device per step:\n{analysis.format_table(inner)}\nstep 1 | loss 5\n'
      'collectives of the train step, per device per step:\n'
      f'{analysis.format_table(inner)}\n')
  assert runs.collective_tables(str(log)) == [
      ('sync', sync), ('inner', inner), (None, inner)]
  (tmp_path / 'empty.log').write_text('Traceback\n')
  with pytest.raises(ValueError, match='no collectives table'):
    runs.collective_tables(str(tmp_path / 'empty.log'))


def test_step_times_are_differences_of_wall_times():
  metrics = {s: {'wall_time': t, 'comm_bytes': 7, 'loss': 5.0} for s, t in
             [(1, 10.0), (2, 11.5), (3, 12.0), (4, 14.0), (5, 15.0)]}
  assert runs.step_times(metrics, warmup=2) == [0.5, 2.0, 1.0]
  got = runs.summarize(metrics, 2)
  assert (got['step_s'], got['step_stat'], got['t0'], got['t1']) == (
      1.0, 'median', 11.5, 15.0)
  with pytest.raises(ValueError, match='need more than --warmup 5'):
    runs.step_times(metrics, warmup=5)


# Pier as bench/network.py runs it: 21 steps, r = 3, lazy start 0.4.
PIER = {'optimizer.name': 'pier', 'optimizer.pier.inner': 'adamw',
        'optimizer.pier.sync_every': 3, 'optimizer.pier.lazy_start': 0.4,
        'mesh.replica': 2, 'mesh.data': 2, 'steps': 21,
        'data.batch_size': 4, 'model.preset': 'llama-tiny'}
DILOCO = {'optimizer.name': 'diloco', 'optimizer.diloco.inner': 'adamw',
          'optimizer.diloco.sync_every': 3, 'mesh.replica': 2,
          'mesh.data': 2, 'steps': 12, 'data.batch_size': 4,
          'model.preset': 'llama-tiny'}


def _phases(overrides: dict) -> dict:
  """{step t: its phase}, as the trainer picks its program."""
  from scape_jax.train import config as config_lib  # pylint: disable=g-import-not-at-top
  from scape_jax.train import methods  # pylint: disable=g-import-not-at-top
  cfg = config_lib.load(None, [f'--config.{k}={v}'
                               for k, v in overrides.items()])
  method = methods.build(cfg.optimizer, cfg.steps)
  return {t: method.update_kwargs(t - 1).get('phase')
          for t in range(1, cfg.steps + 1)}


def test_pier_window_is_whole_sync_intervals_after_the_lazy_start():
  # L = floor(0.4 * 21) = 8. Inner steps take 1 s, sync steps 4 s,
  # lazy-start steps 2 s (lazy_sync 2.5 s).
  phases = _phases(PIER)
  assert [phases[t] for t in range(1, 10)] == [
      'lazy', 'lazy', 'lazy_sync', 'lazy', 'lazy', 'lazy_sync', 'lazy',
      'switch', 'sync']
  assert [t for t in phases if phases[t] == 'sync'] == [9, 12, 15, 18, 21]
  cost = {'inner': 1.0, 'sync': 4.0, 'lazy': 2.0, 'lazy_sync': 2.5,
          'switch': 2.0}
  byte = {'inner': 100, 'sync': 300, 'lazy': 150, 'lazy_sync': 150,
          'switch': 150}
  metrics, clock = {}, 1000.0
  for t in range(1, 22):
    clock += cost[phases[t]] + (7.0 if t == 9 else 0.0)  # first sync: slow
    metrics[t] = {'wall_time': clock, 'comm_bytes': byte[phases[t]],
                  'loss': 5.0}
  job = runs.summarize(metrics, 3, phases)
  # The window: after the first sync at/after the warm-up (t = 9), to t = 21.
  assert job['window'] == (10, 21) and job['intervals'] == 4
  assert job['timed_steps'] == 12 and job['sync_every'] == 3
  assert job['step_stat'] == 'mean'
  assert job['step_s'] == pytest.approx((8 * 1.0 + 4 * 4.0) / 12)
  assert job['phase_s'] == {'inner': 1.0, 'sync': 4.0, 'lazy': 2.0}
  assert job['lazy_steps'] == 5  # t = 4..8
  assert job['hlo_bytes'] == pytest.approx((8 * 100 + 4 * 300) / 12)
  assert job['hlo_phase_bytes'] == {'inner': 100, 'sync': 300}
  assert (job['t0'], job['t1']) == (metrics[9]['wall_time'],
                                    metrics[21]['wall_time'])


# ----------------------------------------------------------------------------
# bench/network.py --report-only on run directories written here as a run
# leaves them.

AR = lambda n: [analysis.Collective('all-reduce', 'f32', n, 4, 1, 'ar')]  # noqa: E731


def _write_job(out_dir, step_s, hlo=0.0, payload=None, tables=None,
               steps=6, overrides=None, workers=4):
  """metrics.jsonl (step k at wall time 100 + k * step_s, or step_s(t)),
  and for a cluster job (payload given) the counters, the collectives
  tables and the qdisc statistics; bench_config.json with `overrides`."""
  out_dir.mkdir(parents=True)
  walls, clock = {0: 100.0}, 100.0
  for t in range(1, steps + 1):
    clock += step_s(t) if callable(step_s) else step_s
    walls[t] = clock
  comm = hlo if callable(hlo) else (lambda t: hlo)
  with open(out_dir / 'metrics.jsonl', 'w') as f:
    for t in range(1, steps + 1):
      f.write(json.dumps({'step': t, 'split': 'train', 'wall_time': walls[t],
                          'comm_bytes': comm(t), 'loss': 5.0}) + '\n')
  if overrides:
    (out_dir / 'bench_config.json').write_text(json.dumps(overrides))
  if payload is None:
    return
  # One frame per step: the port's counters grow by payload + headers.
  lines = [json.dumps({'devices': [f'p{i}' for i in range(workers)],
                       'counters': ['rx_bytes', 'rx_packets', 'tx_bytes',
                                    'tx_packets']})]
  for t, wall in walls.items():
    lines.append(f'{wall} ' + ' '.join(
        [f'{int((payload + HEADER_BYTES) * t)} {t}'] * 2 * workers))
  (out_dir / 'counters.txt').write_text('\n'.join(lines) + '\n')
  (out_dir / 'worker0.log').write_text(''.join(
      f'collectives of the train step{f" (phase={p})" if p else ""}, per '
      f'device per step:\n{analysis.format_table(cols)}\n'
      for p, cols in tables))
  (out_dir / 'qdisc.json').write_text(json.dumps(
      [{'drops': 0, 'overlimits': 0, 'kinds': 'tbf'}] * workers))


def _report(run_dir, *argv):
  """Runs the report; returns (network.md, {(link, method): CSV row})."""
  proc = _run([NETWORK, '--report-only', '--run-dir', str(run_dir), '--out',
               str(run_dir / 'out'), '--workers', '4', *argv])
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  with open(run_dir / 'out' / 'network.csv') as f:
    header = f.readline().strip().split(',')
    rows = [dict(zip(header, line.strip().split(','))) for line in f]
  return ((run_dir / 'out' / 'network.md').read_text(),
          {(r['link'], r['method']): r for r in rows})


def test_report_verdicts_and_earlier_runs(tmp_path):
  probe = {'rtt_ms': 0.1, 'mbit': 95.0, 'delay_applied': False}
  for link, mbit in (('100mbit', 95.0), ('unlimited', 1e9)):
    (tmp_path / link).mkdir()
    (tmp_path / link / 'link.json').write_text(json.dumps(
        dict(probe, mbit=mbit)))
  for link, slug, step_s, hlo, payload in (
      ('100mbit', 'adams', 10.0, 6000, 6100),
      ('100mbit', 'scape_d0p01', 2.0, 100, 30_000),
      ('unlimited', 'scape_d0p01', 1.5, 100, 100)):
    _write_job(tmp_path / link / slug, step_s, hlo, payload,
               [(None, AR(1000))])
  for kind, slug, step_s in (('reference', 'adams', 1.0),
                             ('reference', 'scape_d0p01', 4.0),
                             ('in_memory', 'scape_d0p01', 1.25)):
    _write_job(tmp_path / kind / slug / 'copy0', step_s)
  (tmp_path / 'run.json').write_text(json.dumps({
      'seconds': 120, 'command': 'new', 'commit': 'abc1234',
      'earlier': [{'seconds': 60, 'command': 'old'}]}))
  text, rows = _report(tmp_path, '--methods', 'AdamS', 'SCAPE d=0.01',
                       '--profiles', '100mbit', 'unlimited', '--steps', '6',
                       '--warmup', '2')
  sparse = rows['100mbit', 'SCAPE d=0.01']
  assert float(sparse['speedup_vs_baseline']) == pytest.approx(5.0)
  assert float(sparse['vs_nocomm']) == pytest.approx(2.0)
  assert float(sparse['kernel_payload_bytes']) == pytest.approx(30_000)
  assert float(rows['100mbit', 'AdamS']['payload_vs_hlo']) == pytest.approx(
      100 / 6000)
  assert '5.00x per step (needs >= 4x): **met**' in text
  assert '2.00x (needs <= 1.3x): **not met**' in text
  # The parts of SCAPE's 2000 ms: 1000 + 250 (update) + 250 (gloo) + 500.
  assert ('1000 ms forward/backward' in text and '+250 ms SCAPE\'s own '
          'update' in text and '+250 ms gloo and TCP' in text and
          '+500 ms for the 100mbit link\'s rate' in text), text
  # 29.9 kB over 100 B of HLO: beyond 10% + 16 kB of framing.
  assert '**not met** (not by: SCAPE d=0.01 100mbit)' in text
  assert ('Command: `new` (2.0 min on' in text and 'commit abc1234). Rows '
          'this command did not run come from earlier runs' in text and
          '`old` (1.0 min, commit not recorded)' in text), text
  for ext in ('csv', 'md', 'png'):
    assert (tmp_path / 'out' / f'network.{ext}').stat().st_size > 0


def test_report_of_outer_rows(tmp_path):
  """DiLoCo 2 x 2 with r = 3 over 12 steps: sync steps 3, 6, 9 and 12."""
  phases = _phases(DILOCO)
  assert [t for t in phases if phases[t] == 'sync'] == [3, 6, 9, 12]
  inner = [analysis.Collective('all-reduce', 'f32', 250_000, 2, 1, 'ar')]
  sync = inner + [analysis.Collective('all-reduce', 'f32', 250_000, 2, 1,
                                      'ar.1')]
  byte = lambda t: 2e6 if phases[t] == 'sync' else 1e6  # noqa: E731
  for link, mbit, times in (('unlimited', 8e12, (0.1, 0.4)),
                            ('100mbit', 8.0, (1.1, 2.4))):
    (tmp_path / link).mkdir()
    (tmp_path / link / 'link.json').write_text(json.dumps(
        {'rtt_ms': 0.0, 'mbit': mbit, 'delay_applied': True}))
    _write_job(tmp_path / link / 'diloco',
               lambda t, s=times: s[phases[t] == 'sync'], byte, 1.34e6,
               [('sync', sync), ('inner', inner)], 12, DILOCO)
  args = ['--methods', 'DiLoCo', '--steps', '12', '--warmup', '3']
  text, rows = _report(tmp_path, '--profiles', 'unlimited', '100mbit', *args)
  slow = rows['100mbit', 'DiLoCo']
  # 1 MB at 8 Mb/s = 1 s per inner step, 2 s per sync step, plus each
  # phase's compute from the unlimited link: (6 * 1.1 + 3 * 2.4) / 9.
  mean_ms = 1e3 * (6 * 1.1 + 3 * 2.4) / 9
  assert float(slow['step_ms']) == pytest.approx(mean_ms)
  assert float(slow['model_comm_ms']) == pytest.approx(1e3 * 4 / 3, rel=1e-6)
  assert float(slow['proj_step_ms']) == pytest.approx(mean_ms, rel=1e-6)
  assert (float(slow['inner_step_ms']), float(slow['sync_step_ms'])) == (
      pytest.approx(1100), pytest.approx(2400))
  assert f'| 100mbit | DiLoCo | {mean_ms:,.0f} † |' in text
  assert (f'| 100mbit | DiLoCo | 3 | 4-12 | 3 | {mean_ms:,.0f} | 1,100 | '
          '2,400 |  | 1,000,000 | 2,000,000 | 1,333,333 | 1,340,000 |') in text
  # Without the unlimited link's job the model is left blank.
  _, rows = _report(tmp_path, '--profiles', '100mbit', *args)
  assert math.isnan(float(rows['100mbit', 'DiLoCo']['proj_step_ms']))
