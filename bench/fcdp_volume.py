"""Inter- and intra-node bytes per step under ZeRO-3 and FCDP, and memory.

The mesh is 2 nodes x 4 devices: mesh.data=1, mesh.fsdp=8, mesh.nodes=2 (8
simulated CPU devices; the 'node' axis spans the nodes, 'fsdp' the devices
of one node). For each variant the REAL train step (`trainer.build_program`,
`Program.compile_step`) is compiled from abstract shapes and its collectives
are read from the optimized HLO (`scape_jax.analysis`):

* by pass, from JAX's op_name (`analysis.traffic.phase`): forward, backward
  (where ZeRO-3 gathers every unit a second time), update;
* by link level, from the replica groups: a collective whose groups span the
  'node' axis is inter-node, one that spans 'fsdp' only is intra-node. Its
  bytes are the ring bytes each device sends (`Collective.bytes_sent`). The
  `boundary` column is the smaller count of what crosses a node boundary for
  a topology-aware ring (`analysis.traffic.boundary_bytes`).

Variants: full fine-tuning (ZeRO-3; FCDP host cache, hierarchical, both) and
LoRA (rank 16 on the attention projections, as in the paper's Section V-D:
ZeRO-3; host cache, hierarchical, LoRA-aware each alone; all three). A
data-parallel run on the same 8 devices is the reference for memory.

Memory per device: the compiled step's `memory_analysis()` (on the CPU one
memory: the FCDP host cache is counted there too) and the host cache the
program asks for (`analysis.host_argument_bytes` of the parameters kept in
'pinned_host' + `analysis.offloaded_bytes` of the step's jaxpr).

  python bench/fcdp_volume.py                        # gpt345m, the table
  python bench/fcdp_volume.py --models gpt-tiny --out /tmp/fcdp   # quick
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
if 'jax' not in sys.modules:  # Scripts only; tests set their own devices.
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  _flags = os.environ.get('XLA_FLAGS', '')
  if 'xla_force_host_platform_device_count' not in _flags:
    _flags += ' --xla_force_host_platform_device_count=8'
  os.environ['XLA_FLAGS'] = _flags.strip()

import jax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cli_types  # noqa: E402

import models  # noqa: E402
from scape_jax import analysis  # noqa: E402
from scape_jax import train as trainer  # noqa: E402
from scape_jax.analysis import traffic  # noqa: E402
from scape_jax.train import config as config_lib  # noqa: E402

MODELS = ('gpt345m',)
NODES, PER_NODE = 2, 4
INTRA_AXES = ('fsdp',)  # mesh axes inside one node
LORA_RANK = 16
# The attention projections of each family (the paper's LoRA targets).
LORA_TARGETS = {'gpt': 'c_attn,attn.c_proj',
                'llama': 'q_proj,k_proj,v_proj,o_proj'}
HOST = '--config.fcdp.host_cache=true'
HIER = '--config.fcdp.hierarchical=true'
AWARE = '--config.fcdp.lora_aware=true'
# (name, workload, overrides)
VARIANTS = (
    ('data parallel', 'full', ('--config.mesh.data=8', '--config.mesh.fsdp=1',
                               '--config.mesh.nodes=1')),
    ('ZeRO-3', 'full', ()),
    ('FCDP host cache', 'full', (HOST,)),
    ('FCDP hierarchical', 'full', (HIER,)),
    ('FCDP host cache + hierarchical', 'full', (HOST, HIER)),
    ('ZeRO-3', 'lora', ()),
    ('FCDP host cache', 'lora', (HOST,)),
    ('FCDP hierarchical', 'lora', (HIER,)),
    ('FCDP LoRA-aware', 'lora', (AWARE,)),
    ('FCDP all three', 'lora', (HOST, HIER, AWARE)),
)
# What the paper claims for each switch (shared/papers/fcdp.txt), and how the
# row's HLO figures are checked against it (see `claim_holds`).
CLAIMS = {
    HOST: 'backward inter-node all-gather eliminated (Sec. IV-C: inter-node '
          'all-gather -50%)',
    HIER: 'gathers cross nodes once (over the node axis), then run inside '
          'the node',
    AWARE: 'frozen weights not re-gathered: only the adapters cross nodes '
           '(Sec. IV-E: >99% less)',
}
FAST_BACKEND_FLAG = '--xla_backend_optimization_level=0'  # see comm_volume.py
OUT = os.path.join(ROOT, 'docs', 'bench')
MB = 1e6


def make_config(model: str, workload: str, overrides, seq_len: int = 128):
  over = [f'--config.model.preset={model}', '--config.model.remat=true',
          '--config.optimizer.name=adamw', f'--config.data.seq_len={seq_len}',
          f'--config.data.batch_size={NODES * PER_NODE}',
          '--config.mesh.data=1', f'--config.mesh.fsdp={NODES * PER_NODE}',
          f'--config.mesh.nodes={NODES}']
  if workload == 'lora':
    family = models.get_config(model).family
    over += [f'--config.model.lora.targets={LORA_TARGETS[family]}',
             f'--config.model.lora.rank={LORA_RANK}']
  return config_lib.load(None, over + list(overrides))


def measure(cfg) -> dict:
  """Compiles the step; bytes by (pass, kind, level) and memory."""
  program = trainer.build_program(cfg)
  t0 = time.perf_counter()
  traced = program.trace_step(cfg.steps)
  compiled = program.compile_step(cfg.steps, traced, run=False)
  seconds = time.perf_counter() - t0
  cols = analysis.collectives_from_hlo(compiled.as_text())
  shape = list(program.mesh.shape.items())
  mem = compiled.memory_analysis()
  trainable = program.layout.split(program.abstract_params)[0]
  return {
      'params': trainer.param_count(program),
      'trainable': sum(x.size for x in jax.tree.leaves(trainable)),
      'bytes': {'/'.join(k): v for k, v in traffic.breakdown(
          cols, shape, INTRA_AXES).items()},
      'complete': all(c.count is not None for c in cols),
      'inter_all_gather_axes': sorted({
          ','.join(traffic.spanned_axes(c.groups, shape)) for c in cols
          if c.kind == 'all-gather' and traffic.level(
              c, shape, INTRA_AXES) == 'inter'}),
      'device_bytes': (mem.argument_size_in_bytes + mem.output_size_in_bytes +
                       mem.temp_size_in_bytes - mem.alias_size_in_bytes),
      'temp_bytes': mem.temp_size_in_bytes,
      'host_compiled_bytes': (mem.host_argument_size_in_bytes +
                              mem.host_temp_size_in_bytes),
      'host_params_bytes': analysis.host_argument_bytes(
          program.abstract_params),
      'host_offload_bytes': analysis.offloaded_bytes(traced.jaxpr),
      'compile_s': seconds,
  }


def _get(row, *key) -> float:
  return row['bytes'].get('/'.join(key), 0.0)


def figures(row) -> dict:
  """The table's columns (bytes per device per step)."""
  f = {}
  for p in ('forward', 'backward'):
    for lv in traffic.LEVELS:
      f[f'{p}_ag_{lv}'] = _get(row, p, 'all-gather', lv)
  for lv in traffic.LEVELS:
    f[f'rs_{lv}'] = sum(_get(row, p, 'reduce-scatter', lv)
                        for p in traffic.PHASES)
    f[f'other_{lv}'] = sum(_get(row, p, k, lv) for p in traffic.PHASES
                           for k in ('all-reduce', 'all-to-all',
                                     'collective-permute'))
    f[lv] = sum(v for k, v in row['bytes'].items()
                if k.split('/')[0] in traffic.PHASES and k.endswith(lv))
  f['boundary'] = sum(v for k, v in row['bytes'].items()
                      if k.startswith('boundary/'))
  return f


