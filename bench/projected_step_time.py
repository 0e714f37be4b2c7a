"""Projected step time from the alpha-beta model (SCAPE paper, Equation 1).

    T_ring-all-reduce = 2 (N-1) [alpha + beta W/N]
    T_ring-all-gather =   (N-1) [alpha + beta W/N]   (W: the gathered buffer)

alpha is the per-message latency, beta = 1 / bandwidth. The collectives, with
their buffer sizes and counts, are the MEASURED ones of the compiled train step
(rows of `docs/bench/comm_volume.json`, written by bench/comm_volume.py); for a
collective executed `count` times the time is count * steps * alpha +
bytes_sent * beta, with steps = 2(N-1) for an all-reduce and (N-1) for an
all-gather or reduce-scatter.

The compute time (forward + backward of one worker's micro-batch) is, in order
of precedence: `--compute-ms` (e.g. a GPU measurement); a FLOP estimate
6 * params * tokens / (`--effective-tflops`); or, by default, a MEASUREMENT ON
THIS MACHINE'S CPU of the jitted forward+backward of the model at
`--micro-batch` x `--seq-len` tokens (slow: a CPU, not a GPU).

Two step times per method:
  no overlap     compute + every collective, one after the other (the
                 conservative case; dense methods get no bucketed overlap either)
  mask overlap   max(compute, T_all-gather) + the rest: the mask all-gather
                 hidden behind forward/backward, as SCAPE's one-step-delayed
                 mask allows (it depends only on the step's inputs)
The optimizer's own computation (bench/optimizer_overhead.py) is not included.

  python bench/projected_step_time.py --model llama500m --workers 32
  python bench/projected_step_time.py --model llama1.8b --workers 32 \\
      --effective-tflops 400 --tokens-per-worker 65536
"""

import argparse
import csv
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import cli_types  # noqa: E402

OUT = os.path.join(ROOT, 'docs', 'bench')
# (name, bandwidth in Gb/s, alpha in microseconds).
# 400 Gb/s NDR InfiniBand is the paper's cluster (TACC Vista).
NETWORKS = (
    ('400 Gb/s IB NDR', 400.0, 5.0),
    ('100 Gb/s Ethernet', 100.0, 20.0),
    ('10 Gb/s Ethernet', 10.0, 50.0),
    ('1 Gb/s Ethernet', 1.0, 50.0),
)
METHODS = (('adams', None, None), ('adamw', None, None),
           ('scape', 0.1, 'bitmap'), ('scape', 0.1, 'auto'),
           ('scape', 0.01, 'bitmap'), ('scape', 0.01, 'auto'))
STEPS = {'all-reduce': lambda n: 2 * (n - 1), 'all-gather': lambda n: n - 1,
         'reduce-scatter': lambda n: n - 1, 'all-to-all': lambda n: n - 1,
         'collective-permute': lambda n: 1}


def comm_seconds(collectives, gbps: float, alpha_us: float) -> dict:
  """Seconds per step of each collective kind under the alpha-beta model."""
  beta = 8.0 / (gbps * 1e9)  # Seconds per byte.
  out = {}
  for c in collectives:
    if c['count'] is None:
      raise ValueError(f'collective {c["name"]} has an unknown count')
    n = c['group_size']
    messages = c['count'] * STEPS[c['kind']](n) if n > 1 else 0
    t = messages * alpha_us * 1e-6 + c['bytes_sent'] * beta
    out[c['kind']] = out.get(c['kind'], 0.0) + t
  return out


def step_times(collectives, compute_s: float, gbps: float,
               alpha_us: float) -> tuple:
  """(no overlap, mask all-gather overlapped) step seconds, and the comm
  seconds by kind."""
  per_kind = comm_seconds(collectives, gbps, alpha_us)
  total = sum(per_kind.values())
  gather = per_kind.get('all-gather', 0.0)
  return (compute_s + total, max(compute_s, gather) + total - gather,
          per_kind)


