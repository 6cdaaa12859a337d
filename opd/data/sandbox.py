"""Running code a model wrote in an operating-system sandbox (bubblewrap), never in opd's own process.

`run(source, stdin, limits)` runs the Python program `source` with `python -I` inside bubblewrap (`bwrap`, Debian's
`bubblewrap`; `make install` installs it where it can), which gives it, before a line of it runs:
- **a filesystem of its own**, read-only: /usr, the Python installation it runs on and (where opd's environment has
  it) numpy's package. Its only writable place is /tmp, a private tmpfs of `scratch_mb` that is also its home and
  working folder and vanishes with it. Nothing else of the machine is there: not /etc, not the user's home, not the
  project, not opd's package or cache.
- **no network**: a network namespace of its own (a loopback nobody else is on).
- **a pid namespace of its own**: it sees and signals only its own processes, and when the sandbox ends (an exit, the
  timeout, the output limit) the kernel kills every process in it, however it was started (a new session, a
  double fork, `_posixsubprocess` directly).
- **an unprivileged user**: as root, opd starts bwrap as root and the program runs as a fresh uid with no
  capabilities and no way to gain any (util-linux's `setpriv`: `--bounding-set=-all --no-new-privs`); as any other
  user, bwrap's user namespace (no capabilities, no nested user namespaces) and the user's own uid.
- **limits** (rlimits set by a prelude before the program runs, inherited by all it starts): address space per
  process, CPU seconds, the size of a file, open files, processes and threads of its user, no core dumps; where opd
  may make a cgroup (root, cgroup v1 or v2), the memory and the number of processes of the whole sandbox too.
- **bounded output**: stdout and stderr of everything in it share one pipe; the first `output_kb` are kept, and past
  them the sandbox is killed and `Finished.dropped` counts what was cut; a wall-clock `timeout`, then killed.
A separate pipe (its descriptor in the environment variable OPD_REPORT_FD) carries what the program reports; only the
process the sandbox started holds it (judge.py relies on that for HumanEval's pass, which a completion cannot forge).

What it does not guard against: the kernel itself (a kernel exploit from inside the namespaces), and the CPU time and
memory bandwidth the program takes from the machine within its limits. Where bwrap is missing or the kernel refuses
its namespaces, `run` refuses with the reason and the fix (OpdError) instead of running anything; `--unsafe-exec`
(`OPD_UNSAFE_EXEC=1`) runs the program without the sandbox, with the rlimits and the separate report pipe only, and
every result says so (`Finished.isolation`).
"""
import functools
import importlib.util
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from opd.io.errors import OpdError

UNSAFE_ENV = "OPD_UNSAFE_EXEC"
REPORT_LIMIT = 64 << 10  # bytes of a report kept
SHM_MB = 16  # /dev/shm (multiprocessing's semaphores)
SITE = "/opd-site"  # where numpy's package is mounted inside (the prelude puts it on sys.path)
INSTALL_FIX = ("install bubblewrap (apt-get install bubblewrap; make install does it as root) and let the kernel "
               "create user namespaces (sysctl kernel.unprivileged_userns_clone=1 or user.max_user_namespaces > 0), "
               "or pass --unsafe-exec to run model-written code without a sandbox")

# Runs first in the sandbox, as the program's own user: the limits, then the program (argv[1] the limits as JSON).
PRELUDE = r'''
import json, os, resource, sys
_limits = json.loads(sys.argv[1])
for _name, _value in (("RLIMIT_AS", _limits["memory_mb"] << 20), ("RLIMIT_CPU", int(_limits["timeout"]) + 1),
                      ("RLIMIT_FSIZE", _limits["file_mb"] << 20), ("RLIMIT_NOFILE", _limits["open_files"]),
                      ("RLIMIT_NPROC", _limits["processes"]), ("RLIMIT_CORE", 0)):
    if _value or _name == "RLIMIT_CORE":
        resource.setrlimit(getattr(resource, _name), (_value, _value))
if os.path.isdir("''' + SITE + r'''"):
    sys.path.append("''' + SITE + r'''")
del _limits, _name, _value
'''


