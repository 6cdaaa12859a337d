"""The built-in task: verifiable integer arithmetic, scored by exact match of the extracted answer.

Two variants share one format, `prompt -> completion` where the completion ends in `#<answer>`:
- `add`   (short, for fast unit tests): `123+456=` -> `#579`, 5 generated tokens with <eos>.
- `chain` (long-form, the default): a sum of 8 two-digit terms with every running total written out,
          `37+85+12+64+29+53+71+40=` -> `037+085=122\\n122+012=134\\n...\\n#451`, 88-89 generated tokens with <eos>.
  Rollouts are long, so decoding dominates the step time and KV-cache quantization error has a long context to
  accumulate over, as in real reasoning workloads; every line is checkable, and so is the final answer.
  Scratchpad numbers are zero-padded to the width of the largest possible total so that digits of equal place
  value sit at fixed offsets, which made 0.8M-parameter models learn the task markedly faster than with natural
  widths (dev/LOG.md).

The held-out split is fixed by a hash of the prompt text, so it is disjoint from training data by construction,
identical on every machine, and independent of how many training examples are drawn.
"""
import hashlib
import random
from dataclasses import dataclass

from opd.io.errors import OpdError
from opd.data.scoring import last_hash, same_answer

HELD_OUT_SEED = 20261130


@dataclass(frozen=True)
class Example:
    prompt: str
    completion: str
    answer: str | None


def extract_answer(completion: str) -> str | None:
    """The text after the last '#' (the whole completion if it has none), stripped; None if empty."""
    return last_hash(completion)


def is_correct(completion: str, answer: str) -> bool:
    """Exact match of the extracted answer: as numbers when both are numbers (`#0579` == `579`), else as text
    (scoring.py's `last_hash`)."""
    return same_answer(extract_answer(completion), str(answer).strip())


def is_held_out(prompt: str) -> bool:
    return hashlib.sha256(prompt.encode()).digest()[0] % 10 == 0


@dataclass(frozen=True)
class AdditionTask:
    """Short variant: two `digits`-digit numbers."""
    digits: int = 3
    name: str = "add"

    def sample(self, rng: random.Random) -> Example:
        hi = 10 ** self.digits - 1
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        return Example(f"{a}+{b}=", f"#{a + b}", str(a + b))

    @property
    def max_new_tokens(self) -> int:  # '#', the digits of the sum, eos, and a little slack
        return self.digits + 6


@dataclass(frozen=True)
class ChainTask:
    """Long-form variant: a chain of `terms` numbers of `digits` digits with every running total written out."""
    terms: int = 8
    digits: int = 2
    name: str = "chain"

    def sample(self, rng: random.Random) -> Example:
        lo, hi = 10 ** (self.digits - 1), 10 ** self.digits - 1
        xs = [rng.randint(lo, hi) for _ in range(self.terms)]
        w = self.width
        lines, total = [], xs[0]
        for x in xs[1:]:
            lines.append(f"{total:0{w}d}+{x:0{w}d}={total + x:0{w}d}")
            total += x
        return Example("+".join(map(str, xs)) + "=", "\n".join(lines) + f"\n#{total}", str(total))

    @property
    def width(self) -> int:  # digits of the largest possible total
        return len(str(self.terms * (10 ** self.digits - 1)))

    @property
    def max_new_tokens(self) -> int:  # the longest worked completion, plus slack for a model that rambles
        line = 3 * self.width + 3
        return (self.terms - 1) * line + 1 + self.width + 1 + 16


TASKS = {"add": AdditionTask(), "chain": ChainTask()}


def get_task(name: str):
    if name not in TASKS:
        raise OpdError(f"unknown task {name!r}", f"use one of {', '.join(TASKS)}")
    return TASKS[name]


def train_examples(task, seed: int):
    """An endless, seeded stream of training examples, none of them in the held-out split."""
    rng = random.Random(seed)
    while True:
        ex = task.sample(rng)
        if not is_held_out(ex.prompt):
            yield ex


def held_out_examples(task, n: int) -> list[Example]:
    """The first n distinct held-out examples: the same list on every machine and for every caller."""
    rng, seen, out = random.Random(HELD_OUT_SEED), set(), []
    while len(out) < n:
        ex = task.sample(rng)
        if is_held_out(ex.prompt) and ex.prompt not in seen:
            seen.add(ex.prompt)
            out.append(ex)
    return out
