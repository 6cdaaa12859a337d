"""Model-written code against the sandbox (opd/data/sandbox.py) and the judge (opd/data/judge.py): each test is a program that
tries one way out, or one way to a pass the tests did not give, and checks that it is contained with its reason.
Programs that probe print PROBES-RAN when every probe ran, so a test cannot pass because its program died early."""
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from helpers import assert_one_line_error, opd
from opd.data import humaneval, judge, sandbox
from opd.io.errors import OpdError

pytestmark = pytest.mark.reliability

PROBLEM = {"task_id": "T/0", "prompt": 'def double(x):\n    """Twice x."""\n',
           "test": "def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(-1.5) == -3.0\n",
           "entry_point": "double"}
ANSWER = json.dumps(PROBLEM)
RIGHT = "    return 2 * x\n"
LIMITS = sandbox.Limits(timeout=10)


def run(completion: str, limits: sandbox.Limits = LIMITS) -> tuple:
    """The judge on the completion: (its Verdict, the sandbox's Finished: output and all)."""
    done = sandbox.run(humaneval.runner(), json.dumps(humaneval.job(completion, PROBLEM)).encode(), limits)
    return humaneval.verdict(done, limits), done


def probes(*lines: str) -> str:
    """A completion defining the right function whose module code runs the probes (each a statement that prints
    LEAK ... when it gets through), then PROBES-RAN."""
    body = "\n".join(f"try:\n{textwrap.indent(line, '    ')}\nexcept BaseException as e:\n    print('blocked', "
                     "type(e).__name__)" for line in lines)
    return f"def double(x):\n    return 2 * x\n\nimport os, sys\n{body}\nprint('PROBES-RAN', flush=True)\n"


