"""Tables, acceptance checks, the alpha-beta projection and the plot for
bench/network.py's measurements (docs/bench/network.{csv,md,png})."""

import csv
import json
import math
import os
import statistics
import subprocess

import netlab
import projected_step_time as projection

# The acceptance thresholds of issue 11, checked on the slowest link.
SLOW_LINK = '100mbit'
SPARSE = 'SCAPE d=0.01'
MIN_SPEEDUP = 4.0  # SCAPE d=0.01 vs the baseline, per step
MAX_VS_REFERENCE = 1.3  # SCAPE d=0.01 vs its no-communication step
BYTES_TOLERANCE = 0.10  # counted payload vs HLO bytes, besides the overhead
# The fixed overhead allowed besides: gloo sends three 48-byte headers per
# message (its send-ready and recv-ready notices and the data's own), and
# XLA:CPU runs a tuple all-reduce as one gloo all-reduce per operand (one per
# parameter leaf for the dense methods), each >= 2 ring messages per peer.
FRAMING_BYTES = 16_000  # per worker per step

FIELDS = (
    'link', 'rate_mbit', 'delay_ms', 'delay_applied', 'rtt_ms',
    'goodput_mbit', 'method', 'workers', 'per_worker_batch', 'seq_len',
    'timed_steps', 'step_ms', 'step_ms_min', 'step_ms_max', 'nocomm_step_ms',
    'vs_nocomm', 'speedup_vs_baseline', 'own_n1_step_ms', 'hlo_bytes',
    'kernel_tx_bytes', 'kernel_tx_frames', 'kernel_payload_bytes',
    'payload_vs_hlo', 'payload_minus_hlo_bytes', 'kernel_rx_bytes',
    'qdisc_drops', 'model_compute_ms', 'model_comm_ms', 'proj_step_ms',
    'proj_step_ms_mask_overlap', 'proj_step_ms_nominal', 'final_loss',
    # DiLoCo and Pier (scape_jax.analysis.runs); step_ms is then the mean.
    'step_stat', 'sync_every', 'window', 'intervals', 'inner_step_ms',
    'sync_step_ms', 'lazy_step_ms', 'lazy_steps', 'hlo_inner_bytes',
    'hlo_sync_bytes')
FAST_LINK = 'unlimited'
REFERENCE = 'none (N=1)'  # the `link` of the no-communication rows
IN_MEMORY = 'in memory'  # ... of the N-device, one-process rows


def _collective_dicts(cols) -> list:
  return [{'kind': c.kind, 'count': c.count, 'group_size': c.group_size,
           'bytes_sent': c.bytes_sent, 'name': c.name} for c in cols]


def comm_model_s(cols, mbit: float, one_way_ms: float) -> float:
  """Seconds of communication per step on this link, alpha-beta, no overlap."""
  if not mbit > 0:
    return math.nan
  return sum(projection.comm_seconds(_collective_dicts(cols), mbit / 1000,
                                     1e3 * one_way_ms).values())


def project(cols, compute_s: float, mbit: float, one_way_ms: float) -> tuple:
  """(no overlap, mask all-gather overlapped) step seconds, alpha-beta."""
  if not (compute_s > 0 and mbit > 0):
    return math.nan, math.nan
  no_overlap, overlap, _ = projection.step_times(
      _collective_dicts(cols), compute_s, mbit / 1000, 1e3 * one_way_ms)
  return no_overlap, overlap


def model_compute_s(results: dict, label: str, baseline: str) -> float:
  """The compute the projection adds to the modelled communication: the
  method's step on the unlimited link minus that link's modelled
  communication (forward/backward and the method's own update at this N);
  without an unlimited-link job, the baseline's no-communication step."""
  fast = results['jobs'].get((FAST_LINK, label))
  if fast:
    probe = results['links'][FAST_LINK]
    comm = comm_model_s(fast['collectives'], probe['mbit'],
                        probe['rtt_ms'] / 2)
    return max(fast['step_s'] - comm, 0.0)
  ref = results['reference'].get(baseline)
  return ref['step_s'] if ref else math.nan


