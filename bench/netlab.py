"""A small cluster of network namespaces on one machine, with shaped links.

Used by bench/network.py and tests/test_network.py. Topology, for N workers
(every name carries a prefix and the owner's pid, `scapenet-<pid>-...`)::

    <tag>-br     a bridge `br0` with one port `p<i>` per worker, no address
    <tag>-w<i>   worker i: `eth0`, the veth peer of p<i>, 10.200.0.(10+i)/24

A packet from worker i to worker j goes eth0(i) -> p<i> -> br0 -> p<j> ->
eth0(j). The root namespace has no interface in this network and the workers
have no default route, so nothing a worker sends can leave the cluster: any
address outside 10.200.0.0/24 is unreachable from inside it. IPv6 is disabled
in every namespace, so the kernel sends no router or multicast chatter.

Shaping, per worker link and per direction: `tbf` at the link's rate on eth0
(uplink) and on p<i> (downlink). The link's delay is a `netem` qdisc in front
of the uplink's tbf, so the one-way latency between two workers is the delay
plus serialization. Kernels built without sch_netem (CONFIG_NET_SCH_NETEM)
cannot add delay; `Cluster.shape` then shapes the rate only and reports
`delay_applied=False`, and the caller decides.

Bytes are counted by the kernel: `p<i>`'s rx counters in the bridge namespace
(/sys/class/net/p<i>/statistics) count what worker i put on its link after
its uplink qdisc, i.e. what `eth0`'s tx counters report inside worker i.
`sample` polls them into a file with timestamps.

Cleanup: `Cluster` is a context manager. Leaving it (normally, on an
exception, or on SIGINT/SIGTERM turned into an exception by the caller) kills
the processes it started, deletes its namespaces (which deletes their veths,
the bridge and the qdiscs) and removes /etc/netns/<name>. A cluster left by a
killed run (its owner pid is gone) is removed by `cleanup_stale()`, which
every new cluster calls first; `python bench/netlab.py cleanup` does it by hand.

  python bench/netlab.py cleanup             # remove leftovers of killed runs
  python bench/netlab.py hold 2              # a cluster to look at, until
                                             # Ctrl-C or SIGTERM
"""

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cli_types  # noqa: E402  pylint: disable=g-import-not-at-top

PREFIX = 'scapenet'
SUBNET = '10.200.0'  # a private test range; worker i is SUBNET.(HOST0 + i)
HOST0 = 10
MAX_WORKERS = 64
# Bytes of headers per frame below the TCP payload: Ethernet 14 + IPv4 20 +
# TCP 20 + the timestamps option 12 (Linux's default). A GSO frame carries
# one set for many segments, and so counts once, as the kernel counts it.
HEADER_BYTES = 66
TBF_LATENCY_MS = 50  # the tbf queue holds this long at the link's rate
COUNTERS = ('rx_bytes', 'rx_packets', 'tx_bytes', 'tx_packets')
_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21
_CMD_TIMEOUT_S = 30


class NetlabError(RuntimeError):
  """Missing privileges or tools, or an `ip`/`tc` command that failed."""


@dataclasses.dataclass(frozen=True)
class Link:
  """One link profile: every worker's link to the bridge is shaped to this."""
  name: str  # a short label for tables and file names
  rate_mbit: Optional[float]  # Mb/s (10^6 bit/s) per direction; None: no limit
  delay_ms: float = 0.0  # one-way delay added on the sender's uplink

  def __str__(self) -> str:
    rate = 'unlimited' if self.rate_mbit is None else (
        f'{self.rate_mbit / 1000:g} Gb/s' if self.rate_mbit >= 1000 else
        f'{self.rate_mbit:g} Mb/s')
    return rate + (f' + {self.delay_ms:g} ms' if self.delay_ms else '')


# ----------------------------------------------------------------------------
# Privileges and commands.


def _tool(name: str) -> str:
  path = shutil.which(name) or shutil.which(name, path='/usr/sbin:/sbin')
  if not path:
    raise NetlabError(f'`{name}` (iproute2) is not installed; the network '
                      'benchmark needs `ip` and `tc`.')
  return path


def _effective_caps() -> int:
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith('CapEff:'):
        return int(line.split()[1], 16)
  return 0


