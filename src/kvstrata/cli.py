"""The ``kvstrata`` command: ``hash``, ``replay`` and ``indexer``.

(Over 400 lines on purpose: one concern, the command's edge: flags, input checks, dispatch and
the exit-status contract below (one-line errors, signals, a closed pipe); the work itself lives
in the modules each command calls.)

Errors: anything wrong with what the user gave (a flag, a file, a spec, a config) ends the
command with one line on stderr naming the input and exit status 2, never a traceback
(:func:`main` is the one boundary that turns input errors into that line; set
``KVSTRATA_DEBUG=1`` for the traceback). Inputs that need no work are checked before any work
starts. Ctrl-C exits with 130 and a reader that closes the pipe early (``| head``) ends the
command quietly.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from dataclasses import replace
from typing import Sequence

from .cliparse import OneLineParser
from .config import ConfigError, load_config, parse_tiers_flag
from .paths import atomic_write_problem
from .logical.policy import ADMISSION_NAMES, EVICTION_NAMES
from .tiers import ordered
from .tokens import TokenError, hash_blocks, isolation_seed


def _cmd_hash(args: argparse.Namespace) -> int:
    if args.lora_path is not None and args.lora is None:
        raise CliInputError("--lora-path needs --lora (the adapter's name)")
    for flag, value in (("--lora", args.lora), ("--salt", args.salt),
                        ("--lora-path", args.lora_path)):
        if value is not None:
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise CliInputError(f"{flag} is not valid UTF-8 text") from None
    seed = isolation_seed(args.lora, args.salt, args.lora_path)
    try:
        tokens = [int(t) for t in args.tokens]
        local, seqs = hash_blocks(tokens, args.block_size, seed)
    except (ValueError, TokenError) as exc:
        print(f"kvstrata hash: {exc}", file=sys.stderr)
        return 2
    out = {"block_size": args.block_size, "local_hashes": local, "sequence_hashes": seqs}
    if seed != 1337:
        out["seed"] = seed
    print(json.dumps(out))
    return 0


def _build_replay_config(args: argparse.Namespace):
    """The replay's config: file and env vars, then the flags; validated at the block size
    the replay will use (512 tokens at trace granularity)."""
    problems = []
    if args.granularity == "trace" and args.block_size is not None:
        problems.append("--block-size applies to --granularity engine (trace blocks are 512 tokens)")
    if args.limit is not None and not 1 <= args.limit <= sys.maxsize:
        problems.append(f"--limit must be a positive number of requests, got "
                        f"{str(args.limit)[:40]}")
    if problems:
        raise ConfigError(problems)
    overrides = {}
    if args.granularity == "trace":
        from .replay import TRACE_BLOCK_TOKENS

        overrides["block_size"] = TRACE_BLOCK_TOKENS
    elif args.block_size is not None:
        overrides["block_size"] = args.block_size
    if args.tiers is not None:             # "" names no tier: an error, not "unset"
        overrides["tiers"] = parse_tiers_flag(args.tiers)
    if args.policy is not None:            # "" is a bad policy, not "unset"
        overrides["eviction"] = args.policy
    if args.admission is not None:
        overrides["admission"] = args.admission
    config = load_config(args.config, **overrides)
    # --policy names every tier's order and --admission the bottom tier's filter (the
    # global ones): per-tier choices from a file must not win over them.
    if args.policy is not None or args.admission is not None:
        bottom = ordered(config.tiers)[-1]
        tiers = {
            name: replace(
                tier,
                eviction=None if args.policy is not None else tier.eviction,
                admission=None if args.admission is not None and name == bottom
                else tier.admission,
            )
            for name, tier in config.tiers.items()
        }
        config = replace(config, tiers=tiers)
    return config


def _cmd_replay(args: argparse.Namespace) -> int:
    if args.granularity is None:
        args.granularity = "engine" if args.data else "trace"
    from .fleet import MAX_WORKERS

    if not 1 <= args.workers <= MAX_WORKERS:
        raise CliInputError(f"--workers must be in 1..{MAX_WORKERS:,}, got {args.workers}")
    for what, value in (("the trace path", args.trace), ("--plot", args.plot),
                        ("--events", args.events), ("--config", args.config),
                        ("--disk-dir", args.disk_dir)):
        if value == "":          # an unset shell variable: not the default, silently
            raise CliInputError(f"{what} is empty: name one, or leave it out")
    from .placement.costs import PREFILL_RATES

    low, high = PREFILL_RATES
    if args.prefill_rate is not None and not (low <= args.prefill_rate <= high and args.data):
        raise CliInputError(f"--prefill-rate takes {low:g}..{high:g} tokens per second, with "
                            f"--data")
    if args.workers > 1 and args.events:
        raise CliInputError("--events publishes one worker's events; not with --workers")
    if args.data and args.events:
        raise CliInputError("--events publishes the metadata replay's events; not with "
                            "--data")
    if args.route != "round-robin" and args.workers == 1:
        raise CliInputError(f"--route {args.route} spreads requests over workers: give "
                            f"--workers N (N > 1)")
    if args.disk_dir is not None and not args.data:
        raise CliInputError("--disk-dir names the G3 directory of a --data replay; add --data "
                            "(the metadata replay keeps no bytes)")
    if args.data and args.plot:
        raise CliInputError("--plot draws the metadata replay; not with --data")
    config = _build_replay_config(args)         # ConfigError: one line from main()
    if args.plot:
        _check_writable(args.plot, "--plot")
    if args.events:
        from .events.spec import sink_problem

        problem = sink_problem(args.events)     # a bad spec or path fails here, first
        if problem:
            raise CliInputError(f"--events: {problem}")
    _check_not_the_trace(args)
    with _GracefulStop() as stop:
        args.stop = stop
        return _replay_with(args, config)


def _check_not_the_trace(args: argparse.Namespace) -> None:
    """An output (``--plot``, a file of ``--events``) must not be the trace being read."""
    if args.trace is None:
        return
    from .events.spec import parse_sink_spec

    outputs = [("--plot", args.plot)]
    if args.events:
        sink = parse_sink_spec(args.events)
        if sink.kind in ("jsonl", "dynamo-json"):
            outputs.append(("--events", sink.target))
    for flag, path in outputs:
        try:
            same = bool(path) and os.path.samefile(args.trace, path)
        except OSError:
            same = False                # one of them does not exist (yet): not the same
        if same:
            raise CliInputError(f"{flag} {path} is the trace being replayed: it would be "
                                f"overwritten")


def _replay_with(args: argparse.Namespace, config) -> int:
    import gzip
    import zlib

    from .replay import TraceFormatError, default_trace_path, iter_trace, replay
    from .report import format_table, write_plot

    trace = args.trace or str(default_trace_path())
    limit = args.limit or (DATA_DEFAULT_LIMIT if args.data else None)
    try:
        # with a limit, no more of the trace is read than it takes
        requests = list(itertools.islice(iter_trace(trace), limit))
    except TraceFormatError as exc:
        print(f"kvstrata replay: malformed trace: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvstrata replay: cannot read trace {trace}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except (UnicodeDecodeError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
        print(f"kvstrata replay: cannot read trace {trace}: not a text or gzip trace ({exc})",
              file=sys.stderr)
        return 2
    if args.granularity == "engine":
        from .trace import expansion_problem

        problem = expansion_problem(requests, config.block_size)
        if problem:
            print(f"kvstrata replay: {trace}: {problem}", file=sys.stderr)
            return 2

    bar = None
    if not args.no_progress and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=len(requests), unit="req", file=sys.stderr, leave=False)
    if args.workers > 1:
        try:
            return _run_fleet(args, config, requests, trace, bar)
        finally:
            if bar is not None:
                bar.close()
    if args.data:
        try:
            return _run_data(args, config, requests, trace, _ticker(bar, args.stop))
        finally:
            if bar is not None:
                bar.close()
    publisher = None
    if args.events:       # opened once the trace was read: a failed run publishes nothing
        from .events import make_publisher

        publisher = make_publisher(args.events)
    observers = [publisher] if publisher is not None else []
    try:
        result = replay(
            requests,
            config,
            granularity=args.granularity,
            observers=observers,
            trace_name=trace,
            progress=_ticker(bar, args.stop),
            curve_every=max(1, len(requests) // 200) if args.plot else 0,
        )
    finally:
        if bar is not None:
            bar.close()
        if publisher is not None:
            publisher.close()           # delivers what it can in its timeout, counts the rest
    doc = result.as_dict()
    if publisher is not None:
        from .events.publisher import delivery_report

        doc["events"] = delivery_report(args.events, publisher.metrics())
    if args.plot:
        write_plot(result, args.plot)
        doc["plot"] = args.plot
    status = _print_report(args, doc, format_table)
    if publisher is not None:
        status = max(status, _report_lost_events(doc["events"]))
    return status


def _report_lost_events(events: dict) -> int:
    """One line on stderr if events were lost; exit status 1 if every event was."""
    lost, enqueued = events["lost"], events["enqueued"]
    if not lost:
        return 0
    print(f"kvstrata replay: --events {events['sink']}: {lost:,} of {enqueued:,} events were "
          f"not delivered ({events['sink_errors']:,} sink errors)", file=sys.stderr)
    return 1 if events["published"] == 0 else 0


def _print_report(args: argparse.Namespace, doc: dict, table) -> int:
    """The replay report as JSON (``--json``) or as ``table(doc)``, and where the plot went."""
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(table(doc))
        if doc.get("plot"):
            print(f"plot written to {doc['plot']}")
    return 0


DATA_DEFAULT_LIMIT = 100
"""Requests a ``--data`` replay takes unless ``--limit`` says otherwise (it moves real bytes)."""


def _run_fleet(args: argparse.Namespace, config, requests, trace: str, bar) -> int:
    """``replay --workers N``: the fleet sharing G4, then the same N workers isolated (with
    ``--data``: real bytes, G4 in an S3 store)."""
    from .fleet import replay_fleet
    from .report import format_fleet_table, sharing_gain, write_fleet_plot

    if bar is not None:
        bar.reset(total=2 * len(requests))
    progress = _ticker(bar, args.stop)
    runs = {}
    docs = {}
    for shared in (True, False):
        if args.data:
            from .data_fleet import run_data_fleet
            from .data_replay import DataReplayError

            try:
                docs[shared] = run_data_fleet(requests, config, workers=args.workers,
                                              route=args.route, granularity=args.granularity,
                                              shared=shared, progress=progress)
            except DataReplayError as exc:
                print(f"kvstrata replay --data: {exc}", file=sys.stderr)
                return 2
            docs[shared]["trace"] = trace
            continue
        runs[shared] = replay_fleet(
            requests, config, workers=args.workers, route=args.route,
            granularity=args.granularity, shared=shared, trace_name=trace,
            progress=progress, curve_every=max(1, len(requests) // 200) if args.plot else 0)
        docs[shared] = runs[shared].as_dict()
    doc = {"shared": docs[True], "isolated": docs[False]}
    doc["gain"] = sharing_gain(doc["shared"], doc["isolated"])
    if args.plot and runs:
        write_fleet_plot(runs[True], runs[False], args.plot)
        doc["plot"] = args.plot
    return _print_report(args, doc, format_fleet_table)


def _run_data(args: argparse.Namespace, config, requests, trace: str, progress) -> int:
    from .data_replay import DataReplayError, run_data_replay
    from .report import format_data_table

    try:
        doc = run_data_replay(
            requests, config, granularity=args.granularity, disk_dir=args.disk_dir,
            progress=progress, prefill_tokens_per_s=args.prefill_rate)
    except DataReplayError as exc:
        print(f"kvstrata replay --data: {exc}", file=sys.stderr)
        return 2
    doc["trace"] = trace
    print(json.dumps(doc, indent=2) if args.json else format_data_table(doc))
    return 0


def _cmd_indexer(argv: Sequence[str]) -> int:
    from .events.indexer import main as indexer_main

    return indexer_main(list(argv))


def build_parser() -> argparse.ArgumentParser:
    from .fleet import ROUTES
    parser = OneLineParser(prog="kvstrata", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p_hash = sub.add_parser("hash", help="print the block hashes of a token sequence (JSON)")
    p_hash.add_argument("--block-size", type=int, required=True)
    p_hash.add_argument("--lora", help="LoRA adapter name (changes the seed)")
    p_hash.add_argument("--lora-path", help="the LoRA adapter's path, as vLLM's lora_path "
                        "(changes the seed: the vLLM connector's rule)")
    p_hash.add_argument("--salt", help="per-request cache salt (changes the seed)")
    p_hash.add_argument("tokens", nargs="*", help="token ids")
    p_hash.set_defaults(func=_cmd_hash)

    p_replay = sub.add_parser(
        "replay",
        help="replay a Mooncake trace through the tiered pools and report hit rates",
        description="Replay a Mooncake-format trace (default: the packaged conversation "
        "trace) through the placement planner and the pools of the configured tiers (default "
        "G1/G2/G3), the same planner KvBlockManager drives.",
    )
    p_replay.add_argument("trace", nargs="?", help="trace file (.jsonl or .jsonl.gz)")
    p_replay.add_argument("--config", help="TOML config file (see docs/configuration.md)")
    p_replay.add_argument("--granularity", choices=("trace", "engine"),
                          help="one block per 512-token trace id (default), or engine-size "
                          "blocks of --block-size tokens (32x more blocks; the default with --data)")
    p_replay.add_argument("--block-size", type=int, help="engine block size in tokens (default 16)")
    p_replay.add_argument("--tiers", help="e.g. G1=1000,G2=4000,G3=16000 (the default, in blocks) or G2=4GiB")
    p_replay.add_argument("--policy", help=f"eviction policy: {', '.join(sorted(EVICTION_NAMES))}")
    p_replay.add_argument("--admission",
                          help=f"the bottom tier's admission filter: {', '.join(sorted(ADMISSION_NAMES))}")
    p_replay.add_argument("--limit", type=int, help="replay only the first N requests")
    p_replay.add_argument("--json", action="store_true", help="print the report as JSON")
    p_replay.add_argument("--plot", metavar="PNG", help="write a hit-rate-along-the-trace plot")
    p_replay.add_argument("--events", metavar="SINK",
                          help="publish block events, e.g. jsonl:PATH, dynamo-json:PATH, "
                          "nats://127.0.0.1:4222/SUBJECT")
    p_replay.add_argument("--data", action="store_true",
                          help="move real KV bytes through G1 (CPU stand-in), G2 and a disk G3 "
                          f"and report bandwidth per path (first {DATA_DEFAULT_LIMIT} requests "
                          "unless --limit)")
    p_replay.add_argument("--disk-dir", help="--data: directory for the G3 slab (default: a temp dir)")
    p_replay.add_argument("--prefill-rate", type=float, metavar="TOKENS_PER_S",
                          help="--data: the engine's prefill rate the cost model compares "
                          "loads against (default: its prior, 2000)")
    p_replay.add_argument("--workers", type=int, default=1, metavar="N",
                          help="N workers sharing one G4 (each with its own G1-G3); reports "
                          "per-worker and shared-tier hit rates beside N isolated workers")
    p_replay.add_argument("--route", choices=ROUTES, default="round-robin",
                          help="--workers: how requests are spread (prefix: to the worker "
                          "holding the longest prefix, load-bounded, as an indexer-fed router)")
    p_replay.add_argument("--no-progress", action="store_true", help="no progress bar")
    p_replay.set_defaults(func=_cmd_replay)

    p_index = sub.add_parser("indexer", help="follow an event stream and answer prefix queries",
                             add_help=False)
    p_index.add_argument("rest", nargs=argparse.REMAINDER)
    p_index.set_defaults(func=None)
    return parser


class CliInputError(ValueError):
    """Something the user gave cannot be used; the message names it."""


INPUT_ERRORS = (ValueError, OSError, UnicodeError, EOFError, OverflowError, RecursionError)
"""What a command raises for bad input (typed errors of kvstrata's parsers are ValueErrors;
files the user named raise OSError): one line and exit 2. Anything else is a bug and keeps
its traceback."""


def _check_writable(path: str, flag: str) -> None:
    """Fail now, not after the work, if ``path`` cannot be written (atomically)."""
    problem = atomic_write_problem(path)
    if problem:
        raise CliInputError(f"{flag} {path}: {problem}")


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, ConfigError):
        return ("invalid config: " + "; ".join(exc.problems))[:2000]
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:
        text = f"{exc.filename + ': ' if exc.filename else ''}{exc.strerror}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return "; ".join(lines)[:2000]


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is, so it unwinds like Ctrl-C."""