def _nominal_one_way_ms(link: netlab.Link, probe: dict) -> float:
  """Alpha for the link as specified (its delay even where the kernel could
  not apply it)."""
  return probe['rtt_ms'] / 2 + (0.0 if probe['delay_applied']
                                else link.delay_ms)


def plain_model(job: dict, results: dict, label: str, baseline: str,
                link: netlab.Link, probe: dict) -> dict:
  """The alpha-beta model of a method whose steps are all one program."""
  compute_s = model_compute_s(results, label, baseline)
  one_way_ms = probe['rtt_ms'] / 2
  cols = job['collectives']
  proj, overlap = project(cols, compute_s, probe['mbit'], one_way_ms)
  nominal = (math.nan if link.rate_mbit is None else project(
      cols, compute_s, link.rate_mbit, _nominal_one_way_ms(link, probe))[0])
  return {'compute_s': compute_s,
          'comm_s': comm_model_s(cols, probe['mbit'], one_way_ms),
          'proj_s': proj, 'overlap_s': overlap, 'nominal_s': nominal}


def outer_model(job: dict, results: dict, label: str, link: netlab.Link,
                probe: dict) -> dict:
  """DiLoCo's and Pier's model: per phase (inner, sync) its collectives and
  its compute (its mean step on the unlimited link minus the modelled
  communication there), weighted by the phase's share of the window. Not
  available (NaN) without the unlimited link's job or a phase's table."""
  nan = dict.fromkeys(('compute_s', 'comm_s', 'proj_s', 'overlap_s',
                       'nominal_s'), math.nan)
  fast = results['jobs'].get((FAST_LINK, label))
  counts, tables = job['phase_counts'], job.get('phase_collectives', {})
  if not fast or any(p not in tables or p not in fast.get(
      'phase_collectives', {}) for p in counts):
    return nan
  fast_probe = results['links'][FAST_LINK]
  compute = {p: max(fast['phase_mean_s'][p] - comm_model_s(
      fast['phase_collectives'][p], fast_probe['mbit'],
      fast_probe['rtt_ms'] / 2), 0.0) for p in counts}
  n = sum(counts.values())

  def mean(fn) -> float:
    return sum(c * fn(p) for p, c in counts.items()) / n

  one_way_ms = probe['rtt_ms'] / 2
  cols = lambda p: tables[p]  # noqa: E731
  nominal = (math.nan if link.rate_mbit is None else mean(
      lambda p: project(cols(p), compute[p], link.rate_mbit,
                        _nominal_one_way_ms(link, probe))[0]))
  return {
      'compute_s': mean(compute.get),
      'comm_s': mean(lambda p: comm_model_s(cols(p), probe['mbit'],
                                            one_way_ms)),
      'proj_s': mean(lambda p: project(cols(p), compute[p], probe['mbit'],
                                       one_way_ms)[0]),
      'overlap_s': mean(lambda p: project(cols(p), compute[p], probe['mbit'],
                                          one_way_ms)[1]),
      'nominal_s': nominal}


def outer_fields(run: dict) -> dict:
  """The CSV's DiLoCo/Pier columns of a run (blank for other methods)."""
  if 'phase_s' not in run:
    return {'step_stat': run.get('step_stat', 'median')}
  ms = lambda p: 1e3 * run['phase_s'][p]  # noqa: E731
  return {'step_stat': run['step_stat'], 'sync_every': run['sync_every'],
          'window': '{}-{}'.format(*run['window']),
          'intervals': run['intervals'], 'inner_step_ms': ms('inner'),
          'sync_step_ms': ms('sync'), 'lazy_step_ms': ms('lazy'),
          'lazy_steps': run['lazy_steps'],
          'hlo_inner_bytes': run['hlo_phase_bytes'].get('inner', ''),
          'hlo_sync_bytes': run['hlo_phase_bytes'].get('sync', '')}


