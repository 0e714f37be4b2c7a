"""Pre-train a GPT-2 or Llama model with AdamW, AdamS or SCAPE.

  python train.py --config configs/llama500m.py [--config.KEY=VALUE ...]
  python train.py --config configs/llama500m.py --dry-run
  scape-train --config llama500m --dry-run     # a preset, from any directory

`scape-train` (installed with the package) is the same command.

Several processes (one per host or GPU) join through --coordinator,
--num-processes and --process-id, or through a cluster's environment (SLURM,
Open MPI, TPU pods, JAX_COORDINATOR_ADDRESS) with --distributed.

Running the same command again resumes from the newest checkpoint in out_dir.
One trainer at a time may use an out_dir (a lock; process 0 holds it).
Exit codes: 0 done; 2 a mistake in the config, the data or a checkpoint, an
out_dir in use by another trainer, or a write into out_dir that failed (full
disk; the message says which); 3 training diverged (max_bad_steps non-finite
steps in a row); 4 another process of a multi-process run was lost (the
message names it); 128 + N stopped by signal N (143 SIGTERM, 130 SIGINT),
after saving if it came during the train loop; a signal after the last step
lets the run finish and save (0).
"""

import argparse
import os
import sys
import traceback

EXIT_USAGE = 2  # a mistake in the config, the data or a checkpoint
EXIT_DIVERGED = 3  # max_bad_steps non-finite steps in a row
EXIT_SIGINT = 130  # 128 + SIGINT, as a shell reports Ctrl-C
JOIN_TIMEOUT_S = 300  # jax.distributed.initialize's own default


def parse_args(argv):
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--config', default=None,
                      help='a preset (llama500m, shakespeare_llama_tiny, ...: '
                      'shipped with the package) or a config file; '
                      'default: built-ins')
  parser.add_argument('--dry-run', action='store_true',
                      help='compile the train step from abstract shapes on a '
                      'mesh of the configured size and report memory')
  parser.add_argument('--coordinator', default=None,
                      help='host:port of process 0 (multi-process runs)')
  parser.add_argument('--num-processes', type=int, default=None,
                      help='how many processes join (with --coordinator)')
  parser.add_argument('--process-id', type=int, default=None,
                      help="this process's index, 0 .. num-processes - 1")
  parser.add_argument('--join-timeout', type=_seconds, default=None,
                      metavar='SECONDS',
                      help='how long the processes wait for each other to '
                      'join (default 300)')
  parser.add_argument('--heartbeat-timeout', type=_seconds, default=None,
                      metavar='SECONDS',
                      help='after how long without a heartbeat a process '
                      'whose host hangs counts as lost; the others then stop '
                      'with exit code 4 (default 60; a killed process is '
                      'seen within seconds)')
  parser.add_argument('--distributed', action='store_true',
                      help='jax.distributed.initialize() from the cluster '
                      'environment')
  parser.add_argument('--allow-config-change', action='store_true',
                      help='resume even though keys that change the '
                      'computation (lr, steps, ...) differ from the '
                      "checkpoint's config; the change is recorded")
  args, rest = parser.parse_known_args(argv)
  unknown = [a for a in rest if not a.startswith('--config.')]
  if unknown and not (len(rest) >= 2 and unknown == rest[1::2]):
    parser.error(f'unrecognized arguments: {" ".join(unknown)} (config '
                 'overrides are written --config.KEY=VALUE)')
  problem = _process_problem(args)
  if problem:
    parser.error(problem)
  return args, rest


def _process_problem(args):
  """What is wrong with the multi-process options, or None."""
  n, i = args.num_processes, args.process_id
  if (n is not None or i is not None) and not (args.coordinator or
                                               args.distributed):
    return ('--num-processes and --process-id need --coordinator HOST:PORT '
            '(or --distributed); without it they would be ignored')
  if n is not None and n < 1:
    return f'--num-processes {n}: must be >= 1'
  if i is not None and (i < 0 or (n is not None and i >= n)):
    return (f'--process-id {i}: must be in 0 .. '
            f'{"num-processes - 1" if n is None else n - 1}')
  if args.coordinator and not _cluster_env() and (n is None or i is None):
    return ('--coordinator needs --num-processes and --process-id (outside '
            'a SLURM or Open MPI job, which would supply them)')
  for option, value in (('--join-timeout', args.join_timeout),
                        ('--heartbeat-timeout', args.heartbeat_timeout)):
    if value is not None and not _joins(args):
      return (f'{option} needs --coordinator or --distributed; without '
              'them no process joins and it would be ignored')
  if args.coordinator and ':' not in args.coordinator:
    return f'--coordinator {args.coordinator!r}: expected HOST:PORT'
  return None


