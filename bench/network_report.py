"""Tables, acceptance checks, the alpha-beta projection and the plot for
bench/network.py's measurements (docs/bench/network.{csv,md,png})."""

import csv
import math
import os
import statistics

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
    'timed_steps', 'step_ms', 'step_ms_min', 'step_ms_max', 'ref_step_ms',
    'vs_reference', 'speedup_vs_baseline', 'hlo_bytes', 'kernel_tx_bytes',
    'kernel_tx_frames', 'kernel_payload_bytes', 'payload_vs_hlo',
    'payload_minus_hlo_bytes', 'kernel_rx_bytes', 'qdisc_drops',
    'proj_step_ms', 'proj_step_ms_mask_overlap', 'proj_step_ms_nominal',
    'final_loss')


def _collective_dicts(cols) -> list:
  return [{'kind': c.kind, 'count': c.count, 'group_size': c.group_size,
           'bytes_sent': c.bytes_sent, 'name': c.name} for c in cols]


def project(cols, compute_s: float, mbit: float, one_way_ms: float) -> tuple:
  """(no overlap, mask all-gather overlapped) step seconds, alpha-beta."""
  if not (compute_s > 0 and mbit > 0):
    return math.nan, math.nan
  no_overlap, overlap, _ = projection.step_times(
      _collective_dicts(cols), compute_s, mbit / 1000, 1e3 * one_way_ms)
  return no_overlap, overlap


def job_row(link: netlab.Link, probe: dict, label: str, job: dict,
            ref: dict, args) -> dict:
  """One CSV row: what a (link, method) job measured, and its projection."""
  workers = job['per_worker']
  mean = lambda key: statistics.fmean(w[key] for w in workers)  # noqa: E731
  payload = mean('payload')
  ref_s = ref['step_s'] if ref else math.nan
  one_way_ms = probe['rtt_ms'] / 2
  proj, proj_overlap = project(job['collectives'], ref_s, probe['mbit'],
                               one_way_ms)
  nominal = math.nan
  if link.rate_mbit is not None:  # the profile as specified, delay included
    nominal = project(job['collectives'], ref_s, link.rate_mbit,
                      one_way_ms + (0 if probe['delay_applied']
                                    else link.delay_ms))[0]
  return {
      'link': link.name, 'rate_mbit': link.rate_mbit or '',
      'delay_ms': link.delay_ms, 'delay_applied': probe['delay_applied'],
      'rtt_ms': probe['rtt_ms'], 'goodput_mbit': probe['mbit'],
      'method': label, 'workers': args.workers,
      'per_worker_batch': args.per_worker_batch,
      'seq_len': args.shared['data.seq_len'],
      'timed_steps': job['timed_steps'], 'step_ms': 1e3 * job['step_s'],
      'step_ms_min': 1e3 * job['step_s_min'],
      'step_ms_max': 1e3 * job['step_s_max'], 'ref_step_ms': 1e3 * ref_s,
      'vs_reference': job['step_s'] / ref_s, 'speedup_vs_baseline': math.nan,
      'hlo_bytes': job['hlo_bytes'], 'kernel_tx_bytes': mean('tx_bytes'),
      'kernel_tx_frames': mean('tx_frames'), 'kernel_payload_bytes': payload,
      'payload_vs_hlo': payload / job['hlo_bytes'] - 1 if job['hlo_bytes']
                        else math.nan,
      'payload_minus_hlo_bytes': payload - job['hlo_bytes'],
      'kernel_rx_bytes': mean('rx_bytes'),
      'qdisc_drops': sum(q['drops'] for q in job['qdisc']),
      'proj_step_ms': 1e3 * proj, 'proj_step_ms_mask_overlap': 1e3 * proj_overlap,
      'proj_step_ms_nominal': 1e3 * nominal, 'final_loss': job['final_loss']}


def reference_row(label: str, ref: dict, args) -> dict:
  row = dict.fromkeys(FIELDS, '')
  row.update(link='none (N=1)', method=label, workers=1,
             per_worker_batch=args.per_worker_batch,
             seq_len=args.shared['data.seq_len'],
             timed_steps=args.steps - args.warmup, step_ms=1e3 * ref['step_s'],
             step_ms_min=1e3 * ref['step_s_min'],
             step_ms_max=1e3 * ref['step_s_max'], ref_step_ms=1e3 * ref['step_s'],
             vs_reference=1.0, hlo_bytes=0, final_loss=ref['final_loss'])
  return row


def build_rows(results: dict, args, profiles: dict, baseline: str) -> list:
  rows = []
  for (name, label), job in results['jobs'].items():
    rows.append(job_row(profiles[name], results['links'][name], label, job,
                        results['reference'].get(label), args))
  base = {r['link']: r['step_ms'] for r in rows if r['method'] == baseline}
  for r in rows:
    r['speedup_vs_baseline'] = base.get(r['link'], math.nan) / r['step_ms']
  rows += [reference_row(label, ref, args)
           for label, ref in results['reference'].items()]
  return rows


# ----------------------------------------------------------------------------
# Acceptance and the decomposition of SCAPE's step.


def _find(rows, link, method):
  return next((r for r in rows if r['link'] == link and r['method'] == method),
              None)


