"""Scoring model-written code so that a pass is earned by the tests alone: two processes inside the sandbox.

This file runs inside sandbox.py's sandbox (its source is sent there; it imports nothing of opd, only the standard
library, and numpy when a value is a numpy one). `python -c <this file> judge` is the **judge**, trusted, that never
runs model code; it starts `python -c <this file> candidate`, the **candidate**, which does.

- The judge makes itself undumpable first (the candidate, same user, cannot read its memory or its descriptors
  through /proc, nor ptrace it), reads the job from its standard input ({"program", "prelude", "tests",
  "entry_point", "runner"}: the tests are never in a file; "runner" is this file's source), starts the candidate
  and sends it the program.
- The candidate runs the program (the problem's prompt and the completion's code) and then serves calls of the entry
  point: arguments in, the value or the exception out, one JSON line each way over two pipes of its own. Its stdout
  and stderr go to the sandbox's bounded output.
- The judge runs the prelude (the problem's prompt: its imports and helpers) and the tests in its own namespace and
  calls `check(candidate)` with a proxy that forwards each call. It writes `{"status": "passed"}` on the report pipe
  (descriptor $OPD_REPORT_FD, which only the judge holds) after `check` returned, and a failure with its reason otherwise.

What that rules out, each seen in a completion written to get credit without passing: an exit before the asserts
(`sys.exit(0)`, `os._exit(0)`: the judge hears the candidate's pipe close and fails with "exited"), an object whose
`__eq__` is always True (values cross as data, decoded by CODEC into plain Python values; anything else arrives as an
`Opaque` that equals nothing), replacing the asserts or the harness (they run in the judge), reading the tests
(they are in the judge's memory only), and writing the pass token itself (the report pipe is not the candidate's).

CODEC: a value is JSON where JSON says it exactly (None, bool, int, float including inf and nan, str); anything else
is a one-key object: {"l": list}, {"t": tuple}, {"d": [[key, value], ...]}, {"s": set}, {"f": frozenset},
{"b": bytes as hex}, {"c": [re, im]}, {"n": [dtype, value]} (a numpy scalar), {"a": [dtype, shape, values]} (a
numpy array), {"o": "type: repr"} (an Opaque). Calls: {"call": [args, kwargs]}; replies {"value": v} or
{"raise": [type name, message]}; the program's start: {"program": source} -> {"ready": true} or {"raise": ...}.
"""
import json
import os
import subprocess
import sys

REPLY_LIMIT = 16 << 20  # bytes of one reply line
DEPTH = 64  # nesting of one value


