"""The `opd` command line. Each subcommand is one typed function; its flags map one to one onto its arguments.

User errors (`OpdError`, bad flags) print one line `opd: error: ...` and exit 2; no traceback. So do errors of the
operating system (a full disk, an unwritable or missing path): those name the path and the system's reason.
The subcommands live in commands.py (models: pretrain, pairs, eval, generate, train) and study_commands.py (sweep,
sensitivity, report, calibrate, admit); importing them registers them (cli_args.command), in the order of --help.
"""
import argparse
import os
import signal
import sys
import threading


def _mark(signum, frame):
    _EARLY.append(signum)


# A Ctrl-C or SIGTERM while the subcommands' imports (torch, numpy) run is only marked, and main() then exits as
# interrupted: raised inside an import, it could end as another error (numpy's import died of a RecursionError).
_EARLY: list[int] = []
_BEFORE = ({sig: signal.signal(sig, _mark) for sig in (signal.SIGINT, signal.SIGTERM)}
           if threading.current_thread() is threading.main_thread() else {})
try:
    from opd.cli import commands, study as study_commands  # noqa: F401,E402 (imported for their subcommands)
    from opd.cli.args import COMMANDS, _Parser  # noqa: E402
    from opd.io.errors import OpdError, from_os_error  # noqa: E402
    from opd.data.sandbox import UNSAFE_ENV  # noqa: E402
finally:
    for _sig, _handler in _BEFORE.items():
        signal.signal(_sig, _handler)


EXECUTING = ("eval", "train", "sweep")  # the commands that may run model-written code (scoring humaneval)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="opd", description="On-policy distillation with mismatched rollouts.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, fn, arguments in COMMANDS:
        p = sub.add_parser(name, help=fn.__doc__)
        arguments(p)
        if name in EXECUTING:
            p.add_argument("--unsafe-exec", action="store_true", help="run model-written code (scoring humaneval) "
                           "without the sandbox, where bubblewrap cannot run: rlimits only (opd/data/sandbox.py)")
        p.set_defaults(func=fn)
    return parser


def main(argv: list[str] | None = None) -> int:
    if _EARLY:  # during the imports above: nothing has started
        print("opd: interrupted", file=sys.stderr)
        return 128 + _EARLY.pop()
    try:
        for arg in sys.argv[1:] if argv is None else argv:
            try:
                arg.encode("utf-8")
            except UnicodeEncodeError:  # bytes the locale could not decode: paths and values must be text
                raise OpdError(f"argument {ascii(arg)} is not valid UTF-8 text",
                               "use UTF-8 paths and values: the files opd writes and reads are UTF-8") from None
        args = vars(build_parser().parse_args(argv))
        args.pop("command")
        if args.pop("unsafe_exec", False):
            os.environ[UNSAFE_ENV] = "1"  # this process and the workers it starts (opd/data/sandbox.py)
        status = args.pop("func")(**args)
    except OpdError as e:
        print(f"opd: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"opd: error: {from_os_error(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        from opd.training.trainer import Interrupted
        if isinstance(e, Interrupted) and e.summary is not None:
            print("opd: interrupted after the run's last step: it is complete (summary.json written)", file=sys.stderr)
        elif isinstance(e, Interrupted) and e.at_boundary:
            print("opd: interrupted: the run is saved; --resume continues it exactly", file=sys.stderr)
        else:
            print("opd: interrupted", file=sys.stderr)
        return 128 + getattr(e, "signum", 2)
    return status or 0


def run() -> None:
    """The `opd` command: main(), then exit. A Ctrl-C after the command has finished (while Python shuts down and runs
    its exit handlers) is ignored: the work is done, and a KeyboardInterrupt there would only print a traceback."""
    status = main()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(status)


if __name__ == "__main__":
    run()
