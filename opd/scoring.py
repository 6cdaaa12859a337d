"""Scoring a completion against a reference answer: how the answer is extracted, and how two answers compare.

`scoring` names one of:
- `last_hash` (the built-in tasks'): the text after the last `#` of the completion.
- `gsm8k`: the number after the last `####` (GSM8K's format); a reference that contains `####` (GSM8K's `answer`
  field holds the worked solution) is read the same way.
- `boxed`: the contents of the last `\\boxed{...}` (braces nested to any depth); likewise for the reference.
- `exact`: the whole completion.
- `humaneval`: the completion's code run against the unit tests of the HumanEval problem in `answer` (humaneval.py),
  in a sandboxed child process (sandbox.py): this **executes model output**.
- `none`: no accuracy is computed (evaluation still reports the reverse KL to the teacher).
- `module:function`: a function of yours, `f(completion: str, answer: str) -> bool | float` (a float is a partial
  credit in [0, 1]), imported from a module on the Python path.

Extracted answers compare as numbers when both read as numbers, after removing thousands separators, a `$`, a
leading `+` and a trailing `.` (`1,234` == `1234.0` == `+1234`), else as text with surrounding space removed.
"""
import importlib
import os
import sys
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Callable

from opd.errors import OpdError, require

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


def get_judge(name: str) -> Callable[[str, str], Verdict] | None:
    """completion, reference answer -> Verdict; None for `none`. humaneval's says why a completion failed."""
    if name == "humaneval":
        from opd import humaneval
        return humaneval.judge
    scorer = get_scorer(name)
    return None if scorer is None else lambda completion, answer: Verdict(scorer(completion, answer))


def get_scorer(name: str) -> Callable[[str, str], float] | None:
    """completion, reference answer -> credit in [0, 1]; None for `none`."""
    if name == "none":
        return None
    if name == "humaneval":
        from opd import humaneval
        return humaneval.score
    if name in EXTRACT:
        extract = EXTRACT[name]
        return lambda completion, answer: float(same_answer(extract(completion), reference(answer, name)))
    return _user_function(name)


def check_scorer(name: str, examples) -> None:
    """Before a run writes anything: the scoring imports, and a user function runs on the first example with an
    answer (that answer as the completion) and returns a valid credit. Errors are one line (OpdError)."""
    scorer = get_scorer(name)
    answered = [ex for ex in examples if ex.answer is not None]
    if scorer is not None and answered and ":" in name:
        scorer(answered[0].answer, answered[0].answer)
    if name == "humaneval":
        from opd.humaneval import parse_answer
        from opd.sandbox import require_sandbox
        for ex in answered:
            parse_answer(ex.answer)
        require_sandbox()  # before a run starts, not at its first evaluation


def check_name(name: str) -> None:
    require(isinstance(name, str) and (name in SCORERS or re.fullmatch(r"[\w.]+:\w+", name) is not None),
            f"config: unknown scoring {name!r}", f"use one of {', '.join(SCORERS)}, or module:function")


def _user_function(spec: str) -> Callable[[str, str], float]:
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:  # a module next to the user's files, as `python -m` would find it
        sys.path.append(os.getcwd())
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except Exception as e:  # ImportError, AttributeError, or the module itself failing
        raise OpdError(f"scoring {spec!r} cannot be imported: {type(e).__name__}: {e}",
                       "check the module is on PYTHONPATH and defines the function") from None
    require(callable(fn), f"scoring {spec!r} is not a function", "point it at f(completion, answer) -> bool")

    def score(completion: str, answer: str) -> float:
        try:
            value = fn(completion, answer)
        except Exception as e:
            raise OpdError(f"scoring function {spec} raised {type(e).__name__}: {e}",
                           "fix the function; it gets the completion text and the reference answer") from None
        require(isinstance(value, (bool, int, float)) and 0 <= float(value) <= 1,
                f"scoring function {spec} returned {value!r}", "return a bool or a number in [0, 1]")
        return float(value)
    return score