def _seconds(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(
        f'{text!r}: expected a whole number of seconds >= 1')
  return value


def _joins(args) -> bool:
  """Whether this process joins others (jax.distributed.initialize)."""
  return bool(args.coordinator or args.distributed or _cluster_env())


def _cluster_env() -> bool:
  env = os.environ
  return ('JAX_COORDINATOR_ADDRESS' in env or
          int(env.get('SLURM_NTASKS', '1')) > 1 or
          int(env.get('OMPI_COMM_WORLD_SIZE', '1')) > 1)


def main(argv=None) -> int:
  args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
  from scape_jax.train import preemption  # pylint: disable=g-import-not-at-top
  with preemption.StopAtOnce() as stop:  # one line for a signal in setup
    return _main(args, overrides, stop)


def _main(args, overrides, stop) -> int:
  """Loads the config, joins the other processes and runs; the exit code."""
  from scape_jax.train import config as config_lib  # pylint: disable=g-import-not-at-top
  try:
    cfg = config_lib.load(args.config, overrides)
  except (config_lib.ConfigError, FileNotFoundError) as e:
    print(f'error: {e}', file=sys.stderr)
    return EXIT_USAGE

  from scape_jax import train as trainer  # pylint: disable=g-import-not-at-top
  need = trainer.required_devices(cfg)
  flags = os.environ.get('XLA_FLAGS', '')
  if args.dry_run and need and 'host_platform_device_count' not in flags:
    # Simulated CPU devices for the configured mesh (read at backend start).
    os.environ['XLA_FLAGS'] = (
        f'{flags} --xla_force_host_platform_device_count={need}').strip()

  import jax  # pylint: disable=g-import-not-at-top
  if not _joins(args):
    return _run(args, cfg, need)
  problem = _join(jax, args)
  if problem:
    print(f'error: jax.distributed.initialize: {problem}', file=sys.stderr)
    return EXIT_USAGE
  return _run_joined(args, cfg, need, stop)


def _run_joined(args, cfg, need, stop) -> int:
  """`_run` on one of several processes, watching the others
  (`peers.PeerWatch`); the exit code. A signal outside the train loop
  (`stop`) announces its exit too."""
  import jax  # pylint: disable=g-import-not-at-top
  from scape_jax.train import peers  # pylint: disable=g-import-not-at-top
  watch = peers.PeerWatch(
      jax.process_index(), jax.process_count(), heartbeat_timeout=(
          args.heartbeat_timeout or peers.HEARTBEAT_TIMEOUT_S)).start()
  stop.before_exit = watch.leaving
  try:
    code = _run(args, cfg, need)
  except BaseException:  # pylint: disable=broad-except
    stop.yield_to_a_stop()  # a signal here broke the collective
    watch.settle()  # a failed collective may be a lost peer: name it
    stop.yield_to_a_stop()
    traceback.print_exc()
    code = 1
  sys.stdout.flush()
  sys.stderr.flush()
  stop.yield_to_a_stop()
  watch.leaving(code)
  if 0 < code < 128:  # not a stop on a signal, which all agreed
    # A failure may be this process's alone, with the others waiting for it
    # in a collective: jax's exit would wait for them at its shutdown
    # barrier, forever. Leave now; the others' watches see the exit code.
    os._exit(code)  # pylint: disable=protected-access
  return code


def _join(jax, args):
  """jax.distributed.initialize from the options; a problem, or None."""
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  # JAX's preemption notifier would swallow SIGTERM until the train loop
  # installs its own handler; without it SIGTERM during set-up stops the
  # process, as it does with one process.
  jax.config.update('jax_enable_preemption_service', False)
  timeout = args.join_timeout or JOIN_TIMEOUT_S
  from scape_jax.train import peers  # pylint: disable=g-import-not-at-top
  # A lost process is the trainer's to report (peers.PeerWatch), before
  # JAX's own heartbeat timeout aborts the others with a C++ stack trace.
  heartbeat = ((args.heartbeat_timeout or peers.HEARTBEAT_TIMEOUT_S) +
               peers.JAX_MARGIN_S)
  if args.coordinator and args.process_id is not None:
    print(f'process {args.process_id} of {args.num_processes}: joining '
          f'{args.coordinator} (waits up to {timeout} s for every '
          'process; --join-timeout)', file=sys.stderr, flush=True)
  try:
    jax.distributed.initialize(args.coordinator, args.num_processes,
                               args.process_id,
                               initialization_timeout=timeout,
                               heartbeat_timeout_seconds=heartbeat)
  except ValueError as e:  # jax's checks of the process options
    return str(e)
  # Process 0's count is the job's: a process told another count would
  # otherwise go on as if it had not been.
  from scape_jax.train import agreement  # pylint: disable=g-import-not-at-top
  from scape_jax.train import config as config_lib  # pylint: disable=g-import-not-at-top
  n = args.num_processes
  error = None
  if n is not None and n != jax.process_count():
    error = config_lib.ConfigError(
        f'--num-processes {n} here, but process 0 started the job with '
        f'{jax.process_count()}: give every process the same count')
  try:
    agreement.raise_together(error, 'joining')
  except config_lib.ConfigError as e:
    return str(e)
  return None


def _run(args, cfg, need) -> int:
  """Trains (or dry-runs) `cfg`; the exit code."""
  import jax  # pylint: disable=g-import-not-at-top
  from scape_jax import train as trainer  # pylint: disable=g-import-not-at-top
  from scape_jax.train import config as config_lib  # pylint: disable=g-import-not-at-top
  from scape_jax.train.checkpoint import CheckpointError  # pylint: disable=g-import-not-at-top
  from scape_jax.train.outdir import OutputError  # pylint: disable=g-import-not-at-top
  from scape_jax.data.prepare import CorpusError  # pylint: disable=g-import-not-at-top
  try:
    if args.dry_run:
      devices = jax.devices()
      if need and len(devices) < need:
        devices = jax.devices('cpu')
      trainer.dry_run(cfg, devices)
    else:
      trainer.train(cfg, allow_config_change=args.allow_config_change)
  except (config_lib.ConfigError, CheckpointError, CorpusError,
          OutputError) as e:
    print(f'error: {e}', file=sys.stderr)
    return EXIT_USAGE
  except trainer.DivergedError as e:
    print(f'error: {e}', file=sys.stderr)
    return EXIT_DIVERGED
  except trainer.Interrupted as e:
    print(f'stopped: {e}', file=sys.stderr)
    return e.exit_code
  except KeyboardInterrupt:  # not in the main thread: no StopAtOnce
    print('interrupted: stopped at once; the same command resumes from the '
          'last checkpoint', file=sys.stderr)
    return EXIT_SIGINT
  return 0


if __name__ == '__main__':
  sys.exit(main())