def acceptance(rows: list, baseline: str) -> list:
  """Markdown lines: issue 11's checks, computed from the rows."""
  lines = []
  sparse, base = _find(rows, SLOW_LINK, SPARSE), _find(rows, SLOW_LINK,
                                                       baseline)
  if sparse and base:
    ok = sparse['speedup_vs_baseline'] >= MIN_SPEEDUP
    lines.append(f'- {SPARSE} vs {baseline} at {SLOW_LINK}: '
                 f'{sparse["speedup_vs_baseline"]:.2f}x per step (needs >= '
                 f'{MIN_SPEEDUP:g}x): **{"met" if ok else "not met"}**.')
    ratio = sparse['vs_reference']
    if not math.isnan(ratio):
      ok = ratio <= MAX_VS_REFERENCE
      lines.append(f'- {SPARSE} at {SLOW_LINK} vs its no-communication step: '
                   f'{ratio:.2f}x (needs <= {MAX_VS_REFERENCE:g}x): '
                   f'**{"met" if ok else "not met"}**.')
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
        f'framing per step: **{"met" if not bad else "not met"}**'
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
  """Where SCAPE d=0.01's step goes at the slow link, from measurements."""
  sparse = _find(rows, SLOW_LINK, SPARSE)
  base_ref = _find(rows, 'none (N=1)', baseline)
  sparse_ref = _find(rows, 'none (N=1)', SPARSE)
  if not (sparse and base_ref and sparse_ref):
    return []
  compute = base_ref['step_ms']
  optimizer = sparse_ref['step_ms'] - compute
  comm = sparse['step_ms'] - sparse_ref['step_ms']
  model = sparse['proj_step_ms'] - sparse_ref['step_ms']
  return [
      f'  - where its {sparse["step_ms"]:.0f} ms go: {compute:.0f} ms '
      f'forward/backward + {baseline} update ({baseline}, N=1), '
      f'{optimizer:+.0f} ms SCAPE\'s own update (top-k, compaction, masks: '
      f'{SPARSE} N=1 minus {baseline} N=1), {comm:+.0f} ms communication '
      f'and waiting (N={sparse["workers"]} over the link minus N=1; the '
      f'alpha-beta model predicts {model:.0f} ms for its bytes on this link).']


# ----------------------------------------------------------------------------
# Outputs.


def _fmt(v, digits=1):
  if isinstance(v, float):
    return '' if math.isnan(v) else f'{v:,.{digits}f}'
  return str(v)


def markdown(rows: list, results: dict, args, command: str,
             baseline: str) -> str:
  links = results['links']
  lines = [
      '# Step time over rate-limited links (bench/network.py)', '',
      f'<!-- generated by `{command}`; do not edit by hand -->',
      f'Command: `{command}` ({results["seconds"] / 60:.1f} min on '
      f'{os.cpu_count()} cores).', '',
      f'{args.workers} worker processes, each in its own network namespace '
      'and with one CPU device, run `train.py` as one `jax.distributed` job '
      '(gloo collectives) over veth links to a bridge, shaped with tbf (and '
      'netem delay where the kernel has it). Model `'
      f'{args.shared["model.preset"]}` ({args.shared["model.dtype"]}), '
      f'{args.per_worker_batch} x {args.shared["data.seq_len"]} tokens per '
      f'worker per step, {args.steps} steps of which the first '
      f'{args.warmup} are not timed. Reference: the same method at N=1, '
      f'{args.workers} copies at once (the same share of the CPU as a '
      'worker). Bytes: per worker per step, counted by the kernel on its '
      f'link; payload = bytes - {netlab.HEADER_BYTES} B per frame.', '',
      '## Links (measured between workers 0 and 1)', '',
      '| link | rate | delay asked | delay applied | RTT ms | bulk goodput '
      'Mb/s |', '|---|---|---|---|---|---|']
  for name, probe in links.items():
    r = next(x for x in rows if x['link'] == name)
    lines.append(f'| {name} | {r["rate_mbit"] or "none"} | {r["delay_ms"]:g} '
                 f'ms | {"yes" if probe["delay_applied"] else "**no** (no sch_netem)"}'
                 f' | {probe["rtt_ms"]:.3f} | {probe["mbit"]:,.0f} |')
  lines += ['', '## Step time', '',
            f'| link | method | step ms (median) | min-max | vs N=1 | '
            f'speed-up vs {baseline} | alpha-beta ms | alpha-beta, nominal '
            'link ms |', '|---|---|---|---|---|---|---|---|']
  for r in rows:
    lines.append(
        f'| {r["link"]} | {r["method"]} | {_fmt(r["step_ms"], 0)} | '
        f'{_fmt(r["step_ms_min"], 0)}-{_fmt(r["step_ms_max"], 0)} | '
        f'{_fmt(r["vs_reference"], 2)} | {_fmt(r["speedup_vs_baseline"], 2)} | '
        f'{_fmt(r["proj_step_ms"], 0)} | {_fmt(r["proj_step_ms_nominal"], 0)} |')
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
  for (name, label), error in results.get('failed', {}).items():
    lines.append(f'\n**{label} on {name} failed:** `{error.splitlines()[0]}`')
  lines += ['', '## Acceptance (issue 11)', ''] + acceptance(rows, baseline)
  lines += ['', '![step time per method and link](network.png)', '']
  return '\n'.join(lines)


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
  ax.set_xticks(np.arange(len(links)), links)
  ax.set_yscale('log')
  ax.set_ylabel('median step time, ms (log)')
  ax.set_title('measured step time per link (bars), alpha-beta model (dashes)')
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write(results: dict, args, command: str, profiles: dict,
          baseline: str) -> None:
  """Writes <args.out>/network.{csv,md,png} and prints the markdown."""
  rows = build_rows(results, args, profiles, baseline)
  os.makedirs(args.out, exist_ok=True)
  base = os.path.join(args.out, 'network')
  with open(base + '.csv', 'w', newline='') as f:
    w = csv.DictWriter(f, fieldnames=FIELDS)
    w.writeheader()
    w.writerows(rows)
  text = markdown(rows, results, args, command, baseline)
  with open(base + '.md', 'w') as f:
    f.write(text)
  plot(rows, base + '.png')
  print(text)
  print(f'wrote {base}.csv, .md and .png')