def job_row(link: netlab.Link, probe: dict, label: str, job: dict,
            results: dict, args, baseline: str) -> dict:
  """One CSV row: what a (link, method) job measured, and its projection."""
  workers = job['per_worker']
  mean = lambda key: statistics.fmean(w[key] for w in workers)  # noqa: E731
  payload = mean('payload')
  nocomm = results['reference'].get(baseline, {}).get('step_s', math.nan)
  own = results['reference'].get(label, {}).get('step_s', math.nan)
  model = (outer_model(job, results, label, link, probe) if 'phase_s' in job
           else plain_model(job, results, label, baseline, link, probe))
  return {
      'link': link.name, 'rate_mbit': link.rate_mbit or '',
      'delay_ms': link.delay_ms, 'delay_applied': probe['delay_applied'],
      'rtt_ms': probe['rtt_ms'], 'goodput_mbit': probe['mbit'],
      'method': label, 'workers': args.workers,
      'per_worker_batch': args.per_worker_batch,
      'seq_len': args.shared['data.seq_len'],
      'timed_steps': job['timed_steps'], 'step_ms': 1e3 * job['step_s'],
      'step_ms_min': 1e3 * job['step_s_min'],
      'step_ms_max': 1e3 * job['step_s_max'], 'nocomm_step_ms': 1e3 * nocomm,
      'vs_nocomm': job['step_s'] / nocomm, 'speedup_vs_baseline': math.nan,
      'own_n1_step_ms': 1e3 * own, 'hlo_bytes': job['hlo_bytes'],
      'kernel_tx_bytes': mean('tx_bytes'),
      'kernel_tx_frames': mean('tx_frames'), 'kernel_payload_bytes': payload,
      'payload_vs_hlo': payload / job['hlo_bytes'] - 1 if job['hlo_bytes']
                        else math.nan,
      'payload_minus_hlo_bytes': payload - job['hlo_bytes'],
      'kernel_rx_bytes': mean('rx_bytes'),
      'qdisc_drops': sum(q['drops'] for q in job['qdisc']),
      'model_compute_ms': 1e3 * model['compute_s'],
      'model_comm_ms': 1e3 * model['comm_s'],
      'proj_step_ms': 1e3 * model['proj_s'],
      'proj_step_ms_mask_overlap': 1e3 * model['overlap_s'],
      'proj_step_ms_nominal': 1e3 * model['nominal_s'],
      'final_loss': job['final_loss'], **outer_fields(job)}


def reference_row(link: str, label: str, ref: dict, args, workers: int,
                  nocomm_s: float) -> dict:
  """A row of a run without a network (N=1, or N devices in one process)."""
  row = dict.fromkeys(FIELDS, '')
  row.update(link=link, method=label, workers=workers,
             per_worker_batch=args.per_worker_batch,
             seq_len=args.shared['data.seq_len'],
             timed_steps=ref['timed_steps'], step_ms=1e3 * ref['step_s'],
             step_ms_min=1e3 * ref['step_s_min'],
             step_ms_max=1e3 * ref['step_s_max'],
             nocomm_step_ms=1e3 * nocomm_s, vs_nocomm=ref['step_s'] / nocomm_s,
             hlo_bytes=0,
             final_loss=ref['final_loss'], **outer_fields(ref))
  return row


def build_rows(results: dict, args, profiles: dict, baseline: str) -> list:
  rows = [job_row(profiles[name], results['links'][name], label, job, results,
                  args, baseline)
          for (name, label), job in results['jobs'].items()]
  base = {r['link']: r['step_ms'] for r in rows if r['method'] == baseline}
  for r in rows:
    r['speedup_vs_baseline'] = base.get(r['link'], math.nan) / r['step_ms']
  nocomm = results['reference'].get(baseline, {}).get('step_s', math.nan)
  rows += [reference_row(REFERENCE, label, ref, args, 1, nocomm)
           for label, ref in results['reference'].items()]
  rows += [reference_row(IN_MEMORY, label, ref, args, args.workers, nocomm)
           for label, ref in results.get('in_memory', {}).items()]
  return rows


# ----------------------------------------------------------------------------
# Acceptance and the decomposition of SCAPE's step.


def _find(rows, link, method):
  return next((r for r in rows if r['link'] == link and r['method'] == method),
              None)


def _verdict(ok: bool) -> str:
  return '**met**' if ok else '**not met**'


