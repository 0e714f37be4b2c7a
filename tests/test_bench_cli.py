"""The bench scripts' command lines, run as a user runs them: a bad value is a
usage error (exit 2, naming the option and the value) before any work, never
a traceback after minutes of compiling, a silent default or an empty table."""

from tests import bench_scripts

# (script, argv, what stderr says). {file} is a regular file, {missing} a
# path that does not exist. One case per kind of check and script.
USAGE_ERRORS = [
    ('optimizer_overhead', ['--repeats', '0'],
     'argument --repeats: 0: must be an integer >= 1'),
    ('optimizer_overhead', ['--number', '1.5'], "'1.5' is not an integer"),
    ('optimizer_overhead', ['--densities', '0'], 'density 0.0: must be in'),
    ('optimizer_overhead', ['--densities', 'abc'], "'abc' is not a number"),
    ('optimizer_overhead', ['--selects', 'radix'], 'invalid choice'),
    # Checked before compiling (it ended a run's hour with a traceback).
    ('optimizer_overhead', ['--quick', '--out', '{file}/x'],
     'cannot create it'),
    ('comm_volume', ['--out', '{file}/x'], 'cannot create it'),
    ('comm_volume', ['--no-outer', '--outer-only'],
     'not allowed with argument --no-outer'),
    ('comm_volume', ['--outer-only', '--workers', '4'],
     'nothing to measure: --outer-only needs'),
    ('comm_volume', ['--models', 'bogus', '--workers', '2', '--methods',
                     'adamw'], "unknown model 'bogus'"),
    ('comm_volume', ['--models', 'llama-tiny', '--workers', '64',
                     '--methods', 'adamw'], '--workers 64: at most 32'),
    ('projected_step_time', ['--compute-ms', '-50'],
     'argument --compute-ms: -50.0: must be >= 0'),
    ('projected_step_time', ['--compute-ms', 'nan'], 'must be finite'),
    ('projected_step_time', ['--effective-tflops', '0',
                             '--tokens-per-worker', '1000'],
     'argument --effective-tflops: 0.0: must be > 0'),
    ('projected_step_time', ['--compute-ms', '1', '--comm-json',
                             '{missing}'], 'no such file'),
    ('fcdp_volume', ['--models', 'bogus'], "invalid choice: 'bogus'"),
    ('memory_table', ['--configs', 'bogus', '--no-compile'],
     'no configs/bogus.py; allowed: gpt345m'),
    ('eval_downstream', ['--run', '{missing}', '--limit', '0'],
     'leave --limit out for every example'),
    ('convergence', ['--steps', '0'], 'argument --steps'),
    ('netlab', ['sample', '--out', '{missing}', '--interval', '-1', 'lo'],
     'argument --interval'),
    ('network', ['--set', 'optimzer.lr=1'], "unknown config key 'optimzer'"),
    ('network', ['--workers', '1'], '--workers 1: at least 2'),
    ('network', ['--warmup', '-3'], 'argument --warmup: -3: must be an '
     'integer >= 0'),
    ('network', ['--workers', '3', '--methods', 'DiLoCo'],
     'do not split into mesh.replica=2'),
    ('first_step', ['--profile', '{missing}'], 'neither a config file nor'),
    ('first_step', ['--read-only'], '--read-only: only with --profile'),
    ('first_step', ['--set', 'model.scan_layers=true'],
     '--set: only with --profile'),
]


def test_bad_values_are_usage_errors(tmp_path):
  """Every case of USAGE_ERRORS, each in its own directory (one subprocess
  runs them all, `bench_scripts.run_many`)."""
  cases, dirs = [], []
  for i, (script, argv, _) in enumerate(USAGE_ERRORS):
    d = tmp_path / str(i)
    d.mkdir()
    (d / 'a_file').write_text('')
    fill = {'file': str(d / 'a_file'), 'missing': str(d / 'missing')}
    cases.append((script, [a.format(**fill) for a in argv], d))
    dirs.append(d)
  results = bench_scripts.run_many(cases)
  for (script, argv, message), d, (code, stderr) in zip(USAGE_ERRORS, dirs,
                                                        results):
    case = f'{script} {argv}: exit {code}\n{stderr[-2000:]}'
    assert code == 2, case
    assert message in stderr, case
    assert 'Traceback' not in stderr, case
    assert not (d / 'missing').exists(), case  # nothing was written
