"""Scoring a completion against a reference answer: how the answer is extracted, and how two answers compare.

`scoring` names one of:
- `last_hash` (the built-in tasks'): the text after the last `#` of the completion.
- `gsm8k`: the number after the last `####` (GSM8K's format); a reference that contains `####` (GSM8K's `answer`
  field holds the worked solution) is read the same way.
- `boxed`: the contents of the last `\\boxed{...}` (braces nested to any depth); likewise for the reference.
- `exact`: the whole completion.
- `humaneval`: the completion's code run against the unit tests of the HumanEval problem in `answer` (humaneval.py),
  in an operating-system sandbox (sandbox.py, judge.py): this **executes model output**.
- `none`: no accuracy is computed (evaluation still reports the reverse KL to the teacher).
- `module:function`: a function of yours, `f(completion: str, answer: str) -> bool | float` (a float is a partial
  credit in [0, 1]), imported from a module on the Python path.

This module extracts and compares; evaluate.get_scorer turns a name into the function (humaneval's and a user's
module:function included).

Extracted answers compare as numbers when both read as numbers, after removing thousands separators, a `$`, a
leading `+` and a trailing `.` (`1,234` == `1234.0` == `+1234`), else as text with surrounding space removed.
"""
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from opd.io.errors import require

SCORERS = ("last_hash", "gsm8k", "boxed", "exact", "humaneval", "none")
_GSM8K = re.compile(r"####\s*([-+$]?\s*[0-9][0-9,]*(?:\.[0-9]+)?)")


def last_hash(text: str) -> str | None:
    """The text after the last '#' (the whole text if it has none), stripped; None if empty."""
    return text.rsplit("#", 1)[-1].strip() or None


def gsm8k(text: str) -> str | None:
    found = _GSM8K.findall(text)
    return found[-1] if found else None


def boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...}, braces balanced; None if there is none (or it is not closed)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j].strip()
    return None


def exact(text: str) -> str | None:
    return text.strip()


EXTRACT = {"last_hash": last_hash, "gsm8k": gsm8k, "boxed": boxed, "exact": exact}


def number(text: str) -> Decimal | None:
    cleaned = text.strip().replace(",", "").replace("$", "").replace(" ", "").removeprefix("+").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def same_answer(got: str | None, want: str) -> bool:
    if got is None:
        return False
    a, b = number(got), number(want)
    if a is not None and b is not None:
        return a == b
    return got.strip() == want.strip()


def reference(answer: str, name: str) -> str:
    """The reference answer of a prompt file's line, read with the scheme when it is written in it (GSM8K's
    `... #### 72`, a `\\boxed{}`), else as it is."""
    if name in ("gsm8k", "boxed"):
        return EXTRACT[name](answer) or answer.strip()
    return answer.strip()


@dataclass(frozen=True)
class Verdict:
    """A scored completion: its credit, and where a scorer says more (humaneval), the outcome and its reason."""
    credit: float
    outcome: str = ""
    detail: str = ""


def check_name(name: str) -> None:
    require(isinstance(name, str) and (name in SCORERS or re.fullmatch(r"[\w.]+:\w+", name) is not None),
            f"config: unknown scoring {name!r}", f"use one of {', '.join(SCORERS)}, or module:function")