def leftovers(token: str) -> list[str]:
    """Processes on this machine whose command line holds the token."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if token.encode() in cmdline and int(pid) != os.getpid():
            found.append(cmdline.replace(b"\0", b" ").decode(errors="replace")[:120])
    return found


def test_the_right_answer_passes_and_wrong_ones_fail_with_their_reason():
    assert run(RIGHT)[0] == humaneval.Verdict(1.0, "passed", "")
    verdict, _ = run("    return x + 2\n")
    assert (verdict.credit, verdict.outcome) == (0.0, "failed")
    assert "line 3 of the tests: assert candidate(-1.5) == -3.0" in verdict.detail
    verdict, _ = run("    return undefined_name\n")
    assert verdict.outcome == "failed" and "NameError" in verdict.detail
    assert run("    while True:\n        pass\n", sandbox.Limits(timeout=2))[0].outcome == "timeout"
    assert run("def double(x) return 1\n")[0].outcome == "failed"  # a syntax error


@pytest.mark.parametrize("completion", [
    "def double(x):\n    return 0\nimport sys\nsys.exit(0)\n",
    "def double(x):\n    return 0\nexit()\n",
    "def double(x):\n    return 0\nimport os\nos._exit(0)\n",
    "def double(x):\n    return 0\nraise SystemExit\n",
    "    import sys\n    sys.exit(0)\n",
    "    import os\n    os._exit(0)\n",
    "    import os, signal\n    os.kill(os.getppid(), signal.SIGKILL)\n",  # the judge itself
    "    import os, signal\n    os.kill(os.getpid(), signal.SIGKILL)\n",
])
def test_an_exit_before_the_tests_finish_is_not_a_pass(completion):
    verdict, _ = run(completion)
    assert verdict.credit == 0.0 and verdict.outcome in ("exited", "failed", "error"), verdict
    assert verdict.detail


def test_an_object_equal_to_everything_is_not_a_pass():
    completion = ("class Anything:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n\n"
                  "def double(x):\n    return Anything()\n")
    verdict, _ = run(completion)
    assert verdict.outcome == "failed" and "assertion failed" in verdict.detail


def test_a_forged_report_is_not_a_pass():
    """The pass token, written everywhere the program can write: every descriptor, the judge's through /proc, its
    own output; then an exit with status 0."""
    token = json.dumps({"status": "passed", "detail": ""}) + "\n"
    forge = (f"def double(x):\n    return 0\n\nimport os\nTOKEN = {token!r}.encode()\n"
             "for fd in range(3, 256):\n    try:\n        os.write(fd, TOKEN)\n    except OSError:\n        pass\n"
             "for fd in range(256):\n    try:\n        with open(f'/proc/{os.getppid()}/fd/{fd}', 'wb') as f:\n"
             "            f.write(TOKEN)\n        print('LEAK judge fd', fd)\n    except OSError:\n        pass\n"
             "print(TOKEN.decode(), flush=True)\nos._exit(0)\n")
    verdict, done = run(forge)
    assert verdict.credit == 0.0 and verdict.outcome in ("exited", "failed"), verdict  # the token as its reply
    assert "LEAK" not in done.output


def test_the_program_cannot_reach_the_judge_or_read_the_tests():
    verdict, done = run(probes(
        "print('LEAK mem', open(f'/proc/{os.getppid()}/mem', 'rb').read(1))",
        "print('LEAK environ', open(f'/proc/{os.getppid()}/environ', 'rb').read(50))",
        "print('LEAK fds', os.listdir(f'/proc/{os.getppid()}/fd'))",
        "import ctypes; r = ctypes.CDLL(None).ptrace(16, os.getppid(), 0, 0); print('LEAK ptrace' if r == 0 else 'no')",
        "print('LEAK stdin', open(f'/proc/{os.getppid()}/fd/0', 'rb').read())",
    ))
    assert "PROBES-RAN" in done.output, done.output
    assert "LEAK" not in done.output and "candidate(-1.5)" not in done.output, done.output
    assert verdict.outcome == "passed"  # the probes failed; the function is right


def test_writes_outside_the_scratch_folder_do_not_land(tmp_path):
    """Into a folder of the user's, into opd's own package, into the Python installation: directly, after a chdir
    with a relative path, through a dir_fd, through sqlite and shutil."""
    package = Path(sandbox.__file__).parent
    before = {p: p.read_bytes() for p in package.glob("*.py")}
    targets = [tmp_path / "marker", package / "marker.py", package / "sandbox.py", Path(sys.base_prefix) / "marker"]
    lines = []
    for t in map(str, targets):
        lines += [f"open({t!r}, 'w').write('x'); print('LEAK open')",
                  f"os.chdir({os.path.dirname(t)!r}); open({os.path.basename(t)!r}, 'a').write('x'); print('LEAK cwd')",
                  f"d = os.open({os.path.dirname(t)!r}, os.O_RDONLY); os.open({os.path.basename(t)!r}, "
                  f"os.O_WRONLY | os.O_CREAT, dir_fd=d); print('LEAK dir_fd')",
                  f"import sqlite3; sqlite3.connect({t!r}).execute('create table t(x)'); print('LEAK sqlite')",
                  f"import shutil; open('/tmp/x', 'w').write('x'); shutil.copy('/tmp/x', {t!r}); print('LEAK copy')"]
    verdict, done = run(probes(*lines))
    assert "PROBES-RAN" in done.output and "LEAK" not in done.output, done.output
    assert not any(t.exists() for t in targets if t.name == "marker" or t.name == "marker.py")
    assert {p: p.read_bytes() for p in package.glob("*.py")} == before
    assert verdict.outcome == "passed"


def test_files_outside_the_sandbox_cannot_be_read(tmp_path):
    secret = uuid.uuid4().hex
    planted = tmp_path / "secret.txt"
    planted.write_text(secret)
    home = Path.home() / f".opd-test-secret-{secret[:8]}"
    home.write_text(secret)
    try:
        verdict, done = run(probes(*[f"print('LEAK', open({str(p)!r}).read())" for p in
                                     (planted, home, Path(sandbox.__file__), "/etc/passwd", "/etc/hostname")]))
    finally:
        home.unlink()
    assert "PROBES-RAN" in done.output and "LEAK" not in done.output and secret not in done.output, done.output
    assert secret not in verdict.detail


def test_there_is_no_network():
    """A TCP and a UDP server of the test's on this machine's loopback: the program reaches neither."""
    tcp, udp = socket.socket(), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(5)
    udp.bind(("127.0.0.1", 0))
    tcp.settimeout(0.5)
    udp.settimeout(0.5)
    port, uport = tcp.getsockname()[1], udp.getsockname()[1]
    try:
        verdict, done = run(probes(
            f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('LEAK tcp')",
            f"import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.sendto(b'x', ('127.0.0.1', "
            f"{uport})); print('sent udp')",
            "import socket; socket.create_connection(('1.1.1.1', 53), timeout=2); print('LEAK internet')",
            "import socket; print('LEAK dns', socket.gethostbyname('pypi.org'))"))
        with pytest.raises(socket.timeout):
            tcp.accept()
        with pytest.raises(socket.timeout):
            udp.recvfrom(10)
    finally:
        tcp.close()
        udp.close()
    assert "PROBES-RAN" in done.output and "LEAK" not in done.output, done.output


def test_every_process_it_starts_dies_with_it():
    """Children in a new session, a double fork, _posixsubprocess directly (no audit event), posix_spawn, a thread:
    none outlives the run."""
    token = f"{time.time_ns() % 10**9}.5"
    verdict, done = run(probes(
        f"import subprocess; subprocess.Popen(['sleep', '{token}'], start_new_session=True)",
        f"if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        os.execvp('sleep', ['sleep', '{token}'])"
        f"\n    os._exit(0)",
        f"import _posixsubprocess\nr, w = os.pipe()\n_posixsubprocess.fork_exec(['sleep', '{token}'], "
        f"[b'/usr/bin/sleep'], True, (w,), None, None, -1, -1, -1, -1, -1, -1, r, w, False, True, -1, None, None, "
        f"None, -1, None, False)",
        f"os.posix_spawn('/usr/bin/sleep', ['sleep', '{token}'], {{}}, setsid=True)",
        "import threading; threading.Thread(target=lambda: [None for _ in iter(int, 1)]).start()",
        "import time; time.sleep(0.5)",
        f"print('sleepers', sum(b'{token}' in open(f'/proc/{{p}}/cmdline', 'rb').read() for p in os.listdir('/proc') "
        f"if p.isdigit()))"))
    assert "PROBES-RAN" in done.output and "sleepers 4" in done.output, done.output
    assert verdict.outcome == "passed"  # right answer: the tests returned, and the rest was killed
    deadline = time.monotonic() + 3
    while leftovers(token) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftovers(token) == []


def test_a_fork_bomb_is_bounded():
    token = uuid.uuid4().hex
    bomb = ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    completion = (f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', {bomb!r}, '{token}'])\n")
    start = time.monotonic()
    verdict, _ = run(completion, sandbox.Limits(timeout=4))
    assert verdict.credit == 0.0 and time.monotonic() - start < 15
    deadline = time.monotonic() + 3
    while leftovers(token) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftovers(token) == []


def test_memory_is_bounded():
    """One process: its address space. Processes together: the sandbox's cgroup where opd may make one (each child
    holds 400 MB until killed; held together they would pass the cgroup's limit)."""
    verdict, _ = run("    return len(bytearray(8 << 30))\n")
    assert verdict.outcome == "failed" and "MemoryError" in verdict.detail
    spread = ("import os, time\nfor _ in range(8):\n    if os.fork() == 0:\n        b = bytearray(400 << 20)\n"
              "        for i in range(0, len(b), 4096):\n            b[i] = 1\n        time.sleep(2)\n"
              "        os._exit(0)\n"
              "held = sum(os.wait()[1] == 0 for _ in range(8))\nprint('held', held, flush=True)\n"
              "def double(x):\n    return 2 * x\n")
    verdict, done = run(spread, sandbox.Limits(timeout=30))
    if done.isolation == "bubblewrap+cgroup":
        limit_mb = LIMITS.memory_mb + LIMITS.scratch_mb + 256
        held = [int(line.split()[1]) for line in done.output.splitlines() if line.startswith("held ")]
        assert not held or held[0] * 400 < limit_mb, done.output  # or the judge itself was killed
    else:
        print(f"no cgroup here ({done.isolation}): the rlimits alone bound the processes")