class Opaque:
    """A value the codec does not carry (a function, a generator, an object of the completion's own class): it
    equals nothing but itself."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return f"<opaque {self.text}>"


def encode(value, depth: int = 0):
    if depth > DEPTH:
        raise ValueError(f"a value nested deeper than {DEPTH}")
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    def nested(items):
        return [encode(v, depth + 1) for v in items]
    if kind is list:
        return {"l": nested(value)}
    if kind is tuple:
        return {"t": nested(value)}
    if kind is dict:
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind in (set, frozenset):
        return {"s" if kind is set else "f": nested(value)}
    if kind is bytes:
        return {"b": value.hex()}
    if kind is complex:
        return {"c": [value.real, value.imag]}
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.generic) and value.dtype.kind in "biufc":
        return {"n": [value.dtype.str, encode(value.item(), depth + 1)]}
    if numpy is not None and isinstance(value, numpy.ndarray) and value.dtype.kind in "biufcU":
        return {"a": [value.dtype.str, list(value.shape), encode(value.tolist(), depth + 1)]}
    return {"o": f"{kind.__name__}: {_repr(value)}"}


def _repr(value) -> str:
    try:
        return repr(value)[:200]
    except BaseException:
        return "?"


def decode(data):
    """A value from its CODEC form (data from the candidate: anything malformed raises ValueError)."""
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is not dict or len(data) != 1:
        raise ValueError(f"not a value: {str(data)[:80]}")
    (tag, body), = data.items()
    if tag in ("l", "t", "s", "f"):
        items = [decode(v) for v in _list(body)]
        return {"l": list, "t": tuple, "s": set, "f": frozenset}[tag](items)
    if tag == "d":
        return {decode(k): decode(v) for k, v in (_pair(p) for p in _list(body))}
    if tag == "b" and type(body) is str:
        return bytes.fromhex(body)
    if tag == "c":
        re_, im = _pair(body)
        return complex(float(re_), float(im))
    if tag == "o" and type(body) is str:
        return Opaque(body[:300])
    if tag in ("n", "a"):
        import numpy
        if tag == "n":
            dtype, value = _pair(body)
            return numpy.dtype(_dtype(dtype, "biufc")).type(decode(value))
        dtype, shape, values = _list(body)
        return numpy.array(decode(values), dtype=_dtype(dtype, "biufcU")).reshape([int(n) for n in _list(shape)])
    raise ValueError(f"unknown value tag {tag!r}")


def _list(body) -> list:
    if type(body) is not list:
        raise ValueError("malformed value")
    return body


def _pair(body) -> list:
    if type(body) is not list or len(body) != 2:
        raise ValueError("malformed value")
    return body


def _dtype(text, kinds: str) -> str:
    import numpy
    if type(text) is not str or len(text) > 16 or numpy.dtype(text).kind not in kinds:
        raise ValueError(f"unsupported numpy dtype {text!r}")
    return text


def send(pipe, message: dict) -> None:
    pipe.write(json.dumps(message).encode() + b"\n")
    pipe.flush()


# ---- the candidate: runs the model's program, serves calls of its entry point ----

def candidate(requests_fd: int, replies_fd: int) -> None:
    requests, replies = os.fdopen(requests_fd, "rb"), os.fdopen(replies_fd, "wb")
    scope = {"__name__": "__candidate__"}
    job = json.loads(requests.readline())
    sys.path[:] = job["path"]  # the judge's: numpy's mount where there is one
    try:
        exec(compile(job["program"], "<completion>", "exec"), scope)
        send(replies, {"ready": True})
    except BaseException as e:  # SystemExit included: the program's end, reported as what it was
        send(replies, {"raise": [type(e).__name__, _message(e)]})
        return
    for line in requests:
        args, kwargs = (decode(part) for part in json.loads(line)["call"])
        try:
            value = scope[job["entry_point"]](*args, **kwargs)
            reply = {"value": encode(value)}
        except BaseException as e:
            reply = {"raise": [type(e).__name__, _message(e)]}
        send(replies, reply)


def _message(e: BaseException) -> str:
    try:
        return str(e)[:300]
    except BaseException:
        return "?"


# ---- the judge: runs the tests, reports ----

class CandidateGone(BaseException):
    """The candidate's pipe closed (it exited, or was killed) before the tests finished. A BaseException: a test's
    `except Exception` does not swallow it."""


class CandidateRaised(Exception):
    pass


class Candidate:
    def __init__(self, job: dict):
        requests_read, self.requests = os.pipe()
        self.replies, replies_write = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-c", job["runner"], "candidate", str(requests_read), str(replies_write)],
            stdin=subprocess.DEVNULL, stdout=2, stderr=2, pass_fds=(requests_read, replies_write))
        os.close(requests_read)
        os.close(replies_write)
        self.out, self.inp = os.fdopen(self.requests, "wb"), os.fdopen(self.replies, "rb")
        self.exchange({"program": job["program"], "entry_point": job["entry_point"], "path": sys.path}, "ready")

    def exchange(self, message: dict, key: str):
        try:
            send(self.out, message)
        except (BrokenPipeError, OSError):
            self.gone()
        line = self.inp.readline(REPLY_LIMIT)
        if not line:
            self.gone()
        if not line.endswith(b"\n"):
            raise CandidateRaised(f"sent a reply longer than {REPLY_LIMIT} bytes")
        try:
            reply = json.loads(line)
        except (ValueError, RecursionError):
            reply = None
        if type(reply) is not dict:
            raise CandidateRaised("sent a malformed reply")
        if "raise" in reply:
            kind, text = _pair(reply["raise"])
            if kind == "SystemExit" and key == "ready":
                raise CandidateGone(f"the program exited (SystemExit {text}) before the tests ran")
            raise CandidateRaised(f"raised {str(kind)[:60]}: {str(text)[:300]}")
        if key not in reply:
            raise CandidateRaised("sent a malformed reply")
        return reply[key]

    def gone(self):
        status = self.process.wait()
        raise CandidateGone(f"the program exited (status {status}) before the tests finished")

    def __call__(self, *args, **kwargs):
        return decode(self.exchange({"call": [encode(list(args)), encode(kwargs)]}, "value"))


def undumpable() -> None:
    """prctl(PR_SET_DUMPABLE, 0): /proc/<judge>/{mem,fd,environ} and ptrace need CAP_SYS_PTRACE, which no process
    in the sandbox has."""
    import ctypes
    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def judge() -> None:
    report = os.fdopen(int(os.environ["OPD_REPORT_FD"]), "wb")
    os.set_inheritable(report.fileno(), False)
    undumpable()
    job = json.loads(sys.stdin.buffer.read())
    try:
        status, detail = run_tests(job)
    except BaseException as e:  # a failure of the judge itself (memory, a malformed reply): not a pass
        status, detail = "error", f"{type(e).__name__}: {_message(e)}"
    send(report, {"status": status, "detail": detail[:500]})


def run_tests(job: dict) -> tuple[str, str]:
    try:
        proxy = Candidate(job)
    except CandidateGone as e:
        return "exited", str(e)
    except CandidateRaised as e:
        return "failed", f"the program {e}"
    scope = {"__name__": "__judge__"}
    exec(compile(job["prelude"], "<prompt>", "exec"), scope)
    scope[job["entry_point"]] = proxy  # tests that name the function (HumanEval/33) call the completion's
    exec(compile(job["tests"], "<tests>", "exec"), scope)
    try:
        scope["check"](proxy)
    except CandidateGone as e:
        return "exited", str(e)
    except CandidateRaised as e:
        return "failed", f"the completion {e}{_test_line(job['tests'], e)}"
    except AssertionError as e:
        return "failed", f"assertion failed{_test_line(job['tests'], e)}"
    except Exception as e:
        return "failed", f"{type(e).__name__}: {_message(e)}{_test_line(job['tests'], e)}"
    return "passed", ""


def _test_line(tests: str, e: BaseException) -> str:
    tb, line = e.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<tests>":
            line = tb.tb_lineno
        tb = tb.tb_next
    lines = tests.splitlines()
    return f" at line {line} of the tests: {lines[line - 1].strip()[:200]}" if line and line <= len(lines) else ""


if __name__ == "__main__":  # in the sandbox: `python -c <this file> candidate R W`, else the judge
    if sys.argv[1:2] == ["candidate"]:
        candidate(int(sys.argv[2]), int(sys.argv[3]))
    else:
        judge()