def acceptance(rows: list, baseline: str) -> list:
  """Markdown lines: issue 11's checks, computed from the rows."""
  lines = []
  sparse = _find(rows, SLOW_LINK, SPARSE)
  if sparse and not math.isnan(sparse['speedup_vs_baseline']):
    lines.append(f'- {SPARSE} vs {baseline} at {SLOW_LINK}: '
                 f'{sparse["speedup_vs_baseline"]:.2f}x per step (needs >= '
                 f'{MIN_SPEEDUP:g}x): '
                 f'{_verdict(sparse["speedup_vs_baseline"] >= MIN_SPEEDUP)}.')
  if sparse and not math.isnan(sparse['vs_nocomm']):
    lines.append(f'- {SPARSE} at {SLOW_LINK} vs the no-communication step '
                 f'({baseline} at N=1): {sparse["vs_nocomm"]:.2f}x (needs <= '
                 f'{MAX_VS_REFERENCE:g}x): '
                 f'{_verdict(sparse["vs_nocomm"] <= MAX_VS_REFERENCE)}.')
    lines += decomposition(rows, baseline)
  jobs = [r for r in rows if r['hlo_bytes']]
  if jobs:
    worst = max(jobs, key=lambda r: abs(r['payload_vs_hlo']))
    excess = max(jobs, key=lambda r: abs(r['payload_minus_hlo_bytes']))
    bad = [r for r in jobs if not bytes_agree(r)]
    lines.append(
        f'- Kernel-counted TCP payload vs HLO bytes, {len(jobs)} jobs: worst '
        f'{100 * worst["payload_vs_hlo"]:+.2f}% ({worst["method"]}, '
        f'{worst["link"]}); largest difference '
        f'{excess["payload_minus_hlo_bytes"] / 1e3:+.1f} kB per worker per '
        f'step ({excess["method"]}, {excess["link"]}). Allowed: '
        f'{100 * BYTES_TOLERANCE:g}% plus {FRAMING_BYTES / 1e3:g} kB of gloo '
        f'framing per step: {_verdict(not bad)}'
        + (f' (not by: {", ".join(r["method"] + " " + r["link"] for r in bad)})'
           if bad else '') + f'. On the wire each frame also carries '
        f'{netlab.HEADER_BYTES} B of Ethernet, IPv4 and TCP headers: the '
        '`kernel, on the wire` column; the TCP payload includes '
        'retransmitted segments.')
  return lines


def bytes_agree(row: dict) -> bool:
  """Counted payload within the tolerance plus the framing of the HLO's."""
  return (abs(row['payload_minus_hlo_bytes']) <=
          BYTES_TOLERANCE * row['hlo_bytes'] + FRAMING_BYTES)


def decomposition(rows: list, baseline: str) -> list:
  """Where SCAPE d=0.01's step on the slow link goes, each part the
  difference of two measured steps: compute (the no-communication step),
  SCAPE's own update (the N-device step in memory), gloo and TCP (the
  unlimited link) and the link's rate (the slow link)."""
  slow, fast = _find(rows, SLOW_LINK, SPARSE), _find(rows, FAST_LINK, SPARSE)
  local = _find(rows, IN_MEMORY, SPARSE)
  if not (slow and fast and local) or math.isnan(slow['nocomm_step_ms']):
    return []
  nocomm = slow['nocomm_step_ms']
  n = slow['workers']
  modelled = slow['model_comm_ms'] - fast['model_comm_ms']
  return [
      f'  - Where its {slow["step_ms"]:.0f} ms go (each part the difference '
      f'of two measured steps): {nocomm:.0f} ms forward/backward and a dense '
      f'update ({baseline}, N=1, no communication); '
      f'{local["step_ms"] - nocomm:+.0f} ms SCAPE\'s own update at N={n} '
      f'(top-k, compaction, masks) with its collectives in memory (N={n} '
      f'devices in one process: {local["step_ms"]:.0f} ms); '
      f'{fast["step_ms"] - local["step_ms"]:+.0f} ms gloo and TCP on the '
      f'{FAST_LINK} link (N={n} processes: {fast["step_ms"]:.0f} ms; the '
      f'alpha-beta model: {fast["model_comm_ms"]:.0f} ms); '
      f'{slow["step_ms"] - fast["step_ms"]:+.0f} ms for the {SLOW_LINK} '
      f'link\'s rate (the alpha-beta model: {modelled:+.0f} ms). SCAPE\'s '
      f'own N=1 step ({slow["own_n1_step_ms"]:.0f} ms) is no reference: at '
      'N=1 every top-k runs over a whole leaf, at N workers over 1/N of it.']