def claim_holds(row, baseline) -> str:
  """Checks each switch's claim on the HLO figures ('yes'/'NO' per claim)."""
  f, base = figures(row), figures(baseline)
  out = []
  if HOST in row['overrides']:
    ok = f['backward_ag_inter'] == 0 and base['backward_ag_inter'] > 0
    out.append(f'bwd inter-node AG = 0: {"yes" if ok else "NO"}')
  if HIER in row['overrides']:
    ok = row['inter_all_gather_axes'] in ([], ['node'])
    out.append(f'inter-node AGs span only node: {"yes" if ok else "NO"}')
  if AWARE in row['overrides']:
    # Only the adapters cross nodes: the inter-node AG bytes are at most
    # those of gathering every trainable element twice over 8 devices.
    bound = 2 * 4 * row['trainable'] * 7 / 8
    ok = f['forward_ag_inter'] + f['backward_ag_inter'] <= bound
    out.append(f'inter-node AG <= adapters\' size: {"yes" if ok else "NO"}')
  return '; '.join(out)


def markdown(rows) -> str:
  head = ('| model | workload | variant | fwd AG inter | fwd AG intra | '
          'bwd AG inter | bwd AG intra | RS inter | RS intra | other inter | '
          'inter total | intra total | inter vs ZeRO-3 | across node '
          'boundary | paper\'s claim | holds in the HLO |\n' +
          '|' + '---|' * 16)
  lines = [head]
  for r in rows:
    if r['variant'] == 'data parallel':
      continue  # its one all-reduce spans 'data': no node structure to split
    f = r['figures']
    base = r['baseline_inter']
    ratio = f'{f["inter"] / base:.3f}x' if base else ''
    mb = lambda v: f'{v / MB:.3f}'  # noqa: E731
    lines.append(
        f'| {r["model"]} | {r["workload"]} | {r["variant"]} | '
        f'{mb(f["forward_ag_inter"])} | {mb(f["forward_ag_intra"])} | '
        f'{mb(f["backward_ag_inter"])} | {mb(f["backward_ag_intra"])} | '
        f'{mb(f["rs_inter"])} | {mb(f["rs_intra"])} | '
        f'{mb(f["other_inter"])} | {mb(f["inter"])} | {mb(f["intra"])} | '
        f'{ratio} | {mb(f["boundary"])} | {r["claim"]} | {r["holds"]} |')
  return '\n'.join(lines)


