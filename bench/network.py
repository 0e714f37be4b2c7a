"""Step time over real, rate-limited links: train.py as N processes in N
network namespaces, bytes counted by the kernel.

  sudo python bench/network.py                        # all methods and links
  sudo python bench/network.py --profiles 100mbit --methods AdamS 'SCAPE d=0.01'

What runs (bench/netlab.py builds the network):
* N worker namespaces (default 4) joined by veth pairs to a bridge inside a
  namespace of its own, addresses 10.200.0.10+i; every link shaped with tbf
  per direction, plus netem delay where the kernel has it. Profiles:
  unlimited, 1 Gb/s + 0.5 ms, 100 Mb/s + 1 ms.
* One `jax.distributed` job per (method, link): `train.py --coordinator
  10.200.0.10:PORT --num-processes N --process-id i` in namespace i, one CPU
  device per process, gloo collectives. Same model (`llama20m`, 19.1M
  parameters, fp32), data (a synthetic corpus) and per-worker batch for every
  method; only the `optimizer.*` lines of `METHODS` differ (DiLoCo, Pier:
  also the mesh and the number of steps, see `METHODS`).
* The no-communication reference: the same method, the same per-worker batch,
  N=1, run as N independent single-process copies at once (one per
  namespace), so that each copy gets the same share of this machine's cores
  as a worker of the N-process job. And the N-worker step without a network:
  one process with N simulated CPU devices, collectives in memory, the same
  per-worker work (SCAPE's top-k over 1/N of each leaf) as the job. DiLoCo
  and Pier: N=1 is one group of one worker (every phase runs, with no
  communication); in memory uses the job's mesh (2 groups x N/2 devices).

What is measured, per (method, link):
* the median step time over the steps after `--warmup`, from the
  `wall_time` the trainer logs when each step's metrics arrive (log_every=1);
  DiLoCo and Pier (sync steps are periodic spikes): the MEAN over whole
  sync intervals, beside each phase's median (`scape_jax.analysis.runs`);
* bytes each worker sent per step, from the kernel's counters of its link
  (the bridge port's rx counters = the worker's eth0 tx counters), polled
  every 10 ms and interpolated at the first and last timed step; the TCP
  payload is those bytes minus `netlab.HEADER_BYTES` per frame;
* beside them, the bytes the compiled step's HLO predicts (the trainer's
  `comm_bytes`; DiLoCo, Pier: amortised over r), and the alpha-beta
  projection (bench/projected_step_time.py) for this link: the HLO's
  collectives (per program), the link's measured round-trip time and bulk
  goodput, and the reference step as compute.

Every job leaves its raw measurements under `--run-dir` (metrics.jsonl,
counters.txt, worker logs, qdisc.json; link.json per link), and the report
is computed from those files: `--report-only` rewrites it without running
anything (and without root).

Writes `--out`/network.{csv,md,png} (default docs/bench/). Needs root (or
CAP_NET_ADMIN + CAP_SYS_ADMIN); refuses to start otherwise. Everything it
creates is removed on success, failure, Ctrl-C or SIGTERM; leftovers of a
SIGKILLed run are removed by the next run (or `python bench/netlab.py
cleanup`). It sends nothing outside the 10.200.0.0/24 network it creates.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [p for p in (ROOT, os.path.join(ROOT, 'bench'))
                if p not in sys.path]

import cli_types  # noqa: E402  pylint: disable=g-import-not-at-top
import netlab  # noqa: E402  pylint: disable=g-import-not-at-top
import network_report  # noqa: E402  pylint: disable=g-import-not-at-top
from scape_jax.analysis import runs  # noqa: E402  pylint: disable=g-import-not-at-top

TRAIN = os.path.join(ROOT, 'train.py')

# label -> the config lines that select the method (a method added to the
# registry is benchmarked by adding one line). DiLoCo and Pier: 2 replica
# groups of N/2 workers, AdamW inside, a sync every r = 3 steps (the 3-step
# warm-up ends with one); DiLoCo 12 steps (3 whole intervals timed), Pier 21
# with lazy_start=0.4: 8 lazy-start steps (5 timed), a sync, 4 intervals.
OUTER_SYNC_EVERY = 3
METHODS = {
    'AdamW': {'optimizer.name': 'adamw'},
    'AdamS': {'optimizer.name': 'adams'},
    'SCAPE d=0.1': {'optimizer.name': 'scape', 'optimizer.scape.density': 0.1},
    'SCAPE d=0.01': {'optimizer.name': 'scape',
                     'optimizer.scape.density': 0.01},
    'DiLoCo': {'optimizer.name': 'diloco', 'optimizer.diloco.inner': 'adamw',
               'optimizer.diloco.sync_every': OUTER_SYNC_EVERY,
               'mesh.replica': 2, 'steps': 12},
    'Pier': {'optimizer.name': 'pier', 'optimizer.pier.inner': 'adamw',
             'optimizer.pier.sync_every': OUTER_SYNC_EVERY,
             'optimizer.pier.lazy_start': 0.4, 'mesh.replica': 2,
             'steps': 21},
}
BASELINE = 'AdamS'  # speed-ups are relative to this method on the same link

PROFILES = {p.name: p for p in (
    netlab.Link('unlimited', None, 0.0),
    netlab.Link('1gbit', 1000.0, 0.5),
    netlab.Link('100mbit', 100.0, 1.0),
)}

# The run every method shares (overridable with --set KEY=VALUE).
SHARED = {
    'model.preset': 'llama20m',
    'model.dtype': 'float32',
    'data.seq_len': 128,
    'optimizer.lr': 1e-3,
    'optimizer.warmup_steps': 2,
    'log_every': 1,  # every step's metrics and wall_time
    'eval_every': 0,  # one evaluation, after the last step
    'eval_batches': 1,
    'seed': 0,
}
SAMPLE_INTERVAL_S = 0.01  # counters polled 100 times a second (~1% of a core)
_CLUSTER_VARS = ('SLURM_NTASKS', 'OMPI_COMM_WORLD_SIZE')


# ----------------------------------------------------------------------------
# Reading back what a job measured, from its directory: metrics.jsonl, the
# collectives tables process 0 printed, the kernel's counters.

CONFIG_FILE = 'bench_config.json'  # the config lines a run was started with


def write_config(out_dir: str, overrides: dict) -> None:
  with open(os.path.join(out_dir, CONFIG_FILE), 'w') as f:
    json.dump(overrides, f, indent=1)


def step_phases(out_dir: str) -> dict:
  """{step t: the phase of its update} of the run in `out_dir`, as the
  trainer picks its program (`Method.update_kwargs(t - 1)['phase']` of the
  run's config); {} for a method without phases or no bench_config.json."""
  path = os.path.join(out_dir, CONFIG_FILE)
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    overrides = json.load(f)
  from scape_jax.train import config as config_lib  # pylint: disable=g-import-not-at-top
  from scape_jax.train import methods  # pylint: disable=g-import-not-at-top
  cfg = config_lib.load(None, config_args(overrides))
  method = methods.build(cfg.optimizer, cfg.steps)
  phases = {t: method.update_kwargs(t - 1).get('phase')
            for t in range(1, cfg.steps + 1)}
  return phases if any(phases.values()) else {}


def summarize_job(out_dir: str, warmup: int) -> dict:
  """`runs.summarize` of one run's metrics.jsonl and phases."""
  from scape_jax.train import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  metrics = {r['step']: r for r in metrics_lib.read_jsonl(
      os.path.join(out_dir, 'metrics.jsonl')) if r['split'] == 'train'}
  return runs.summarize(metrics, warmup, step_phases(out_dir))


def kernel_bytes(samples_path: str, t0: float, t1: float, steps: int) -> list:
  """Per worker, per step between wall times t0 and t1, as the kernel
  counted them (the port's rx = what the worker sent)."""
  times, values = netlab.read_samples(samples_path)
  delta = (netlab.counters_at(times, values, t1) -
           netlab.counters_at(times, values, t0)) / steps
  col = {c: j for j, c in enumerate(netlab.COUNTERS)}
  return [{'tx_bytes': d[col['rx_bytes']], 'tx_frames': d[col['rx_packets']],
           'payload': d[col['rx_bytes']] - netlab.HEADER_BYTES * d[
               col['rx_packets']], 'rx_bytes': d[col['tx_bytes']]}
          for d in delta]


def read_job(out_dir: str, warmup: int) -> dict:
  """Everything a cluster job measured, read back from its directory."""
  job = summarize_job(out_dir, warmup)
  job['per_worker'] = kernel_bytes(os.path.join(out_dir, 'counters.txt'),
                                   job['t0'], job['t1'], job['timed_steps'])
  tables = runs.collective_tables(os.path.join(out_dir, 'worker0.log'))
  job['collectives'] = tables[0][1]
  job['phase_collectives'] = {phase: cols for phase, cols in tables if phase}
  with open(os.path.join(out_dir, 'qdisc.json')) as f:
    job['qdisc'] = json.load(f)
  return job


def read_reference(root: str, warmup: int) -> dict:
  """The median over the N=1 copies of their step."""
  return runs.median_of_copies([
      summarize_job(os.path.join(root, d), warmup)
      for d in sorted(os.listdir(root)) if d.startswith('copy')])


# ----------------------------------------------------------------------------
# Launching train.py.


def worker_env(xla_flags: str = '') -> dict:
  """The caller's environment without JAX/XLA/cluster settings, plus ours.

  No persistent compilation cache: its keys differ per process, so only
  process 0 would skip compiling, reach the first collective tens of seconds
  ahead of the others and fail gloo's 30 s context set-up.
  """
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(('JAX_', 'XLA_')) and k not in _CLUSTER_VARS}
  env.update(JAX_PLATFORMS='cpu', PYTHONUNBUFFERED='1',
             PYTHONPATH=os.pathsep.join(
                 [ROOT] + ([env['PYTHONPATH']] if env.get('PYTHONPATH')
                           else [])))
  if xla_flags:
    env['XLA_FLAGS'] = xla_flags
  return env