def test_an_output_flood_is_cut_and_counted_without_growing_opd():
    flood = "    import sys\n    while True:\n        sys.stderr.write('x' * (1 << 20))\n"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    verdict, done = run(flood)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert verdict.outcome == "output" and done.dropped > 0, verdict
    assert len(done.output.encode()) <= LIMITS.output_kb << 10
    assert grown_mb < 64


def test_a_thread_left_running_does_not_hold_the_verdict():
    spinning = "import threading\nthreading.Thread(target=lambda: [None for _ in iter(int, 1)]).start()\n"
    start = time.monotonic()
    assert run(f"{spinning}def double(x):\n    return 2 * x\n")[0].outcome == "passed"
    assert run(f"{spinning}def double(x):\n    return 3 * x\n")[0].outcome == "failed"
    assert time.monotonic() - start < 8


def test_it_runs_unprivileged_with_no_capabilities():
    verdict, done = run(probes("print('uid', os.getuid(), os.geteuid())",
                               "s = open('/proc/self/status').read(); print([l for l in s.splitlines() if "
                               "l.startswith(('CapEff', 'CapPrm', 'NoNewPrivs'))])",
                               "os.setuid(0); print('LEAK setuid')"))
    assert "PROBES-RAN" in done.output and "LEAK" not in done.output
    assert "uid 0 " not in done.output and "CapEff:\\t0000000000000000" in done.output, done.output