def memory_markdown(rows) -> str:
  gib = 2.0**30
  lines = ['| model | workload | variant | device GiB (compiled, CPU) | '
           'temporaries GiB | host cache GiB | of which parameters kept on '
           'host | of which offloaded by the step |', '|' + '---|' * 8]
  for r in rows:
    m = r['measured']
    host = m['host_params_bytes'] + m['host_offload_bytes']
    lines.append(
        f'| {r["model"]} | {r["workload"]} | {r["variant"]} | '
        f'{m["device_bytes"] / gib:.3f} | {m["temp_bytes"] / gib:.3f} | '
        f'{host / gib:.3f} | {m["host_params_bytes"] / gib:.3f} | '
        f'{m["host_offload_bytes"] / gib:.3f} |')
  return '\n'.join(lines)


def run(models, variants=VARIANTS) -> list:
  rows = []
  for model in models:
    baselines = {}
    for name, workload, overrides in variants:
      m = measure(make_config(model, workload, overrides))
      row = {'model': model, 'workload': workload, 'variant': name,
             'overrides': list(overrides), 'measured': m}
      row['bytes'] = m['bytes']
      row['trainable'] = m['trainable']
      row['inter_all_gather_axes'] = m['inter_all_gather_axes']
      if name == 'ZeRO-3':
        baselines[workload] = row
      row['figures'] = figures(row)
      print(f'{model} {workload:4s} {name:32s} inter '
            f'{row["figures"]["inter"] / MB:10.3f} MB  intra '
            f'{row["figures"]["intra"] / MB:10.3f} MB  compile '
            f'{m["compile_s"]:.0f} s', flush=True)
      rows.append(row)
    for row in rows:
      if row['model'] != model:
        continue
      base = baselines.get(row['workload'])
      row['baseline_inter'] = base['figures']['inter'] if base else None
      row['claim'] = '; '.join(CLAIMS[o] for o in row['overrides']
                               if o in CLAIMS) or (
                                   'baseline: every unit gathered in the '
                                   'forward and again in the backward pass'
                                   if row['variant'] == 'ZeRO-3' else '')
      row['holds'] = claim_holds(row, base) if base else ''
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--models', nargs='+', default=list(MODELS),
                 choices=sorted(models.PRESETS))
  p.add_argument('--out', default=OUT)
  p.add_argument('--full-backend-opt', action='store_true',
                 help=f'do not add {FAST_BACKEND_FLAG} (compiles slower)')
  args = p.parse_args(argv)
  cli_types.check_out_dir(p, args.out)
  if not args.full_backend_opt and 'backend_optimization' not in (
      os.environ['XLA_FLAGS']):
    os.environ['XLA_FLAGS'] += ' ' + FAST_BACKEND_FLAG
  t0 = time.perf_counter()
  rows = run(args.models)
  command = ' '.join(['python', 'bench/fcdp_volume.py'] +
                     (sys.argv[1:] if argv is None else list(argv)))
  meta = {'command': command, 'jax': jax.__version__,
          'xla_flags': os.environ['XLA_FLAGS'], 'mesh': '2 nodes x 4',
          'seq_len': 128, 'batch_size': 8, 'mb': MB,
          'wall_s': time.perf_counter() - t0}
  with open(os.path.join(args.out, 'fcdp_volume.json'), 'w') as f:
    json.dump({'meta': meta, 'rows': rows}, f, indent=1)
  text = (f'<!-- {command} -->\n{markdown(rows)}\n\n'
          f'{memory_markdown(rows)}\n')
  with open(os.path.join(args.out, 'fcdp_volume.md'), 'w') as f:
    f.write(text)
  print('\n' + text)
  incomplete = [r['variant'] for r in rows if not r['measured']['complete']]
  if incomplete:
    print(f'WARNING: collectives with unknown count in {incomplete}')
  return rows


if __name__ == '__main__':
  main()