# ----------------------------------------------------------------------------
# Outputs.


def commit(root: str) -> str:
  """The checkout's commit (with '+dirty' for uncommitted changes)."""
  git = lambda *a: subprocess.run(  # noqa: E731
      ['git', '-C', root, *a], capture_output=True, text=True, check=False)
  head = git('rev-parse', '--short', 'HEAD').stdout.strip() or 'unknown'
  return head + ('+dirty' if git('status', '--porcelain', '--',
                                 '*.py').stdout.strip() else '')


def record_run(run_dir: str, run: dict) -> None:
  """Writes run.json: this run, and the earlier runs into the directory
  (whose rows that this run did not redo are still reported)."""
  path = os.path.join(run_dir, 'run.json')
  earlier = []
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    earlier = old.pop('earlier', []) + [old]
  with open(path, 'w') as f:
    json.dump(dict(run, earlier=earlier), f)


def _fmt(v, digits=1):
  if isinstance(v, float):
    return '' if math.isnan(v) else f'{v:,.{digits}f}'
  return str(v)


def _at(run: dict) -> str:
  return f', commit {run["commit"]}' if run.get('commit') else ''


def _earlier(results: dict) -> str:
  """The earlier runs into the run directory, whose rows this run did not
  redo (they may come from other code versions)."""
  runs = results.get('earlier', [])
  if not runs:
    return ''
  return (' Rows this command did not run come from earlier runs into the '
          'same directory, possibly of other code versions: ' + '; '.join(
              f'`{r.get("command", "?")}` ({r.get("seconds", 0) / 60:.1f} min'
              f'{_at(r) or ", commit not recorded"})' for r in runs) + '.')


def _intro(results: dict, args, baseline: str) -> list:
  command = results.get('command', '(unknown command)')
  took = (f'{results["seconds"] / 60:.1f} min' if 'seconds' in results
          else 'unknown duration')
  return [
      '# Step time over rate-limited links (bench/network.py)', '',
      f'<!-- generated by bench/network.py from {args.run_dir}; do not edit '
      'by hand -->',
      f'Command: `{command}` ({took} on {os.cpu_count()} cores'
      f'{_at(results)}).{_earlier(results)}', '',
      f'{args.workers} worker processes, each in its own network namespace '
      'with one CPU device, run `train.py` as one `jax.distributed` job '
      '(gloo collectives) over veth links to a bridge, shaped with tbf per '
      'direction (and a netem delay where the kernel has sch_netem). Model '
      f'`{args.shared["model.preset"]}` ({args.shared["model.dtype"]}), '
      f'{args.per_worker_batch} x {args.shared["data.seq_len"]} tokens per '
      f'worker per step, {args.steps} steps of which the first {args.warmup} '
      'are not timed; step time = the median of the differences of the '
      'logged `wall_time`s.', '',
      f'*No-communication step*: {baseline} at N=1 with the same per-worker '
      f'batch, run as {args.workers} independent copies at once so that '
      'each gets the share of the cores a worker gets. The rows '
      f'`{REFERENCE}` give every method\'s own N=1 step; the rows '
      f'`{IN_MEMORY}` its N-worker step without a network ({args.workers} '
      'simulated CPU devices in one process, collectives in memory, the '
      'same per-worker work as the job).', '',
      '*Bytes*: per worker per step, the kernel\'s counters of its link '
      '(polled every 10 ms, interpolated at the first and last timed '
      f'step); TCP payload = bytes - {netlab.HEADER_BYTES} B per frame. '
      '*HLO*: the trainer\'s `comm_bytes`, read from the compiled step.', '',
      '*Alpha-beta*: bench/projected_step_time.py\'s ring model of the '
      'step\'s collectives on the measured link (alpha = RTT/2, beta = 1 / '
      'bulk goodput), plus a compute time: the method\'s step on the '
      'unlimited link minus the modelled communication there (so that '
      'row matches by construction). The last column uses the link as '
      'specified: its nominal rate and delay.', '',
      '## Links (measured between workers 0 and 1)', '',
      '| link | rate | delay asked | delay applied | RTT ms | bulk goodput '
      'Mb/s |', '|---|---|---|---|---|---|']