def require_privileges() -> None:
  """Raises NetlabError, naming what is missing, if namespaces are denied."""
  if not sys.platform.startswith('linux'):
    raise NetlabError(f'network namespaces need Linux, not {sys.platform}.')
  _tool('ip'), _tool('tc')
  caps = _effective_caps()
  missing = [n for n, bit in (('CAP_NET_ADMIN', _CAP_NET_ADMIN),
                              ('CAP_SYS_ADMIN', _CAP_SYS_ADMIN))
             if not caps >> bit & 1]
  if missing:
    raise NetlabError(
        f'creating network namespaces, veth links and tc qdiscs needs '
        f'{" and ".join(missing)} (uid {os.geteuid()} does not have '
        f'{"them" if len(missing) > 1 else "it"}). Run it as root with this '
        f'Python, e.g. `sudo {sys.executable} bench/network.py` or `sudo '
        f'make bench-network PY={sys.executable}`. Nothing was created.')


def _run(argv: Sequence[str],
         check: bool = True) -> subprocess.CompletedProcess:
  argv = [_tool(argv[0]), *argv[1:]] if argv[0] in ('ip', 'tc') else argv
  proc = subprocess.run(argv, capture_output=True, text=True,
                        timeout=_CMD_TIMEOUT_S, check=False)
  if check and proc.returncode:
    raise NetlabError(f'`{" ".join(argv)}` failed ({proc.returncode}): '
                      f'{proc.stderr.strip() or proc.stdout.strip()}')
  return proc


def _in_ns(ns: str, argv: Sequence[str]) -> list:
  head = [_tool(argv[0])] if argv[0] in ('ip', 'tc') else [argv[0]]
  return [_tool('ip'), 'netns', 'exec', ns, *head, *argv[1:]]


def _sysctl(ns: str, key: str, value: str) -> None:
  path = '/proc/sys/' + key.replace('.', '/')
  _run(_in_ns(ns, ['sh', '-c', f'echo {value} > {path}']))


# ----------------------------------------------------------------------------
# Leftovers of killed runs.


def _namespaces() -> list:
  out = _run(['ip', 'netns', 'list']).stdout
  return [line.split()[0] for line in out.splitlines() if line.strip()]


def _owner(name: str, prefix: str) -> Optional[int]:
  m = re.fullmatch(rf'{re.escape(prefix)}-(\d+)-(br|w\d+)', name)
  return int(m.group(1)) if m else None


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _delete_namespace(name: str) -> None:
  """Kills the processes inside `name` (by pid); deletes it and its files."""
  pids = _run(['ip', 'netns', 'pids', name], check=False).stdout.split()
  for pid in pids:
    try:
      os.kill(int(pid), signal.SIGKILL)
    except (ProcessLookupError, ValueError):
      pass
  _run(['ip', 'netns', 'del', name], check=False)
  shutil.rmtree(os.path.join('/etc/netns', name), ignore_errors=True)


def cleanup_stale(prefix: str = PREFIX) -> list:
  """Removes namespaces named `<prefix>-<pid>-*` whose owner pid is gone."""
  stale = [n for n in _namespaces()
           if (pid := _owner(n, prefix)) is not None and not _pid_alive(pid)]
  for name in stale:
    _delete_namespace(name)
  if os.path.isdir('/etc/netns'):  # hosts files whose namespace is gone
    for name in os.listdir('/etc/netns'):
      if (pid := _owner(name, prefix)) is not None and not _pid_alive(pid):
        shutil.rmtree(os.path.join('/etc/netns', name), ignore_errors=True)
  return stale


@contextlib.contextmanager
def signals_raise():
  """SIGTERM and SIGHUP raise KeyboardInterrupt, as SIGINT does, so that
  every `finally` and `with Cluster(...)` cleans up on them too."""
  def handler(signum, frame):
    del frame
    raise KeyboardInterrupt(f'signal {signum}')
  old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
  try:
    yield
  finally:
    for s, h in old.items():
      signal.signal(s, h)