def config_args(overrides: dict) -> list:
  return [f'--config.{k}={v}' for k, v in overrides.items()]


def job_overrides(method: dict, shared: dict, workers: int, batch: int,
                  steps: int, data_dir: str, out_dir: str) -> dict:
  """The config lines of one run. A method's own `steps` replaces `steps`;
  its `mesh.replica` groups split the workers (N=1: one group of one)."""
  replica = int(method.get('mesh.replica', 1)) if workers > 1 else 1
  if workers % replica:
    raise ValueError(f'{workers} workers do not split into mesh.replica='
                     f'{replica} groups')
  return {**shared, 'steps': steps, **method, 'data.corpus': data_dir,
          'data.batch_size': batch * workers, 'mesh.replica': replica,
          'mesh.data': workers // replica, 'out_dir': out_dir}


def _raised(log: str) -> bool:
  """Whether a worker's log shows a Python traceback (it may still be alive,
  waiting minutes at jax.distributed's shutdown barrier)."""
  with open(log, 'rb') as f:
    return b'Traceback (most recent call last)' in f.read()


def _wait(procs: list, logs: list, timeout_s: float) -> Optional[str]:
  """None once all exit 0; else what went wrong (first failure, timeout)."""
  deadline = time.monotonic() + timeout_s
  polls = 0
  while any(p.poll() is None for p in procs):
    failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
    if failed:
      return f'process {failed[0]} exited {procs[failed[0]].returncode}'
    polls += 1
    if polls % 50 == 0 and (raised := [i for i, log in enumerate(logs)
                                       if _raised(log)]):
      return f'process {raised[0]} raised an exception'
    if time.monotonic() > deadline:
      return f'timed out after {timeout_s:.0f} s'
    time.sleep(0.1)
  bad = [p.returncode for p in procs if p.returncode]
  return f'exit codes {[p.returncode for p in procs]}' if bad else None


def _tail(path: str, chars: int = 4000) -> str:
  with open(path, errors='replace') as f:
    return f.read()[-chars:]


class JobError(RuntimeError):
  """A train.py process failed or timed out; carries the logs' tails."""


def launch(cluster: netlab.Cluster, overrides: list, out_dirs: list,
           env: dict, timeout_s: float, coordinator: Optional[str]) -> list:
  """Runs train.py once per worker (one job, or independent copies if
  `coordinator` is None) and waits; returns the log paths."""
  n = len(overrides)
  procs, logs, files = [], [], []
  try:
    for i in range(n):
      os.makedirs(out_dirs[i], exist_ok=True)
      write_config(out_dirs[i], overrides[i])
      logs.append(os.path.join(out_dirs[i], f'worker{i}.log'))
      files.append(open(logs[-1], 'wb'))  # pylint: disable=consider-using-with
      dist = [] if coordinator is None else [
          '--coordinator', coordinator, '--num-processes', str(n),
          '--process-id', str(i)]
      procs.append(cluster.popen(
          i, [sys.executable, TRAIN, *dist, *config_args(overrides[i])],
          env=env, cwd=ROOT, stdout=files[-1], stderr=subprocess.STDOUT))
    problem = _wait(procs, logs, timeout_s)
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    for f in files:
      f.close()
  if problem:
    raise JobError(f'{problem}\n' + '\n'.join(
        f'--- worker {i} ({path}):\n{_tail(path)}'
        for i, path in enumerate(logs)))
  return logs


# ----------------------------------------------------------------------------
# One job per (method, link), and the N=1 reference. Each leaves its raw
# measurements in its directory under --run-dir; `collect` reads them back.


def _timeout(args) -> float:
  """Seconds a job may take: --job-timeout, within what --max-minutes leaves."""
  left = args.max_minutes * 60 - (time.monotonic() - args.start)
  if left < 60:
    raise JobError(f'skipped: --max-minutes {args.max_minutes:g} reached')
  return min(args.job_timeout, left)


def _job_dir(args, link_name: str, label: str) -> str:
  return os.path.join(args.run_dir, link_name, _slug(label))


def _reference_dir(args, label: str) -> str:
  return os.path.join(args.run_dir, 'reference', _slug(label))


def run_cluster_job(cluster: netlab.Cluster, label: str, method: dict,
                    link_name: str, args, port: int) -> dict:
  """Trains `method` as one N-process job over the cluster's current links."""
  n = cluster.n
  out_dir = _job_dir(args, link_name, label)
  shutil.rmtree(out_dir, ignore_errors=True)
  os.makedirs(out_dir)
  over = job_overrides(method, args.shared, n, args.per_worker_batch,
                       args.steps, args.data_dir, out_dir)
  sampler = cluster.start_sampler(os.path.join(out_dir, 'counters.txt'),
                                  SAMPLE_INTERVAL_S)
  try:
    launch(cluster, [over] * n, [out_dir] * n, args.env, _timeout(args),
           f'{cluster.address(0)}:{port}')
  except JobError as e:
    with open(os.path.join(out_dir, 'FAILED'), 'w') as f:
      f.write(str(e))
    raise
  finally:
    os.killpg(sampler.pid, signal.SIGTERM)
    sampler.wait(timeout=10)
    shutil.rmtree(os.path.join(out_dir, 'ckpt'), ignore_errors=True)
  with open(os.path.join(out_dir, 'qdisc.json'), 'w') as f:
    json.dump(cluster.qdisc_stats(), f)
  return read_job(out_dir, args.warmup)


def run_reference(cluster: netlab.Cluster, label: str, method: dict,
                  args) -> dict:
  """N independent N=1 runs at once: the step without communication."""
  root = _reference_dir(args, label)
  shutil.rmtree(root, ignore_errors=True)
  dirs = [os.path.join(root, f'copy{i}') for i in range(cluster.n)]
  over = [job_overrides(method, args.shared, 1, args.per_worker_batch,
                        args.steps, args.data_dir, d) for d in dirs]
  try:
    launch(cluster, over, dirs, args.env, _timeout(args), None)
  finally:
    for d in dirs:
      shutil.rmtree(os.path.join(d, 'ckpt'), ignore_errors=True)
  return read_reference(root, args.warmup)


def run_in_memory(cluster: netlab.Cluster, label: str, method: dict,
                  args) -> dict:
  """The N-worker step with no network: one process, N simulated CPU
  devices, the collectives in memory. Same per-worker work as the job."""
  root = _in_memory_dir(args, label)
  shutil.rmtree(root, ignore_errors=True)
  out_dir = os.path.join(root, 'copy0')
  over = job_overrides(method, args.shared, cluster.n, args.per_worker_batch,
                       args.steps, args.data_dir, out_dir)
  env = dict(args.env, XLA_FLAGS=(
      f'{args.env.get("XLA_FLAGS", "")} '
      f'--xla_force_host_platform_device_count={cluster.n}').strip())
  try:
    launch(cluster, [over], [out_dir], env, _timeout(args), None)
  finally:
    shutil.rmtree(os.path.join(out_dir, 'ckpt'), ignore_errors=True)
  return read_reference(root, args.warmup)


def _in_memory_dir(args, label: str) -> str:
  return os.path.join(args.run_dir, 'in_memory', _slug(label))


def _slug(label: str) -> str:
  return label.lower().replace(' ', '_').replace('=', '').replace('.', 'p')


# ----------------------------------------------------------------------------
# Rows, projection, outputs (in bench/network_report.py).


def parse_args(argv=None):
  p = argparse.ArgumentParser(
      description=__doc__.split('\n\n')[0],
      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
  p.add_argument('--workers', type=cli_types.positive_int, default=4,
                 help='processes, one namespace each (>= 2)')
  p.add_argument('--profiles', nargs='+', default=list(PROFILES),
                 choices=list(PROFILES))
  p.add_argument('--methods', nargs='+', default=list(METHODS),
                 choices=list(METHODS))
  p.add_argument('--per-worker-batch', type=cli_types.positive_int,
                 default=1, help='sequences per worker per step (seq_len 128)')
  p.add_argument('--steps', type=cli_types.positive_int, default=12)
  p.add_argument('--warmup', type=cli_types.non_negative_int, default=3,
                 help='steps left out of the timing and the byte count')
  p.add_argument('--set', nargs='*', default=[], metavar='KEY=VALUE',
                 help='change a shared config key for every run')
  p.add_argument('--no-reference', action='store_true',
                 help='skip the N=1 and the in-memory runs')
  p.add_argument('--require-delay', action='store_true',
                 help='stop if the kernel cannot add the links\' delay '
                 '(no sch_netem) instead of running rate-only')
  p.add_argument('--job-timeout', type=cli_types.positive_float,
                 default=900.0,
                 help='seconds per job before it is killed')
  p.add_argument('--max-minutes', type=cli_types.positive_float,
                 default=75.0,
                 help='the whole run\'s limit: a job is cut at it, later ones '
                 'are skipped and reported as such')
  p.add_argument('--run-dir', default=os.path.join(ROOT, 'runs', 'network'))
  p.add_argument('--out', default=os.path.join(ROOT, 'docs', 'bench'))
  p.add_argument('--xla-flags', default='', help='XLA_FLAGS for the workers')
  p.add_argument('--report-only', action='store_true',
                 help='rewrite the report from the files in --run-dir '
                 '(no root needed)')
  args = p.parse_args(argv)
  if args.workers < 2:
    p.error(f'--workers {args.workers}: at least 2 (the N=1 reference runs '
            'anyway, unless --no-reference)')
  if args.steps <= args.warmup + 1:
    p.error(f'--steps {args.steps} must exceed --warmup {args.warmup} + 1')
  args.start = time.monotonic()  # --max-minutes counts from here
  args.shared = dict(SHARED)
  for item in args.set:
    key, sep, value = item.partition('=')
    if not sep:
      p.error(f'--set {item!r}: expected KEY=VALUE')
    args.shared[key] = value
  if not args.report_only:
    _check_configs(p, args)
  return args


def _check_configs(p, args) -> None:
  """Usage errors for a --set key or a worker count that a job's config
  would refuse, before any namespace is built."""
  from scape_jax.train import config as config_lib  # pylint: disable=g-import-not-at-top
  for label in args.methods:
    try:
      config_lib.load(None, config_args(job_overrides(
          METHODS[label], args.shared, args.workers, args.per_worker_batch,
          args.steps, 'data', 'out')))
    except ValueError as e:  # ConfigError included
      p.error(f'{label}: {e}')


def prepare_data(run_dir: str) -> str:
  """A synthetic corpus, prepared once before any job (so nothing races)."""
  from scape_jax.data import prepare  # pylint: disable=g-import-not-at-top
  path = os.path.join(run_dir, 'data')
  if not os.path.exists(os.path.join(path, 'meta.json')):
    prepare.make_synthetic_corpus(path, num_tokens=1 << 20)
  return path


def run_all(args) -> None:
  """Runs every reference and (link, method) job; each writes its files."""
  with netlab.Cluster(args.workers) as cluster:
    if not cluster.netem:
      msg = ('this kernel has no sch_netem (CONFIG_NET_SCH_NETEM): links get '
             'their rate limit but not their delay.')
      if args.require_delay and any(PROFILES[p].delay_ms for p in
                                    args.profiles):
        raise netlab.NetlabError(msg + ' (--require-delay)')
      print(f'warning: {msg}', flush=True)
    port = 29500
    if not args.no_reference:
      cluster.shape(PROFILES['unlimited'])
      for label in args.methods:
        for kind, run in (('N=1', run_reference), ('in memory', run_in_memory)):
          t = time.monotonic()
          try:
            ref = run(cluster, label, METHODS[label], args)
          except JobError as e:
            print(f'[{kind}] {label} FAILED: {e}', flush=True)
            continue
          print(f'[{kind}] {label}: step {1e3 * ref["step_s"]:.0f} ms; '
                f'{time.monotonic() - t:.0f} s', flush=True)
    for name in args.profiles:
      link = PROFILES[name]
      applied = cluster.shape(link)  # before the probe, which measures it
      probe = dict(netlab.probe_link(cluster), delay_applied=applied)
      os.makedirs(os.path.join(args.run_dir, name), exist_ok=True)
      with open(os.path.join(args.run_dir, name, 'link.json'), 'w') as f:
        json.dump(probe, f)
      print(f'[{link}] rtt {probe["rtt_ms"]:.3f} ms, goodput '
            f'{probe["mbit"]:.0f} Mb/s, delay applied: '
            f'{probe["delay_applied"]}', flush=True)
      for label in args.methods:
        port += 1
        t = time.monotonic()
        try:
          job = run_cluster_job(cluster, label, METHODS[label], name, args,
                                port)
        except JobError as e:  # recorded in its directory; go on
          print(f'[{link}] {label} FAILED: {e}', flush=True)
          continue
        print(f'[{link}] {label}: step {1e3 * job["step_s"]:.0f} ms, '
              f'{job["hlo_bytes"] / 1e6:.3f} MB/step HLO, '
              f'{job["per_worker"][0]["payload"] / 1e6:.3f} MB/step counted '
              f'(worker 0); {time.monotonic() - t:.0f} s', flush=True)


def collect(args) -> dict:
  """The measurements of the selected links and methods, from --run-dir."""
  results = {'links': {}, 'jobs': {}, 'reference': {}, 'in_memory': {},
             'failed': {}}
  for label in args.methods:
    for key, root, name in (
        ('reference', _reference_dir(args, label), network_report.REFERENCE),
        ('in_memory', _in_memory_dir(args, label), network_report.IN_MEMORY)):
      if os.path.isdir(root) and not args.no_reference:
        try:
          results[key][label] = read_reference(root, args.warmup)
        except (OSError, ValueError, KeyError) as e:
          results['failed'][(name, label)] = f'unreadable: {e!r}'
  for name in args.profiles:
    path = os.path.join(args.run_dir, name, 'link.json')
    if not os.path.exists(path):
      continue
    with open(path) as f:
      results['links'][name] = json.load(f)
    for label in args.methods:
      out_dir = _job_dir(args, name, label)
      if os.path.exists(os.path.join(out_dir, 'FAILED')):
        with open(os.path.join(out_dir, 'FAILED')) as f:
          results['failed'][(name, label)] = f.read()
      elif os.path.exists(os.path.join(out_dir, 'qdisc.json')):
        try:
          results['jobs'][(name, label)] = read_job(out_dir, args.warmup)
        except (OSError, ValueError, KeyError) as e:
          results['failed'][(name, label)] = f'unreadable: {e!r}'
  path = os.path.join(args.run_dir, 'run.json')
  if os.path.exists(path):
    with open(path) as f:
      results.update(json.load(f))
  return results


def main(argv=None) -> int:
  args = parse_args(argv)
  command = ' '.join(['python bench/network.py'] + (
      sys.argv[1:] if argv is None else list(argv)))
  if not args.report_only:
    try:
      netlab.require_privileges()
    except netlab.NetlabError as e:
      print(f'error: {e}', file=sys.stderr)
      return 2
    os.makedirs(args.run_dir, exist_ok=True)
    args.data_dir = prepare_data(args.run_dir)
    args.env = worker_env(args.xla_flags)
    start = args.start
    with netlab.signals_raise():
      try:
        run_all(args)
      except netlab.NetlabError as e:
        print(f'error: {e}', file=sys.stderr)
        return 1
      except KeyboardInterrupt as e:
        print(f'interrupted ({e or "SIGINT"}); cleaned up', file=sys.stderr)
        return 130
    network_report.record_run(args.run_dir, {
        'seconds': time.monotonic() - start, 'command': command,
        'commit': network_report.commit(ROOT)})
  results = collect(args)
  if not results['jobs'] and not results['reference']:
    print(f'error: no measurements in {args.run_dir}', file=sys.stderr)
    return 1
  network_report.write(results, args, PROFILES, BASELINE)
  return 1 if results['failed'] else 0


if __name__ == '__main__':
  sys.exit(main())