def _on_sigterm():
    """Make SIGTERM unwind the command (every ``finally`` and ``with`` runs: slabs and
    temporary directories are removed); returns a function restoring the old handler."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def stop(signum, frame):
        raise _Terminated

    old = signal.signal(signal.SIGTERM, stop)
    return lambda: signal.signal(signal.SIGTERM, old)


STOP_GRACE_SECONDS = 5.0
"""How long a replay may take to reach its next request boundary after SIGTERM or Ctrl-C
before it is stopped wherever it is."""


class _GracefulStop:
    """SIGTERM and SIGINT during a replay: stop at the next request boundary (``check``),
    where no lock is held and every ``with`` unwinds cleanly; a second signal, or
    :data:`STOP_GRACE_SECONDS` without reaching a boundary, stops at once. An exception
    raised asynchronously inside library code (between a lock's acquire and its ``try``)
    could otherwise leave the clean-up waiting on that lock for ever."""

    def __init__(self) -> None:
        self.signum = 0
        self._old: dict = {}

    def __enter__(self) -> "_GracefulStop":
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._on_signal)
            self._old[signal.SIGALRM] = signal.signal(signal.SIGALRM, self._on_alarm)
        return self

    def __exit__(self, *exc) -> None:
        import signal

        if self._old:
            signal.setitimer(signal.ITIMER_REAL, 0)
            for sig, handler in self._old.items():
                signal.signal(sig, handler)
            self._old = {}

    def check(self) -> None:
        """Raise the stop a signal asked for, if any (call at safe points)."""
        if self.signum:
            raise self._exception()

    def _exception(self) -> BaseException:
        import signal

        return _Terminated() if self.signum == signal.SIGTERM else KeyboardInterrupt()

    def _on_signal(self, signum, frame) -> None:
        import signal

        if self.signum:                     # asked twice: stop here
            raise self._exception()
        self.signum = signum
        signal.setitimer(signal.ITIMER_REAL, STOP_GRACE_SECONDS)

    def _on_alarm(self, signum, frame) -> None:
        self.check()


def _ticker(bar, stop: _GracefulStop):
    """The per-request progress callback of a replay: a safe point to stop at, and the
    progress bar's tick."""
    def tick(n: int) -> None:
        stop.check()
        if bar is not None:
            bar.update(1)
    return tick


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else ""
    restore = _on_sigterm()
    try:
        return _main(argv, command)
    finally:
        restore()


def _main(argv: list[str], command: str) -> int:
    try:
        if command == "indexer":
            return _cmd_indexer(argv[1:])
        args = build_parser().parse_args(argv)
        return args.func(args)
    except _Terminated:
        print("kvstrata: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("kvstrata: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (``kvstrata ... | head``): nothing more to say, and Python
        # must not complain again when it flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except INPUT_ERRORS as exc:
        if os.environ.get("KVSTRATA_DEBUG"):
            raise
        print(f"kvstrata {command}: {_one_line(exc)}".rstrip(), file=sys.stderr)
        return 2
    except MemoryError:        # what was asked (the trace, the tiers) exceeds this machine
        if os.environ.get("KVSTRATA_DEBUG"):
            raise
        print(f"kvstrata {command}: out of memory: the input or the tiers need more than "
              f"this process may have (try --limit or smaller tiers)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