def markdown(rows: list, results: dict, args, baseline: str) -> str:
  links = results['links']
  lines = _intro(results, args, baseline)
  for name, probe in links.items():
    r = next(x for x in rows if x['link'] == name)
    applied = 'yes' if probe['delay_applied'] else '**no** (no sch_netem)'
    lines.append(f'| {name} | {r["rate_mbit"] or "none"} | {r["delay_ms"]:g} '
                 f'ms | {applied} | {probe["rtt_ms"]:.3f} | '
                 f'{probe["mbit"]:,.0f} |')
  lines += ['', '## Step time', '',
            f'| link | method | step ms (median) | min-max | vs no-comm. step '
            f'| speed-up vs {baseline} | alpha-beta ms | alpha-beta, link as '
            'specified, ms |', '|---|---|---|---|---|---|---|---|']
  for r in rows:
    lines.append(
        f'| {r["link"]} | {r["method"]} | {_fmt(r["step_ms"], 0)}'
        f'{"" if r["step_stat"] == "median" else " †"} | '
        f'{_fmt(r["step_ms_min"], 0)}-{_fmt(r["step_ms_max"], 0)} | '
        f'{_fmt(r["vs_nocomm"], 2)} | {_fmt(r["speedup_vs_baseline"], 2)} | '
        f'{_fmt(r["proj_step_ms"], 0)} | '
        f'{_fmt(r["proj_step_ms_nominal"], 0)} |')
  lines += ['', '## Bytes per worker per step', '',
            '| link | method | HLO (trainer) | kernel, on the wire | frames | '
            'kernel, TCP payload | payload vs HLO | qdisc drops |',
            '|---|---|---|---|---|---|---|---|']
  for r in rows:
    if r['hlo_bytes']:
      lines.append(
          f'| {r["link"]} | {r["method"]} | {r["hlo_bytes"]:,.0f} | '
          f'{r["kernel_tx_bytes"]:,.0f} | {r["kernel_tx_frames"]:,.0f} | '
          f'{r["kernel_payload_bytes"]:,.0f} | '
          f'{100 * r["payload_vs_hlo"]:+.2f}% | {r["qdisc_drops"]} |')
  lines += outer_table(rows)
  for (name, label), error in results.get('failed', {}).items():
    lines.append(f'\n**{label} on {name} failed:** `{error.splitlines()[0]}`')
  lines += ['', '## Acceptance (issue 11)', ''] + acceptance(rows, baseline)
  lines += ['', '![step time per method and link](network.png)', '']
  return '\n'.join(lines)