def messages_table(rows) -> str:
  """Per method and collective kind: executions, ring messages, MB sent."""
  lines = ['| method | collective | dtype | buffer MB | executions | ring '
           'messages | MB sent per device |', '|' + '---|' * 7]
  for r in rows:
    for c in r['collectives']:
      n = c['group_size']
      lines.append(
          f'| {label(r)} | {c["kind"]} (N={n}) | {c["dtype"]} | '
          f'{c["bytes"] / 1e6:.3f} | {c["count"]} | '
          f'{c["count"] * STEPS[c["kind"]](n)} | {c["bytes_sent"] / 1e6:.3f} |')
  return '\n'.join(lines)


def cpu_compute_seconds(model: str, micro_batch: int, seq_len: int,
                        repeats: int = 5) -> float:
  """Median wall time of a jitted forward+backward on this CPU (fp32 params,
  bf16 compute, the trainer's loss), one device, no communication."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  import models
  from scape_jax.train import step as step_lib
  cfg = models.get_config(model)
  graphdef, state = nnx.split(models.build(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  tokens = jnp.zeros((micro_batch, seq_len), jnp.int32)

  @jax.jit
  def fwd_bwd(state, tokens):
    def loss(s):
      logits = nnx.merge(graphdef, s)(tokens)
      return step_lib.cross_entropy(logits, tokens)
    return jax.value_and_grad(loss)(state)

  jax.block_until_ready(fwd_bwd(state, tokens))  # Compile and warm up.
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fwd_bwd(state, tokens))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def find_rows(rows, model: str, n: int) -> list:
  found = []
  for method, density, encoding in METHODS:
    for r in rows:
      if (r['model'], r['N'], r['method']) == (model, n, method) and (
          r['density'] == density and r['encoding'] == encoding):
        found.append(r)
        break
    else:
      raise SystemExit(f'no row for {model} N={n} {method} {density} '
                       f'{encoding} in the comm_volume JSON; run '
                       f'bench/comm_volume.py --models {model} --workers {n}')
  return found


def label(r) -> str:
  if r['method'] != 'scape':
    return r['method']
  return f'scape d={r["density"]:g} {r["encoding"]}'


def compute_time(args, params: int) -> tuple:
  """(seconds per step, where the number comes from, a file tag)."""
  if args.compute_ms is not None:
    compute_s, source, tag = args.compute_ms / 1e3, (
        f'given: --compute-ms {args.compute_ms:g}'), 'given'
  elif args.effective_tflops is not None:
    if not args.tokens_per_worker:
      raise SystemExit('--effective-tflops needs --tokens-per-worker')
    compute_s = 6.0 * params * args.tokens_per_worker / (
        args.effective_tflops * 1e12)
    source = (f'FLOP estimate 6 * {params:,} params * '
              f'{args.tokens_per_worker:,} tokens / {args.effective_tflops:g}'
              ' TFLOP/s (an assumption, not a measurement)')
    tag = 'flops'
  else:
    compute_s = cpu_compute_seconds(args.model, args.micro_batch, args.seq_len)
    source = (f'MEASURED ON CPU ({os.cpu_count()} cores): jitted forward+'
              f'backward, {args.micro_batch} x {args.seq_len} tokens')
    tag = 'cpu'
  return compute_s, source, tag


def _arguments(argv) -> tuple:
  """(parsed arguments, the comm_volume rows of --model at --workers)."""
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--model', default='llama500m')
  p.add_argument('--workers', type=cli_types.positive_int, default=32)
  p.add_argument('--comm-json',
                 default=os.path.join(OUT, 'comm_volume.json'))
  p.add_argument('--compute-ms', type=cli_types.non_negative_float,
                 default=None,
                 help='forward+backward time per step, e.g. measured on a GPU')
  p.add_argument('--effective-tflops', type=cli_types.positive_float,
                 default=None,
                 help='FLOP estimate: 6 * params * tokens / this')
  p.add_argument('--tokens-per-worker', type=cli_types.positive_int,
                 default=None)
  p.add_argument('--micro-batch', type=cli_types.positive_int, default=1)
  p.add_argument('--seq-len', type=cli_types.positive_int, default=128)
  p.add_argument('--tag', default=None, help='output file suffix')
  p.add_argument('--out', default=OUT)
  args = p.parse_args(argv)
  cli_types.check_out_dir(p, args.out)
  if not os.path.isfile(args.comm_json):
    p.error(f'--comm-json {args.comm_json!r}: no such file; '
            'bench/comm_volume.py writes it')
  with open(args.comm_json) as f:
    data = json.load(f)
  there = sorted({r['model'] for r in data['rows']})
  if args.model not in there:
    p.error(f'--model {args.model!r}: {args.comm_json} has rows for '
            f'{", ".join(there)}; bench/comm_volume.py --models NAME adds a '
            "preset's rows (models.PRESETS)")
  return args, find_rows(data['rows'], args.model, args.workers)


def project(args, rows, compute_s: float, source: str) -> tuple:
  """(a record per network and method, the markdown table's lines)."""
  out, lines = [], [
      '| network (alpha) | method | all-reduce ms | all-gather ms | step ms, '
      'no overlap | speed-up vs AdamS | step ms, mask overlap | speed-up vs '
      'AdamS |', '|' + '---|' * 8]
  for net, gbps, alpha in NETWORKS:
    base = None
    for r in rows:
      t_no, t_ov, kinds = step_times(r['collectives'], compute_s, gbps, alpha)
      if r['method'] == 'adams':
        base = (t_no, t_ov)
      rec = {'model': args.model, 'N': args.workers, 'network': net,
             'gbps': gbps, 'alpha_us': alpha, 'method': label(r),
             'bytes_sent': r['measured_bytes'], 'compute_ms': 1e3 * compute_s,
             'allreduce_ms': 1e3 * kinds.get('all-reduce', 0.0),
             'allgather_ms': 1e3 * kinds.get('all-gather', 0.0),
             'comm_ms': 1e3 * sum(kinds.values()),
             'step_ms_no_overlap': 1e3 * t_no,
             'speedup_no_overlap': base[0] / t_no,
             'step_ms_mask_overlap': 1e3 * t_ov,
             'speedup_mask_overlap': base[1] / t_ov, 'compute_source': source}
      out.append(rec)
      lines.append(
          f'| {net} ({alpha:g} us) | {rec["method"]} | '
          f'{rec["allreduce_ms"]:.2f} | {rec["allgather_ms"]:.2f} | '
          f'{rec["step_ms_no_overlap"]:.1f} | '
          f'{rec["speedup_no_overlap"]:.2f}x | '
          f'{rec["step_ms_mask_overlap"]:.1f} | '
          f'{rec["speedup_mask_overlap"]:.2f}x |')
  return out, lines


def main(argv=None):
  args, rows = _arguments(argv)
  params = rows[0]['params']
  compute_s, source, tag = compute_time(args, params)
  tag = args.tag or f'{args.model}_N{args.workers}_{tag}'
  print(f'{args.model}, N={args.workers}, {params:,} params; compute '
        f'{1e3 * compute_s:.1f} ms per step ({source}).')
  print('Bytes and message counts: the measured collectives of the compiled '
        f'train step ({args.comm_json}). Ring alpha-beta model; no overlap of '
        'communication with compute except the mask all-gather in the '
        '"mask overlap" columns.\n')
  print(messages_table(rows) + '\n')
  out, lines = project(args, rows, compute_s, source)
  print('\n'.join(lines))
  path = os.path.join(args.out, f'projected_step_time_{tag}')
  with open(path + '.csv', 'w', newline='') as f:
    w = csv.DictWriter(f, fieldnames=list(out[0]))
    w.writeheader()
    w.writerows(out)
  command = ' '.join(['python', 'bench/projected_step_time.py'] + (
      sys.argv[1:] if argv is None else argv))
  with open(path + '.md', 'w') as f:
    f.write(f'<!-- {command} -->\n{args.model}, N={args.workers}, compute '
            f'{1e3 * compute_s:.1f} ms per step: {source}.\n\n'
            + messages_table(rows) + '\n\n' + '\n'.join(lines) + '\n')
  print(f'\nwrote {path}.csv and .md')
  return out


if __name__ == '__main__':
  main()