@contextlib.contextmanager
def _signals_deferred():
  """Holds SIGINT and SIGTERM until the block ends (main thread only)."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  got = []
  old = {s: signal.signal(s, lambda signum, _: got.append(signum))
         for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    yield
  finally:
    for s, handler in old.items():
      signal.signal(s, handler)
    if got:
      signal.raise_signal(got[0])


# ----------------------------------------------------------------------------
# The cluster.


def _tbf_args(rate_mbit: float) -> list:
  rate_bytes = rate_mbit * 1e6 / 8
  burst = int(max(rate_bytes / 1000, 4 * 1514))  # 1 ms at the rate, >= 4 MTU
  return ['tbf', 'rate', f'{rate_mbit:g}mbit', 'burst', str(burst),
          'latency', f'{TBF_LATENCY_MS}ms']


class Cluster:
  """N worker namespaces on one bridge; a context manager that cleans up."""

  def __init__(self, n: int, prefix: str = PREFIX):
    if not 1 <= n <= MAX_WORKERS:
      raise ValueError(f'workers={n!r}; allowed: 1..{MAX_WORKERS}')
    self.n = n
    self.tag = f'{prefix}-{os.getpid()}'
    self.bridge_ns = f'{self.tag}-br'
    self.worker_ns = [f'{self.tag}-w{i}' for i in range(n)]
    self.netem = None  # whether the kernel has sch_netem (probed in create)
    self._prefix = prefix
    self._procs = []

  def address(self, i: int) -> str:
    return f'{SUBNET}.{HOST0 + i}'

  # -- lifecycle --------------------------------------------------------------

  def __enter__(self) -> 'Cluster':
    try:
      self.create()
    except BaseException:
      self.destroy()
      raise
    return self

  def __exit__(self, *exc) -> None:
    self.destroy()

  def create(self) -> None:
    require_privileges()
    cleanup_stale(self._prefix)
    for ns in [self.bridge_ns] + self.worker_ns:
      _run(['ip', 'netns', 'add', ns])
      for key in ('all', 'default'):  # before any device appears in it
        _sysctl(ns, f'net.ipv6.conf.{key}.disable_ipv6', '1')
      _run(['ip', '-n', ns, 'link', 'set', 'lo', 'up'])
    _run(['ip', '-n', self.bridge_ns, 'link', 'add', 'br0', 'type', 'bridge'])
    _run(['ip', '-n', self.bridge_ns, 'link', 'set', 'br0', 'up'])
    host = socket.gethostname()
    for i, ns in enumerate(self.worker_ns):
      _run(['ip', '-n', self.bridge_ns, 'link', 'add', f'p{i}', 'type', 'veth',
            'peer', 'name', 'eth0', 'netns', ns])
      _run(['ip', '-n', self.bridge_ns, 'link', 'set', f'p{i}', 'master', 'br0',
            'up'])
      _run(['ip', '-n', ns, 'addr', 'add', f'{self.address(i)}/24', 'dev',
            'eth0'])
      _run(['ip', '-n', ns, 'link', 'set', 'eth0', 'up'])
      self._write_hosts(ns, host, self.address(i))
    self.netem = self._probe_netem()

  def _write_hosts(self, ns: str, host: str, address: str) -> None:
    """/etc/netns/<ns>/hosts: `ip netns exec` mounts it over /etc/hosts.

    gloo's TCP transport binds to the address the host name resolves to; in
    a worker namespace that must be its own eth0 address, not 127.0.0.1.
    """
    folder = os.path.join('/etc/netns', ns)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, 'hosts'), 'w') as f:
      f.write(f'127.0.0.1 localhost\n{address} {host}\n')

  def _probe_netem(self) -> bool:
    ns = self.worker_ns[0]
    ok = _run(_in_ns(ns, ['tc', 'qdisc', 'add', 'dev', 'lo', 'root', 'netem',
                          'delay', '1ms']), check=False).returncode == 0
    if ok:
      _run(_in_ns(ns, ['tc', 'qdisc', 'del', 'dev', 'lo', 'root']))
    return ok

  def destroy(self) -> None:
    """Kills our processes, then deletes every namespace of this cluster.

    SIGINT and SIGTERM wait until it is done (a second Ctrl-C would
    otherwise leave half a cluster behind).
    """
    with _signals_deferred():
      self.kill_all()
      for ns in self.worker_ns + [self.bridge_ns]:
        _delete_namespace(ns)

  # -- shaping ----------------------------------------------------------------

  def shape(self, link: Link) -> bool:
    """Shapes every worker link; returns whether the delay was applied."""
    delay = bool(link.delay_ms) and bool(self.netem)
    for i, ns in enumerate(self.worker_ns):
      self._set_qdisc(ns, 'eth0', link, delay)
      self._set_qdisc(self.bridge_ns, f'p{i}', link, False)
    return delay or not link.delay_ms

  def _set_qdisc(self, ns: str, dev: str, link: Link, delay: bool) -> None:
    tc = ['tc', 'qdisc']
    _run(_in_ns(ns, tc + ['del', 'dev', dev, 'root']), check=False)
    if delay:
      _run(_in_ns(ns, tc + ['add', 'dev', dev, 'root', 'handle', '1:', 'netem',
                            'delay', f'{link.delay_ms:g}ms', 'limit',
                            '100000']))
      if link.rate_mbit is not None:
        _run(_in_ns(ns, tc + ['add', 'dev', dev, 'parent', '1:1', 'handle',
                              '10:', *_tbf_args(link.rate_mbit)]))
    elif link.rate_mbit is not None:
      _run(_in_ns(ns, tc + ['add', 'dev', dev, 'root', *_tbf_args(
          link.rate_mbit)]))

  def qdisc_stats(self) -> list:
    """Per worker: the uplink qdiscs' sent bytes, drops and overlimits."""
    out = []
    for ns in self.worker_ns:
      js = _run(_in_ns(ns, ['tc', '-s', '-j', 'qdisc', 'show', 'dev', 'eth0']))
      qdiscs = json.loads(js.stdout or '[]')
      out.append({'drops': sum(q.get('drops', 0) for q in qdiscs),
                  'overlimits': sum(q.get('overlimits', 0) for q in qdiscs),
                  'kinds': '+'.join(q['kind'] for q in qdiscs)})
    return out

  # -- counters ---------------------------------------------------------------

  def counters(self) -> list:
    """Per worker: the kernel's counters of its link (see `COUNTERS`).

    rx of p<i> in the bridge namespace = what worker i sent; tx = received.
    """
    js = json.loads(_run(['ip', '-n', self.bridge_ns, '-s', '-j', 'link',
                          'show']).stdout)
    by_name = {d['ifname']: d['stats64'] for d in js}
    out = []
    for i in range(self.n):
      s = by_name[f'p{i}']
      out.append({f'{way}_{unit}': s[way][unit] for way in ('rx', 'tx')
                  for unit in ('bytes', 'packets')})
    return out

  def start_sampler(self, path: str, interval_s: float) -> subprocess.Popen:
    """Polls every port's counters into `path` (see `read_samples`)."""
    argv = [sys.executable, os.path.abspath(__file__), 'sample', '--out', path,
            '--interval', str(interval_s), *[f'p{i}' for i in range(self.n)]]
    return self.popen_bridge(argv)

  # -- processes --------------------------------------------------------------

  def exec_argv(self, i: int, argv: Sequence[str]) -> list:
    """`argv` run inside worker i's namespace."""
    return _in_ns(self.worker_ns[i], argv)

  def popen(self, i: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
    """Starts `argv` in worker i's namespace, in its own process group."""
    return self._start(self.exec_argv(i, argv), **kwargs)

  def popen_bridge(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
    return self._start(_in_ns(self.bridge_ns, argv), **kwargs)

  def _start(self, argv, **kwargs) -> subprocess.Popen:
    proc = subprocess.Popen(argv, start_new_session=True, **kwargs)
    self._procs.append(proc)
    return proc

  def kill_all(self) -> None:
    """Kills the process group of every process this cluster started."""
    for proc in self._procs:
      if proc.poll() is None:
        try:
          os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
    for proc in self._procs:
      try:
        proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        pass
    self._procs = []


# ----------------------------------------------------------------------------
# The counter sampler (runs inside the bridge namespace) and its file.


def sample(out: str, interval_s: float, devices: Sequence[str]) -> None:
  """Appends `time c0 c1 ...` lines (COUNTERS per device) until killed."""
  fds = [os.open(f'/sys/class/net/{d}/statistics/{c}', os.O_RDONLY)
         for d in devices for c in COUNTERS]
  stop = []
  signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
  with open(out, 'w', buffering=1) as f:
    f.write(json.dumps({'devices': list(devices), 'counters': COUNTERS}) + '\n')
    while not stop:
      values = [os.pread(fd, 32, 0).strip().decode() for fd in fds]
      f.write(f'{time.time():.6f} {" ".join(values)}\n')
      time.sleep(interval_s)


def read_samples(path: str):
  """(times [T], counters [T, devices, len(COUNTERS)]) as numpy arrays."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  with open(path) as f:
    head = json.loads(f.readline())
    rows = [line.split() for line in f if line.strip()]
  n_dev, n_cnt = len(head['devices']), len(head['counters'])
  rows = [r for r in rows if len(r) == 1 + n_dev * n_cnt]  # a cut last line
  times = np.array([float(r[0]) for r in rows])
  values = np.array([[int(v) for v in r[1:]] for r in rows], np.float64)
  return times, values.reshape(len(rows), n_dev, n_cnt)


def counters_at(times, values, t: float):
  """Counters [devices, COUNTERS] at time t, interpolated between samples."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  if not times[0] <= t <= times[-1]:
    raise ValueError(f'time {t:.3f} is outside the samples '
                     f'[{times[0]:.3f}, {times[-1]:.3f}]')
  flat = values.reshape(len(times), -1)
  return np.array([np.interp(t, times, flat[:, j]) for j in range(
      flat.shape[1])]).reshape(values.shape[1:])


# ----------------------------------------------------------------------------
# A link probe: round-trip time and bulk throughput between two workers.


def probe_server(port: int) -> None:
  """Echoes 1-byte pings, then swallows a bulk stream and reports its size."""
  with socket.create_server(('0.0.0.0', port)) as srv:
    srv.settimeout(60)
    conn, _ = srv.accept()
    with conn:
      conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      while (b := conn.recv(1)) and b != b'B':
        conn.sendall(b)
      total = 0
      while chunk := conn.recv(1 << 20):
        total += len(chunk)
      print(total)


def probe_client(host: str, port: int, pings: int, bulk_s: float) -> None:
  """Prints {"rtt_ms": median, "mbit": bulk goodput} as JSON."""
  deadline = time.monotonic() + 30
  while True:
    try:
      conn = socket.create_connection((host, port), timeout=10)
      break
    except OSError:
      if time.monotonic() > deadline:
        raise
      time.sleep(0.1)
  with conn:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(pings):
      t0 = time.perf_counter()
      conn.sendall(b'p')
      conn.recv(1)
      rtts.append(time.perf_counter() - t0)
    conn.sendall(b'B')
    buf, sent = b'\0' * (1 << 20), 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < bulk_s:
      conn.sendall(buf)
      sent += len(buf)
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)  # the server closes once it has read everything
    elapsed = time.perf_counter() - t0
  rtts.sort()
  print(json.dumps({'rtt_ms': 1e3 * rtts[len(rtts) // 2],
                    'mbit': 8 * sent / elapsed / 1e6}))


def probe_link(cluster: Cluster, port: int = 29400, pings: int = 50,
               bulk_s: float = 2.0) -> dict:
  """Round-trip time and one-way bulk goodput from worker 0 to worker 1."""
  if cluster.n < 2:
    return {'rtt_ms': float('nan'), 'mbit': float('nan')}
  me = os.path.abspath(__file__)
  server = cluster.popen(1, [sys.executable, me, 'probe-server', '--port',
                             str(port)], stdout=subprocess.PIPE, text=True)
  client = cluster.popen(0, [sys.executable, me, 'probe-client', '--host',
                             cluster.address(1), '--port', str(port),
                             '--pings', str(pings), '--bulk-s', str(bulk_s)],
                         stdout=subprocess.PIPE, text=True)
  out, _ = client.communicate(timeout=60 + bulk_s)
  server.communicate(timeout=30)
  if client.returncode:
    raise NetlabError(f'the link probe failed ({client.returncode})')
  return json.loads(out)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  sub = p.add_subparsers(dest='cmd', required=True)
  sub.add_parser('cleanup', help='remove the namespaces of killed runs')
  s = sub.add_parser('hold', help='build a cluster, print its tag, keep it '
                     'until Ctrl-C or SIGTERM')
  s.add_argument('workers', type=cli_types.positive_int)
  s = sub.add_parser('sample', help='(internal) poll counters into a file')
  s.add_argument('--out', required=True)
  s.add_argument('--interval', type=cli_types.positive_float, default=0.02)
  s.add_argument('devices', nargs='+')
  s = sub.add_parser('probe-server', help='(internal)')
  s.add_argument('--port', type=int, required=True)
  s = sub.add_parser('probe-client', help='(internal)')
  s.add_argument('--host', required=True)
  s.add_argument('--port', type=int, required=True)
  s.add_argument('--pings', type=cli_types.positive_int, default=50)
  s.add_argument('--bulk-s', type=cli_types.positive_float, default=2.0)
  args = p.parse_args(argv)
  if args.cmd in ('cleanup', 'hold'):
    try:
      require_privileges()
    except NetlabError as e:
      p.exit(2, f'error: {e}\n')
  if args.cmd == 'cleanup':
    print(f'removed: {cleanup_stale() or "nothing"}')
  elif args.cmd == 'hold':
    with contextlib.suppress(KeyboardInterrupt), signals_raise(), Cluster(
        args.workers) as cluster:
      print(cluster.tag, ' '.join(cluster.address(i)
                                  for i in range(args.workers)), flush=True)
      while True:
        time.sleep(3600)
  elif args.cmd == 'sample':
    sample(args.out, args.interval, args.devices)
  elif args.cmd == 'probe-server':
    probe_server(args.port)
  else:
    probe_client(args.host, args.port, args.pings, args.bulk_s)


if __name__ == '__main__':
  main()