def test_files_are_bounded_and_the_scratch_folder_is_private():
    """/tmp (64 MB) and /dev/shm (16 MB) are the only writable places; the folders bwrap makes (/, /dev) are not."""
    verdict, done = run(probes(*SCRATCH_PROBES))
    assert "PROBES-RAN" in done.output and "LEAK" not in done.output, done.output
    assert "tmp holds ['big']" in done.output  # the cut file, and nothing of the machine's /tmp


SCRATCH_PROBES = (
    "open('/tmp/big', 'wb').write(b'x' * (64 << 20)); print('LEAK big file')",
    "for d in ('/', '/dev', '/usr', '/opd-site'):\n    try:\n        open(d.rstrip('/') + '/x', 'w').write('x')\n"
    "        print('LEAK write', d)\n    except OSError:\n        pass",
    "for i in range(40):\n    open(f'/dev/shm/{i}', 'wb').write(b'x' * (1 << 20))\nprint('LEAK shm')",
    "print('tmp holds', os.listdir('/tmp'))")


# ---- where there is no sandbox -------------------------------------------------------------------------------------

@pytest.fixture
def no_sandbox(tmp_path, monkeypatch):
    """bwrap as a kernel that refuses user namespaces answers it."""
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("OPD_BWRAP", str(fake))
    sandbox.unavailable.cache_clear()
    yield fake
    sandbox.unavailable.cache_clear()


def test_where_bwrap_cannot_run_nothing_runs_unless_the_user_says_so(no_sandbox, monkeypatch):
    assert sandbox.isolation() == "unavailable: bwrap failed: bwrap: setting up uid map: Permission denied"
    with pytest.raises(OpdError, match="cannot run model-written code in a sandbox.*--unsafe-exec"):
        run(RIGHT)
    monkeypatch.setenv(sandbox.UNSAFE_ENV, "1")
    verdict, done = run(RIGHT)
    assert verdict.outcome == "passed" and done.isolation == "none (--unsafe-exec)"
    assert "isolation none" in verdict.detail  # every result says so
    assert run("    import os\n    os._exit(0)\n")[0].outcome == "exited"  # the judge holds without the sandbox


def test_opd_eval_refuses_to_execute_without_a_sandbox(no_sandbox, tmp_path):
    from helpers import make_checkpoint
    model = make_checkpoint(tmp_path / "model", 0)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def double(x):", "answer": ANSWER}) + "\n")
    args = ["eval", "--model", model, "--prompts", prompts, "--scoring", "humaneval", "--n", "1",
            "--max-new-tokens", "4", "--out", tmp_path / "out.jsonl"]
    assert_one_line_error(opd(*args), "cannot run model-written code in a sandbox", "--unsafe-exec")
    assert not (tmp_path / "out.jsonl").exists()
    allowed = opd(*args, "--unsafe-exec")
    assert allowed.returncode == 0, allowed.stderr
    assert json.loads(allowed.stdout)["eval/isolation"] == "none (--unsafe-exec)"
    record = json.loads((tmp_path / "out.jsonl").read_text())
    assert record["credit"] == 0.0 and record["outcome"] == "failed" and record["detail"]