@dataclass(frozen=True)
class Limits:
    timeout: float = 10.0  # wall-clock seconds
    memory_mb: int = 1024  # address space of each process
    processes: int = 16  # processes and threads of the sandbox's user
    file_mb: int = 16  # the largest file it may write
    scratch_mb: int = 64  # its /tmp
    open_files: int = 64
    output_kb: int = 256  # stdout + stderr kept; past it, killed


@dataclass(frozen=True)
class Finished:
    returncode: int | None  # None: killed (timeout or output past the limit)
    report: bytes  # what the program wrote on $OPD_REPORT_FD (the first REPORT_LIMIT bytes)
    output: str  # the first output_kb of its stdout + stderr
    dropped: int  # output bytes past the limit (the sandbox was killed when it passed it)
    timed_out: bool
    isolation: str  # "bubblewrap", "bubblewrap+cgroup", or "none (--unsafe-exec)"


def run(source: str, stdin: bytes = b"", limits: Limits = Limits()) -> Finished:
    """Run the Python program `source` in the sandbox (module docstring), `stdin` on its standard input."""
    unsafe = os.environ.get(UNSAFE_ENV) == "1"
    require_sandbox()
    cgroup = None if unsafe else Cgroup.make(limits)
    read_report, write_report = os.pipe()
    rlimits = asdict(limits) | ({"processes": 0} if unsafe else {})  # outside the sandbox: the user's own count
    argv = [python(), "-I", "-c", PRELUDE + source, json.dumps(rlimits)]
    if not unsafe:
        argv = wrap(argv, write_report)
    if cgroup:
        argv = cgroup.join(argv)
    try:
        child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 pass_fds=(write_report,), env=environment(write_report),
                                 start_new_session=True, cwd="/")
    finally:
        os.close(write_report)
    isolation = "none (--unsafe-exec)" if unsafe else "bubblewrap+cgroup" if cgroup else "bubblewrap"
    try:
        return _supervise(child, stdin, os.fdopen(read_report, "rb"), limits, isolation)
    finally:
        _kill(child)
        if cgroup:
            cgroup.remove()


def require_sandbox() -> None:
    """Refuse (OpdError, with the fix) where model-written code would run without the sandbox and the user has not
    said --unsafe-exec."""
    if os.environ.get(UNSAFE_ENV) != "1" and unavailable():
        raise OpdError(f"cannot run model-written code in a sandbox: {unavailable()}", INSTALL_FIX)


