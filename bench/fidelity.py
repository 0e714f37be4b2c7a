"""The fidelity study: where SCAPE matches AdamS, why it trails at small scale.

Runs are ordinary trainer runs (`scape_jax.train.train`) of
`configs/shakespeare_llama_tiny.py` (the `make results` setup: tiny Llama,
byte-level Shakespeare, 8 simulated CPU workers) with dotted overrides. Each
run is one subprocess that writes `<out>/runs/<key>.json` (and keeps its
`metrics.jsonl`); a run whose JSON exists is skipped, so every command here
is resumable.

  python bench/fidelity.py grid [--hours 4]     # the gap grid (section 2)
  python bench/fidelity.py figures [--hours 1]  # Figures 3 and 6, the oracle,
                                                # the informed runs
  python bench/fidelity.py report               # docs/results.md + plots
  python bench/fidelity.py targets              # its targets section only,
                                                # from the runs at hand

Loss results are deterministic up to the seed; nothing here is a timing.
`report` writes the "Fidelity" section of docs/results.md and
docs/bench/fidelity_*.png from the JSON files only.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
if 'host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             ' --xla_force_host_platform_device_count=8')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cli_types  # noqa: E402

CONFIG = 'configs/shakespeare_llama_tiny.py'
# The variants of scale_by_scape the study puts beside Algorithm 1.
VARIANTS = ('fresh', 'carry', 'carry_v', 'carry_vi', 'stale', 'local',
            'local_stale', 'local_adam', 'local_adams', 'local_adam_now',
            'local_adam_meanv', 'local_adam_smoothv', 'local_adam_rotating',
            'local_adam_debiased', 'local_adam_shrunk', 'local_adam_slab',
            'local_adam_tempered', 'local_adam_leaky', 'local_adam_gain',
            'local_adam_rowshrunk', 'local_adam_shrunk+il',
            'local_adam_debiased+il')
# Study names for a variant with the input embedding's entries dealt
# round-robin over the chunks (`optimizer.scape.interleaved_leaves`,
# docs/design.md "Interleaved chunks"): name -> the library's variant.
INTERLEAVED = {'local_adam_shrunk+il': 'local_adam_shrunk',
               'local_adam_debiased+il': 'local_adam_debiased'}
SEEDS = (0, 1)


def _scape(density: float, variant: str = 'faithful') -> dict:
  out = {'optimizer.name': 'scape', 'optimizer.scape.density': density,
         'optimizer.scape.variant': INTERLEAVED.get(variant, variant)}
  if variant in INTERLEAVED:
    out['optimizer.scape.interleaved_leaves'] = 'embed_tokens'
  return out


# Methods compared at the grid points: name -> overrides.
METHODS = {
    'AdamS': {'optimizer.name': 'adams'},
    'SCAPE d=0.1': _scape(0.1),
    'SCAPE d=0.01': _scape(0.01),
    **{f'{v} d={d}': _scape(d, v) for v in VARIANTS for d in (0.1, 0.01)},
}
PROBE_SEED = 0


def method_overrides(method: str, seed: int) -> dict:
  """`METHODS[method]` for one seed. SCAPE's seed-0 runs go through the probe
  (bench/fidelity_tools.py): the same updates (tested) plus the diagnostics,
  and an extra dense all-reduce, so their bytes are not SCAPE's
  (docs/results.md, top section, has those)."""
  out = dict(METHODS[method], seed=seed)
  if out['optimizer.name'] == 'scape' and seed == PROBE_SEED:
    out['optimizer.name'] = 'probe_scape'
  return out


FAITHFUL = ('AdamS', 'SCAPE d=0.1', 'SCAPE d=0.01')
ALL = tuple(METHODS)

# Grid points, most important first (a time-bounded run finishes these
# first): (axis, value, overrides, methods). The base point is the `make
# results` setup: llama-tiny, 300 steps, lr 3e-3, b2 0.95, density warmup 50.
POINTS = [
    ('base', '', {}, ALL),
    ('b2', '0.999', {'optimizer.b2': 0.999}, ALL),
    # One worker: every worker-local quantity (the mask's scores, the
    # residual, the local variants' moments) is the whole batch's, so this
    # point separates what the workers' local view costs from what the
    # update rule costs.
    ('workers', '1', {'mesh.data': 1},
     FAITHFUL + ('local_stale d=0.1', 'local_stale d=0.01',
                 'local_adam d=0.1', 'local_adam d=0.01',
                 'local_adam_now d=0.1', 'local_adam_now d=0.01',
                 'local_adam_meanv d=0.1', 'local_adam_meanv d=0.01',
                 'local_adam_smoothv d=0.1', 'local_adam_smoothv d=0.01')),
    ('lr', '1e-3', {'optimizer.lr': 1e-3}, FAITHFUL),
    ('lr', '1e-2', {'optimizer.lr': 1e-2}, FAITHFUL),
    ('warmup', '0', {'optimizer.scape.density_warmup_steps': 0}, FAITHFUL),
    ('warmup', '150', {'optimizer.scape.density_warmup_steps': 150}, FAITHFUL),
    ('warmup', '300', {'optimizer.scape.density_warmup_steps': 300}, FAITHFUL),
    ('model', 'llama-1m', {'model.preset': 'llama-1m'}, FAITHFUL),
    ('steps', '1000', {'steps': 1000}, FAITHFUL),
    ('steps', '3000', {'steps': 3000}, FAITHFUL),
    ('model', 'llama-10m', {'model.preset': 'llama-10m'}, FAITHFUL),
    ('steps', '10000', {'steps': 10000}, FAITHFUL),
]


def run_key(overrides: dict) -> str:
  """A file name for one run: its effective overrides, sorted.

  Keys that a method ignores (SCAPE's section under AdamS) are dropped, so
  runs that are the same run share one file.
  """
  eff = {k: v for k, v in overrides.items()
         if overrides.get('optimizer.name') in ('scape', 'probe_scape') or
         not k.startswith('optimizer.scape.')}
  text = ','.join(f'{k.split(".")[-1]}={v}' for k, v in sorted(eff.items()))
  return re.sub(r'[^A-Za-z0-9_.=,+-]', '_', text)


# More seeds where two showed a seed-to-seed spread of the gap as large as
# issue 12's targets: at the base point for the methods the targets are
# judged on, and at one worker (every statistic the whole batch's) for the
# rules closest to the d = 0.01 target there.
EXTRA_SEEDS = (2, 3, 4)
EXTRA_SEED_METHODS = {
    ('base', ''): ('AdamS', 'SCAPE d=0.1', 'SCAPE d=0.01',
                   'local_adam_smoothv d=0.1', 'local_adam_smoothv d=0.01',
                   'local_adam_rotating d=0.1', 'local_adam_rotating d=0.01',
                   'local_adam_debiased d=0.1', 'local_adam_debiased d=0.01',
                   'local_adam_shrunk d=0.01',
                   'local_adam_slab d=0.1', 'local_adam_slab d=0.01',
                   'local_adam_tempered d=0.01', 'local_adam_leaky d=0.01',
                   'local_adam_shrunk+il d=0.01',
                   'local_adam_debiased+il d=0.1'),
    ('workers', '1'): ('AdamS', 'local_adam_meanv d=0.01',
                       'local_adam_smoothv d=0.01'),
}
# Ten seeds for the variant whose five-seed means were within both of issue
# 12's targets by less than their standard errors (seeds 5-9 chosen before
# any of them ran), for the best variant at each density before it, and
# for 'local_adam_tempered' (its constant chosen on seeds 1 and 4) and
# 'local_adam_leaky' at d = 0.01.
MANY_SEEDS = (5, 6, 7, 8, 9)
MANY_SEED_METHODS = {
    ('base', ''): ('AdamS', 'local_adam_slab d=0.1', 'local_adam_slab d=0.01',
                   'local_adam_debiased d=0.1', 'local_adam_shrunk d=0.01',
                   'local_adam_tempered d=0.01', 'local_adam_leaky d=0.01',
                   'local_adam_shrunk+il d=0.01'),
}
# Ten more for the best variant at each density on ten seeds, whose means
# were within their standard error (about 1 point, mostly AdamS's own
# seed-to-seed spread) of issue 12's targets: seeds 10-19 chosen before any
# of them ran; the targets are judged on all twenty, whatever they show.
MORE_SEEDS = tuple(range(10, 20))
MORE_SEED_METHODS = {
    ('base', ''): ('AdamS', 'local_adam_debiased d=0.1',
                   'local_adam_shrunk d=0.01', 'local_adam_shrunk+il d=0.01'),
}
ALL_SEEDS = SEEDS + EXTRA_SEEDS + MANY_SEEDS + MORE_SEEDS


def grid_runs() -> list:
  """[(point, method, seed, overrides)] in the order they run."""
  out = []
  for axis, value, point, names in POINTS:
    for seed in SEEDS:
      for method in names:
        out.append(((axis, value), method, seed,
                    dict(point, **method_overrides(method, seed))))
  for seeds, methods in ((EXTRA_SEEDS, EXTRA_SEED_METHODS),
                         (MANY_SEEDS, MANY_SEED_METHODS),
                         (MORE_SEEDS, MORE_SEED_METHODS)):
    for axis, value, point, _ in POINTS:
      for seed in seeds:
        for method in methods.get((axis, value), ()):
          out.append(((axis, value), method, seed,
                      dict(point, **method_overrides(method, seed))))
  return out


# ----------------------------------------------------------------------------
# One run, in its own process.


def run_one(spec: dict) -> dict:
  """Trains one run and returns its summary (called in the child process)."""
  import fidelity_tools  # pylint: disable=g-import-not-at-top
  from scape_jax import train as trainer  # pylint: disable=g-import-not-at-top
  from scape_jax.train import config as config_lib  # pylint: disable=g-import-not-at-top
  from scape_jax.train.metrics import read_jsonl  # pylint: disable=g-import-not-at-top
  fidelity_tools.register_study_methods()
  for kwargs in spec.get('register_topk', []):
    fidelity_tools.register_topk(**kwargs)
  if 'inform' in spec:
    import fidelity_information  # pylint: disable=g-import-not-at-top
    fidelity_information.inform(spec['inform'])
  if 'noise_scale' in spec:
    import fidelity_temper  # pylint: disable=g-import-not-at-top
    fidelity_temper.scale_noise(spec['noise_scale'])
  run_dir = spec['run_dir']
  shutil.rmtree(run_dir, ignore_errors=True)
  overrides = dict(spec['overrides'])
  steps = overrides.get('steps', 300)
  args = [f'--config.{k}={v}' for k, v in overrides.items()]
  args += [f'--config.out_dir={run_dir}', '--config.eval_every=0',
           f'--config.log_every={spec.get("log_every", 25)}']
  cfg = config_lib.load(CONFIG, args)
  t0 = time.time()
  summary = trainer.train(cfg)
  rows = read_jsonl(os.path.join(run_dir, 'metrics.jsonl'))
  train = [r for r in rows if r['split'] == 'train']
  shutil.rmtree(os.path.join(run_dir, 'ckpt'), ignore_errors=True)
  shutil.rmtree(os.path.join(run_dir, 'tb'), ignore_errors=True)
  return {
      'overrides': overrides, 'steps': steps,
      'eval_loss': summary['eval_loss'],
      'final_loss': (sum(summary['losses'][-10:]) /
                     len(summary['losses'][-10:])),
      'bytes_per_step': train[-1]['comm_bytes'],
      'curve': [(r['step'], r['loss']) for r in train][::max(1, steps // 300)],
      'wall_s': time.time() - t0, 'cpu_s': time.process_time(),
  }


def _claim(lock: str) -> bool:
  """Creates `lock` holding our pid; False if a live process holds it."""
  for _ in range(2):
    try:
      fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
      try:
        with open(lock) as f:
          pid = int(f.read().strip() or 0)
        if pid <= 0:  # being written, or its writer was killed before
          if time.time() - os.path.getmtime(lock) < 60:
            return False
          raise ValueError(lock)
        os.kill(pid, 0)  # still running?
        return False
      except FileNotFoundError:  # released since: try again
        continue
      except (ProcessLookupError, ValueError):
        try:
          os.remove(lock)  # left by a process that was killed
        except FileNotFoundError:  # another process removed it first
          pass
        continue
    with os.fdopen(fd, 'w') as f:
      f.write(str(os.getpid()))
    return True
  return False


def ensure(out: str, key: str, overrides: dict, deadline: float,
           **extra) -> dict | None:
  """The JSON of run `key`, running it first if it is missing.

  Returns None when the deadline has passed before the run could start or
  the run failed (its log is kept beside the JSON).
  """
  path = os.path.join(out, 'runs', key + '.json')
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  if time.time() > deadline:
    return None
  os.makedirs(os.path.dirname(path), exist_ok=True)
  if not _claim(path + '.lock'):
    return None  # another `grid`/`figures` process is running it
  spec = dict(extra, overrides=overrides, json=path,
              run_dir=os.path.join(out, 'runs', key))
  log = path[:-5] + '.log'
  t0 = time.time()
  try:
    with open(log, 'w') as f:
      proc = subprocess.run(
          [sys.executable, os.path.abspath(__file__), 'one', json.dumps(spec)],
          stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, check=False)
  finally:
    os.remove(path + '.lock')
  if proc.returncode:
    print(f'FAILED {key} (see {log})', flush=True)
    return None
  with open(path) as f:
    result = json.load(f)
  print(f'{key}: eval {result["eval_loss"]:.4f} ({time.time() - t0:.0f} s '
        f'wall, {result["cpu_s"]:.0f} s cpu)', flush=True)
  return result


def grid(out: str, hours: float, only: str, seeds: tuple) -> None:
  deadline = time.time() + hours * 3600
  for point, method, seed, overrides in grid_runs():
    if only and not re.search(only, f'{point[0]}={point[1]} {method}'):
      continue
    if seed not in seeds:
      continue
    ensure(out, run_key(overrides), overrides, deadline)


# ----------------------------------------------------------------------------
# Figures 3 and 6 and the probes.

FIG3_STEPS, FIG3_SWITCH = 600, 200
FIG6_STEPS = 600


def figure_runs() -> list:
  """[(key, overrides, extra)]: Figure 3, Figure 6 and the sparse-update
  oracle (dense AdamS information, SCAPE's density schedule, only the top-k
  of the pending updates applied per step)."""
  runs = []
  for base in ('adamw', 'adams'):
    for switch in (FIG3_SWITCH, FIG3_STEPS):  # FIG3_STEPS: never switches
      kwargs = dict(base=base, stage='gradient', density=0.1,
                    switch_step=switch)
      name = f'topk0.1_gradient_{base}_from{switch}'
      runs.append(('fig3_' + name, {'optimizer.name': name,
                                    'steps': FIG3_STEPS},
                   {'register_topk': [kwargs], 'log_every': 5}))
  runs.append(('fig6_overlap_adams', {'optimizer.name': 'overlap_adams',
                                      'steps': FIG6_STEPS}, {'log_every': 1}))
  for alt, b2, density, seed in oracle_runs():
    kwargs = dict(base='adams', stage='update', density=density,
                  warmup_steps=50, **ORACLES[alt])
    runs.append((oracle_key(density, b2, seed, alt),
                 {'optimizer.name': oracle_method(density, alt),
                  'optimizer.b2': b2, 'seed': seed},
                 {'register_topk': [kwargs]}))
  for kind, variant in INFORMED:
    for seed in SEEDS:
      for density in (0.1, 0.01):
        runs.append((informed_key(kind, density, seed, variant),
                     dict(_scape(density, variant), seed=seed),
                     {'inform': kind}))
  return runs


# The informed runs (bench/fidelity_information.py): a variant with one
# statistic of the mean gradient given to every worker, (kind, variant).
INFORMED = (('mask', 'local_adam_now'), ('v', 'local_adam_now'),
            ('mask', 'local_adam_smoothv'))


def informed_key(kind: str, density: float, seed: int,
                 variant: str = 'local_adam_now') -> str:
  rule = '' if variant == 'local_adam_now' else '-' + variant[
      len('local_adam_'):]
  return (f'informed-{kind}{rule}_d{density}' +
          (f'_seed{seed}' if seed else ''))


# The oracle ('pending') and the variations that test what it assumes: which
# k coordinates move ('current': the largest of this step's AdamS update
# alone; 'random') and how far (x2: twice the pending update).
ORACLES = {'pending': {}, 'current': {'rule': 'current'},
           'random': {'rule': 'random'}, 'x2': {'step_scale': 2.0}}


def oracle_runs() -> list:
  """[(alt, b2, density, seed)]: the oracle runs `figures` makes."""
  return [(alt, b2, density, seed) for alt in ORACLES
          for b2 in ((0.95, 0.999) if alt in ('pending', 'current')
                     else (0.95,))
          for seed in SEEDS for density in (0.1, 0.01)]


def oracle_method(density: float, alt: str = 'pending') -> str:
  """The name `fidelity_tools.register_topk` gives oracle `alt` (tested),
  without importing jax here."""
  extra = ORACLES[alt]
  return (f'topk{density:g}_update_adams_warmup50' +
          (f'_{extra["rule"]}' if 'rule' in extra else '') +
          (f'_x{extra["step_scale"]:g}' if 'step_scale' in extra else ''))


def oracle_key(density: float, b2: float, seed: int,
               alt: str = 'pending') -> str:
  return ('oracle' + ('' if alt == 'pending' else f'-{alt}') +
          f'_d{density}_b2{b2}' + (f'_seed{seed}' if seed else ''))


def figures(out: str, hours: float, only: str) -> None:
  deadline = time.time() + hours * 3600
  for key, overrides, extra in figure_runs():
    if only and not re.search(only, key):
      continue
    ensure(out, key, overrides, deadline, **extra)


def _regex(text: str):
  try:
    return re.compile(text)
  except re.error as e:
    raise argparse.ArgumentTypeError(f'{text!r} is not a regex: {e}') from None


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  sub = parser.add_subparsers(dest='cmd', required=True)
  for name in ('grid', 'figures', 'report', 'targets'):
    p = sub.add_parser(name)
    p.add_argument('--out', default='runs/fidelity')
    if name in ('grid', 'figures'):
      p.add_argument('--hours', type=cli_types.positive_float, default=4.0,
                     help='start no run after this many hours')
      p.add_argument('--only', default='', type=_regex,
                     help='regex on "axis=value method" (grid) or on the '
                     'run name (figures)')
    if name == 'grid':
      p.add_argument('--seeds', type=cli_types.seeds, default=ALL_SEEDS,
                     help='comma-separated seeds to run')
    if name in ('report', 'targets'):
      p.add_argument('--allow-fewer', action='store_true',
                     help='write docs/results.md even from fewer runs than '
                     'it was made from')
  one = sub.add_parser('one')
  one.add_argument('spec')
  args = parser.parse_args()
  if args.cmd == 'one':
    spec = json.loads(args.spec)
    result = run_one(spec)
    with open(spec['json'], 'w') as f:
      json.dump(result, f)
  elif args.cmd == 'grid':
    grid(args.out, args.hours, args.only.pattern, args.seeds)
  elif args.cmd == 'figures':
    figures(args.out, args.hours, args.only.pattern)
  elif args.cmd == 'targets':
    import fidelity_report  # pylint: disable=g-import-not-at-top
    import fidelity_variants  # pylint: disable=g-import-not-at-top
    import results_md  # pylint: disable=g-import-not-at-top
    runs = fidelity_report.load_grid(args.out)
    have = fidelity_variants.targets_runs(runs)
    before = fidelity_variants.targets_runs_in(
        fidelity_report.section_in_doc('fidelity-targets'))
    if have < before and not args.allow_fewer:
      raise SystemExit(
          f'fidelity targets: {args.out} holds {have} runs at the target '
          f'points; the section in {fidelity_report.DOC} was made from '
          f'{before}. Writing it now would lose what it shows. Copy the '
          'missing runs into --out, or pass --allow-fewer to write it '
          'anyway.')
    results_md.replace_section(
        fidelity_report.DOC, 'fidelity-targets',
        fidelity_variants.targets_section(runs, args.out))
  else:
    import fidelity_report  # pylint: disable=g-import-not-at-top
    fidelity_report.write(args.out, args.allow_fewer)


if __name__ == '__main__':
  main()