def test_the_user_namespace_path_runs_as_an_unprivileged_user(tmp_path):
    """opd run by a user that is not root: bwrap's own user namespace. Run here by dropping to uid 65534 with the
    system's Python (the test's own Python may sit in root's home, which that user cannot enter)."""
    system = Path("/usr/bin/python3")
    if not system.is_file():
        pytest.skip("no /usr/bin/python3 to run opd's sandbox as another user")
    probe = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "unshare", "-U", "true"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"this kernel refuses unprivileged user namespaces ({probe.stderr.strip()[:80]}): the path opd "
                    "takes there is refusal, tested with a failing bwrap")
    copy = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        package = Path(sandbox.__file__).parents[1]
        for name in ("data/sandbox.py", "io/errors.py", "data/judge.py"):
            (copy / "opd" / name).parent.mkdir(parents=True, exist_ok=True)
            (copy / "opd" / name).write_bytes((package / name).read_bytes())
        for folder in ("", "data", "io"):
            (copy / "opd" / folder / "__init__.py").write_text("")
        (copy / "program.py").write_text(probes(
            "print('uid', os.getuid())", "if os.fork() == 0:\n    os.setsid()\n    os.execvp('sleep', ['sleep', '77.25'])",
            "import socket; socket.create_connection(('1.1.1.1', 53), timeout=1); print('LEAK network')",
            *SCRATCH_PROBES))
        script = (f"import json, sys; sys.path.insert(0, {str(copy)!r})\nfrom opd.data import sandbox\n"
                  f"done = sandbox.run(open({str(copy / 'program.py')!r}).read())\n"
                  "print(json.dumps([done.returncode, done.output, done.isolation]))\n")
        for path in copy.rglob("*"):
            path.chmod(0o755)
        copy.chmod(0o755)
        result = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(system), "-c",
                                 script], capture_output=True, text=True, timeout=60, cwd="/")
    finally:
        shutil.rmtree(copy)
    assert result.returncode == 0, result.stderr
    returncode, output, isolation = json.loads(result.stdout.strip().splitlines()[-1])
    assert returncode == 0 and isolation == "bubblewrap" and "uid 65534" in output, output
    assert "PROBES-RAN" in output and "LEAK" not in output and "tmp holds ['big']" in output, output
    time.sleep(0.5)
    assert leftovers("77.25") == []


# ---- the codec: values cross as plain data -------------------------------------------------------------------------

def test_values_cross_the_pipe_exactly():
    import numpy as np
    values = [None, True, 0, -3, 10**30, 1.5, -0.0, float("inf"), "é\n", [1, (2, 3)], (1,), {(1, 2): [3], "a": None},
              {1, 2}, frozenset({"x"}), b"\x00\xff", 1 + 2j, np.int64(7), np.float32(0.5), np.bool_(True),
              np.arange(6).reshape(2, 3)]
    for value in values:
        back = judge.decode(json.loads(json.dumps(judge.encode(value))))
        assert type(back) is type(value), (value, back)
        if isinstance(value, np.ndarray):
            assert back.dtype == value.dtype and (back == value).all()
        else:
            assert back == value or (back != back and value != value)
    nan = judge.decode(json.loads(json.dumps(judge.encode(float("nan")))))
    assert nan != nan
    assert judge.decode(judge.encode(-0.0)).hex() == (-0.0).hex()


def test_anything_else_arrives_as_an_opaque_value_that_equals_nothing():
    for value in (lambda: 1, iter([1]), object(), np_object_array()):
        back = judge.decode(json.loads(json.dumps(judge.encode(value))))
        assert isinstance(back, judge.Opaque) and back != back.text and back != value


def np_object_array():
    import numpy as np
    return np.array([object()], dtype=object)


def test_malformed_replies_are_refused():
    for data in ({"l": 1}, {"x": []}, {"l": [], "t": []}, {"d": [[1]]}, {"c": ["a", 1]}, {"n": ["O", 1]},
                 {"a": ["<f8", [2], {"l": [1, 2, 3]}]}, [1], {"b": 3}):
        with pytest.raises((ValueError, TypeError)):
            judge.decode(data)