def outer_table(rows: list) -> list:
  """Markdown lines: DiLoCo's and Pier's phases, times and bytes."""
  outer = [r for r in rows if r['step_stat'] == 'mean']
  if not outer:
    return []
  lines = [
      '', '## DiLoCo and Pier: sync intervals', '',
      'Mesh `replica=2, data=N/2`: DiLoCo and Pier with AdamW inside, its '
      'exchange over `data` only, the sync step\'s all-reduce of the '
      'parameter change over `replica`. Their N=1 rows are one group of one '
      'worker (every phase runs, the outer arithmetic included, with no '
      'communication); their in-memory rows use the job\'s mesh on N '
      'simulated devices. On these links every worker\'s link is shaped '
      'alike: the inner exchange crosses the same link as the sync (no fast '
      'intra-group links as in Pier\'s clusters).', '',
      '† In the step-time table above, DiLoCo\'s and Pier\'s step is the '
      '**mean over whole sync intervals** (the steps after the first sync '
      'step at or after the warm-up, up to the last sync step: one sync '
      'step per r), not the median: their sync steps are periodic spikes. '
      'Beside it here: the median inner step and the median sync step of '
      'that window, and Pier\'s median lazy-start step (AdamW over every '
      'worker; its timed steps before the window). Bytes per worker: the '
      'HLO\'s per program (the trainer\'s `comm_bytes` of an inner and of a '
      'sync step) and both counts amortised over the window (the HLO\'s mean '
      'per step; the kernel\'s TCP payload over the window / its steps).',
      '',
      '| link | method | r | window (steps) | intervals | mean step ms | '
      'inner ms (median) | sync ms (median) | lazy start ms (median, steps) '
      '| HLO inner B | HLO sync B | HLO amortised B | kernel payload '
      'amortised B |', '|---|---|---|---|---|---|---|---|---|---|---|---|---|']
  for r in outer:
    lazy = (f'{_fmt(r["lazy_step_ms"], 0)} ({r["lazy_steps"]})'
            if r['lazy_steps'] else '')
    counted = (_fmt(float(r['kernel_payload_bytes']), 0)
               if r['kernel_payload_bytes'] != '' else '')
    hlo = _fmt(float(r['hlo_bytes']), 0) if r['hlo_bytes'] else ''
    lines.append(
        f'| {r["link"]} | {r["method"]} | {r["sync_every"]} | {r["window"]} '
        f'| {r["intervals"]} | {_fmt(r["step_ms"], 0)} | '
        f'{_fmt(r["inner_step_ms"], 0)} | {_fmt(r["sync_step_ms"], 0)} | '
        f'{lazy} | {_fmt(float(r["hlo_inner_bytes"] or 0), 0)} | '
        f'{_fmt(float(r["hlo_sync_bytes"] or 0), 0)} | {hlo} | {counted} |')
  lines += ['', 'Their alpha-beta columns combine a model per phase: the '
            'phase\'s collectives (the trainer prints one table per program) '
            'and its compute (its mean step on the unlimited link minus the '
            'modelled communication there), weighted by the phase\'s share '
            'of the window; blank without an unlimited-link job.']
  return lines


def plot(rows: list, path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  links = list(dict.fromkeys(r['link'] for r in rows))
  methods = list(dict.fromkeys(r['method'] for r in rows))
  width = 0.8 / len(methods)
  fig, ax = plt.subplots(figsize=(8, 4.5))
  for j, method in enumerate(methods):
    x = np.arange(len(links)) + (j - (len(methods) - 1) / 2) * width
    ys = [(_find(rows, link, method) or {}).get('step_ms', np.nan)
          for link in links]
    proj = [(_find(rows, link, method) or {}).get('proj_step_ms', np.nan)
            for link in links]
    ax.bar(x, ys, width, label=method)
    ax.scatter(x, [p if p != '' else np.nan for p in proj], marker='_',
               color='k', s=200, zorder=3)
  nocomm = next((r['nocomm_step_ms'] for r in rows
                 if r['nocomm_step_ms'] not in ('', None)), math.nan)
  if not math.isnan(nocomm):
    ax.axhline(nocomm, ls=':', color='gray', label='no-communication step')
  ax.set_xticks(np.arange(len(links)), links)
  ax.set_yscale('log')
  ax.set_ylabel('median step time, ms (log)')
  ax.set_title('measured step time per link (bars), alpha-beta model (dashes)')
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write(results: dict, args, profiles: dict, baseline: str) -> None:
  """Writes <args.out>/network.{csv,md,png} and prints the markdown."""
  rows = build_rows(results, args, profiles, baseline)
  os.makedirs(args.out, exist_ok=True)
  base = os.path.join(args.out, 'network')
  with open(base + '.csv', 'w', newline='') as f:
    w = csv.DictWriter(f, fieldnames=FIELDS)
    w.writeheader()
    w.writerows(rows)
  text = markdown(rows, results, args, baseline)
  with open(base + '.md', 'w') as f:
    f.write(text)
  plot(rows, base + '.png')
  print(text)
  print(f'wrote {base}.csv, .md and .png')
