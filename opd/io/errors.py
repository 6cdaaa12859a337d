"""One exception type for every user-facing problem.

Anything the user can fix (a bad path, a bad config value, a malformed file) raises `OpdError` with one
line that names the problem and the fix. The CLI prints that line and exits non-zero; everything else is
a bug and keeps its traceback.
"""


class OpdError(Exception):
    def __init__(self, problem: str, fix: str = ""):
        self.problem, self.fix = problem, fix
        super().__init__(f"{problem} ({fix})" if fix else problem)


def require(ok: bool, problem: str, fix: str = "") -> None:
    if not ok:
        raise OpdError(problem, fix)


def first_line(e: BaseException) -> str:
    """An exception's message, first line only (or its type's name when it has none): for one-line errors."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def from_os_error(e: OSError) -> OpdError:
    """An error of the operating system (a full disk, a path that is not there or not writable) as one line that
    names the path and the system's reason."""
    where = f": {e.filename}" if e.filename else ""
    return OpdError(f"{e.strerror or e}{where}", "check that the path exists and is writable, and that the disk "
                    "has room")
