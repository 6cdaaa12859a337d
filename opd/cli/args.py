"""What every `opd` subcommand shares: the registry that makes a typed function a subcommand (`command`), the parser
whose errors are one line, and the argument types (integers in a range, finite numbers, checkpoint paths).
"""
import argparse
import math
from pathlib import Path

from opd.io.errors import OpdError


def int_in(low: int, high: int | None = None, high_text: str = ""):
    """An argparse type: an integer in [low, high) (high_text: how the message writes high)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value >= high):
            raise argparse.ArgumentTypeError(f"must be positive, got {value}" if (low, high) == (1, None) else
                                             f"must be in [{low}, {high_text or high}), got {value}")
        return value
    return parse


positive_int = int_in(1)
seed = int_in(0, 2 ** 32, "2**32")
batch_count = int_in(1, 4097)  # probe batches and prompt counts: each is work per item, so a typo must not hang
prompt_count = int_in(1, 100_001)


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        where = self.prog.removeprefix("opd").strip()  # the subcommand, if any
        raise OpdError(f"{where}: {message}" if where else message, f"see `{self.prog} --help`")



COMMANDS: list[tuple[str, object, object]] = []  # (name, cmd_<name>, the function that declares its flags)


def command(arguments):
    """Register the decorated `cmd_<name>` as subcommand <name>, its flags declared by `arguments(parser)`, which is
    written just above the command: a command and its flags are read together."""
    def register(fn):
        COMMANDS.append((fn.__name__.removeprefix("cmd_"), fn, arguments))
        return fn
    return register


def model_path(text: str) -> Path:
    """--model: a checkpoint folder, or a real pair's model, PAIR:student or PAIR:teacher (real_pairs.py)."""
    from opd.data.real_pairs import resolve_model
    return resolve_model(text)