def _supervise(child: subprocess.Popen, stdin: bytes, report, limits: Limits, isolation: str) -> Finished:
    output = Capped(child.stdout, limits.output_kb << 10, on_overflow=lambda: _kill(child))
    reports = Capped(report, REPORT_LIMIT)
    threads = [threading.Thread(target=t, daemon=True) for t in (output.drain, reports.drain)]
    threads.append(threading.Thread(target=_feed, args=(child.stdin, stdin), daemon=True))
    for t in threads:
        t.start()
    deadline, timed_out = time.monotonic() + limits.timeout, False
    try:
        child.wait(timeout=limits.timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill(child)
    for t in threads[:2]:  # the pipes close when every process in the sandbox is gone
        t.join(max(0.0, deadline - time.monotonic()) + 2.0)
    killed = timed_out or output.dropped > 0
    return Finished(None if killed else child.returncode, bytes(reports.kept), output.kept.decode("utf-8", "replace"),
                    output.dropped, timed_out, isolation)


class Capped:
    """Reads a pipe to its end, keeping the first `limit` bytes and counting the rest (on_overflow: called once,
    when the limit is first passed)."""

    def __init__(self, pipe, limit: int, on_overflow=None):
        self.pipe, self.limit, self.on_overflow = pipe, limit, on_overflow
        self.kept, self.dropped = bytearray(), 0

    def drain(self) -> None:
        with self.pipe:
            while chunk := self.pipe.read1(1 << 16):
                room = self.limit - len(self.kept)
                self.kept += chunk[:max(room, 0)]
                if len(chunk) > room:
                    first = self.dropped == 0
                    self.dropped += len(chunk) - max(room, 0)
                    if first and self.on_overflow:
                        self.on_overflow()


def _feed(pipe, data: bytes) -> None:
    try:
        with pipe:
            pipe.write(data)
    except (BrokenPipeError, OSError):
        pass  # the program did not read its input: its business


def _kill(child: subprocess.Popen) -> None:
    """bwrap's own process: killing it kills the sandbox's init (--die-with-parent), and with it every process in the
    sandbox's pid namespace. Unsafe mode: the process group."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        child.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def python() -> str:
    """The interpreter the program runs on: opd's own Python's base installation (not a virtual environment's
    folder, which is not mounted)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def environment(report_fd: int) -> dict:
    return {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8", "OPD_REPORT_FD":
            str(report_fd), "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def wrap(argv: list[str], report_fd: int) -> list[str]:
    """The bwrap command line that runs argv in the sandbox (module docstring), the report pipe's descriptor in
    OPD_REPORT_FD."""
    box = [bwrap(), "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
           "--hostname", "opd-sandbox", "--die-with-parent", "--new-session", "--clearenv", *_setenv(report_fd),
           *view(), "--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(Limits.scratch_mb << 20),
           "--tmpfs", "/tmp", "--perms", "1777", "--size", str(SHM_MB << 20), "--tmpfs", "/dev/shm",
           "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp"]  # the tmpfs bwrap makes, / and /dev: as
    # the user's own in a user namespace, they would be writable and unbounded
    if os.geteuid() != 0:
        box[1:1] = ["--unshare-user", "--disable-userns"]
    user = []
    if os.geteuid() == 0:  # a fresh unprivileged uid: no capabilities, no way back
        uid = str(1_000_000 + secrets.randbelow(1_000_000))
        user = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                  "--bounding-set=-all", "--no-new-privs", "--"]
    return [*box, "--", *user, *argv]


def _setenv(report_fd: int) -> list[str]:
    return [arg for key, value in environment(report_fd).items() for arg in ("--setenv", key, value)]


@functools.cache
def view() -> tuple[str, ...]:
    """bwrap's mounts: /usr and the top-level links into it, the Python installation (its site-packages hidden) and
    numpy's package, each read-only; folders above them made traversable."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = Path("/") / top
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    made = {"/", "/usr"}
    for prefix in {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix),
                   os.path.dirname(os.path.dirname(python()))}:
        if prefix != "/usr" and not prefix.startswith("/usr/"):
            args += _parents(prefix, made) + ["--ro-bind", prefix, prefix]
            site = Path(prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
            if site.is_dir():  # the base installation's own packages are not the program's
                args += ["--tmpfs", str(site), "--remount-ro", str(site)]
    numpy = importlib.util.find_spec("numpy")
    if numpy is not None and numpy.submodule_search_locations:
        package = Path(list(numpy.submodule_search_locations)[0])
        args += ["--perms", "0755", "--dir", SITE]
        for folder in (package, package.with_name("numpy.libs")):
            if folder.is_dir():
                args += ["--ro-bind", str(folder), f"{SITE}/{folder.name}"]
    return tuple(args)


def _parents(path: str, made: set) -> list[str]:
    args = []
    for parent in reversed(Path(path).parents):
        if str(parent) not in made:
            made.add(str(parent))
            args += ["--perms", "0755", "--dir", str(parent)]
    return args


def bwrap() -> str:
    """The bubblewrap binary: $OPD_BWRAP, else `bwrap` on PATH."""
    return os.environ.get("OPD_BWRAP") or shutil.which("bwrap") or "bwrap"


@functools.cache
def unavailable() -> str:
    """Why the sandbox cannot run here ("" when it can): bwrap missing, or refused by the kernel. Asked once a
    process, by running a trivial program in the real sandbox."""
    if shutil.which(bwrap()) is None:
        return "bubblewrap (bwrap) is not installed"
    done = _trivial([])
    if isinstance(done, str):
        return done
    text = done.stderr.decode("utf-8", "replace").strip().splitlines()
    return "" if done.returncode == 0 else f"bwrap failed: {text[-1] if text else f'exit status {done.returncode}'}"


def _trivial(prefix: list[str]) -> subprocess.CompletedProcess | str:
    read_report, write_report = os.pipe()
    try:
        return subprocess.run([*prefix, *wrap([python(), "-I", "-c", "pass"], write_report)], capture_output=True,
                              pass_fds=(write_report,), env=environment(write_report), timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bwrap did not start: {e}"
    finally:
        os.close(read_report)
        os.close(write_report)


def isolation() -> str:
    """What contains model-written code on this machine: "bubblewrap+cgroup", "bubblewrap", "none (--unsafe-exec)",
    or "unavailable: <why>"."""
    if os.environ.get(UNSAFE_ENV) == "1":
        return "none (--unsafe-exec)"
    problem = unavailable()
    return f"unavailable: {problem}" if problem else "bubblewrap+cgroup" if _cgroups_work() else "bubblewrap"


class Cgroup:
    """A fresh cgroup capping the whole sandbox's memory and processes, where opd may make one (cgroup v2 with the
    memory and pids controllers given to opd's own cgroup, or v1's memory and pids hierarchies; usually as root).
    Where it may not, the rlimits alone bound the sandbox (a fork bomb of `processes` processes of `memory_mb` each)."""

    def __init__(self, folders: list[Path]):
        self.folders = folders

    @classmethod
    def make(cls, limits: Limits) -> "Cgroup | None":
        return cls._make(limits) if _cgroups_work() else None

    @classmethod
    def _make(cls, limits: Limits) -> "Cgroup | None":
        memory = (limits.memory_mb + limits.scratch_mb + 256) << 20  # the program, its /tmp, the judge and bwrap
        pids = limits.processes + 8  # sh, bwrap's two processes, setpriv, the prelude's own
        name = f"opd-sandbox-{os.getpid()}-{secrets.token_hex(4)}"
        made = []
        try:
            for folder, settings in _cgroup_plan(name, memory, pids):
                folder.mkdir()
                made.append(folder)
                for file, value in settings:
                    (folder / file).write_text(value)
        except (OSError, ValueError):
            cls(made).remove()
            return None
        return cls(made) if made else None

    def join(self, argv: list[str]) -> list[str]:
        """argv, started by a shell that first moves itself into the cgroup (so every descendant is in it)."""
        files = [str(f / "cgroup.procs") for f in self.folders]
        return ["/bin/sh", "-c", 'for f in ' + " ".join(f"'{f}'" for f in files) +
                '; do echo $$ > "$f" || exit 125; done; exec "$@"', "sh", *argv]

    def remove(self) -> None:
        for folder in self.folders:
            for _ in range(50):
                try:
                    for pid in (folder / "cgroup.procs").read_text().split():
                        os.kill(int(pid), signal.SIGKILL)
                    folder.rmdir()
                    break
                except ProcessLookupError:
                    continue
                except OSError:
                    time.sleep(0.02)


@functools.cache
def _cgroups_work() -> bool:
    """Whether a sandbox started inside a fresh cgroup runs (asked once a process; opd may be allowed to make a cgroup
    it cannot move a process into)."""
    cgroup = Cgroup._make(Limits())
    if cgroup is None:
        return False
    try:
        done = _trivial(cgroup.join([]))
        return not isinstance(done, str) and done.returncode == 0
    finally:
        cgroup.remove()


def _cgroup_plan(name: str, memory: int, pids: int) -> list[tuple[Path, list[tuple[str, str]]]]:
    root = Path("/sys/fs/cgroup")
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            own[c] = path.lstrip("/")
    if (root / "cgroup.controllers").is_file():  # v2
        folder = root / own[""] / name
        parent = set((folder.parent / "cgroup.subtree_control").read_text().split())
        if not {"memory", "pids"} <= parent:
            raise ValueError("controllers not delegated")
        return [(folder, [("memory.max", str(memory)), ("memory.swap.max", "0"), ("pids.max", str(pids))])]
    memory_settings = [("memory.limit_in_bytes", str(memory))]
    if (root / "memory" / own["memory"] / "memory.memsw.limit_in_bytes").is_file():
        memory_settings.append(("memory.memsw.limit_in_bytes", str(memory)))  # no swap beyond it
    return [(root / "memory" / own["memory"] / name, memory_settings),
            (root / "pids" / own["pids"] / name, [("pids.max", str(pids))])]
