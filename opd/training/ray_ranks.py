"""A sharded learner's ranks placed by Ray (`ray.learner: true`): `opd train` with `compute.learner_ranks` N starts the
N ranks on the Ray cluster at `ray.address` instead of as N processes on this machine (sharded.launch), for users
whose rollouts and teacher already run on a Ray cluster (the frameworks they use place every role as Ray actors).

- **Placement.** One placement group of N bundles, each `ray.learner_cpus` CPUs and `ray.learner_gpus` GPUs, packed
  onto as few nodes as hold them (PACK: collectives stay inside a node where they can). A cluster that cannot hold
  them is refused before any rank starts: at once where its total resources are short, after `ray.connect_timeout`
  where the free ones are (Ray would wait for ever).
- **A rank** is a `RankActor` in its bundle that runs this same `opd train` command as a child process with the rank's
  torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK): the process a torchrun job would start, so everything after the
  start is sharded.py's, unchanged. With GPUs, Ray gives each actor its own (CUDA_VISIBLE_DEVICES), so the rank's
  device is its first visible one (LOCAL_RANK 0); on CPUs LOCAL_RANK is its place among the ranks of its node.
- **Rendezvous.** Ranks on one node meet through a file store in a folder of rank 0's (no listening socket, as
  sharded.launch); ranks on several nodes through PyTorch's TCP store on rank 0's node (MASTER_ADDR its address,
  MASTER_PORT a port free there, as torchrun's). That port, and gloo's or NCCL's between the ranks, are as reachable
  as the nodes' network: keep the cluster on a private one (ray_backend.py says why for Ray itself).
- **Files.** The config and run directory are passed as absolute paths; on several nodes they must be on a file
  system every rank reads and rank 0 writes (as with torchrun). Rank 0's output comes back to this terminal as it
  is written (progress included), the others' is kept for the one error line of a failure.
- **Faults.** A rank that exits with an error, or whose actor dies (killed, its node lost), stops the others (SIGTERM,
  then SIGKILL after 30 s) and `opd train` exits with its status after one line; the last checkpoint stands. Ctrl-C
  is passed to every rank, which stops at a step boundary and saves, as on one machine.

Not here: the rollouts of a rank on Ray actors (each rank's rollout worker is a process beside it, as with torchrun;
async.backend ray with several ranks is refused).
"""
import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from opd.config.sections import RayConfig
from opd.io.errors import OpdError, first_line, require
from opd.training.ray_backend import _ray, join
from opd.training.sharded import failure_line

GRACE = 30.0  # seconds a stopped rank gets between SIGTERM and SIGKILL
POLL = 0.2


class RankActor:
    """One learner rank: `python -m opd.cli <argv>` as a child process with the rank's environment."""

    def __init__(self):
        self.proc, self.store, self.readers = None, None, []
        self.out, self.err, self.lock = [], [], threading.Lock()

    def where(self) -> dict:
        ray = _ray()
        return {"node": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "gpus": [str(g) for g in ray.get_gpu_ids()]}

    def rendezvous(self, one_node: bool, ip: str) -> dict:
        """Rank 0's: where the ranks meet (a file store here, or a TCP store on a free port of this node)."""
        if one_node:
            self.store = tempfile.mkdtemp(prefix="opd-ranks-")
            return {"OPD_RENDEZVOUS": f"file://{self.store}/s", "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return {"MASTER_ADDR": ip, "MASTER_PORT": str(port)}

    def start(self, argv: list[str], env: dict, cwd: str, keep_stdout: bool) -> int:
        import ctypes
        # the rank gets SIGTERM when this actor's process ends (Ray kills a job's actors when the `opd train` that owns
        # them ends, however it ends): no rank outlives its run holding a device. prctl(PR_SET_PDEATHSIG) is looked
        # up here, before the fork: no loader lock is taken between fork and exec
        die_with_parent = functools.partial(ctypes.CDLL(None, use_errno=True).prctl, 1, signal.SIGTERM)
        environ = os.environ | env
        for key in [k for k, v in env.items() if v is None]:
            environ.pop(key, None)
        self.proc = subprocess.Popen([sys.executable, "-m", "opd.cli", *argv], env=environ, preexec_fn=die_with_parent,
                                     cwd=cwd if os.path.isdir(cwd) else None, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE if keep_stdout else subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        streams = [(self.proc.stderr, self.err)] + ([(self.proc.stdout, self.out)] if keep_stdout else [])
        self.readers = [threading.Thread(target=self._read, args=pair, daemon=True) for pair in streams]
        for reader in self.readers:
            reader.start()
        return self.proc.pid

    def _read(self, stream, into: list) -> None:
        for chunk in iter(lambda: os.read(stream.fileno(), 4096), b""):
            with self.lock:
                into.append(chunk)

    def poll(self) -> tuple:
        """-> (exit status or None while it runs, stdout and stderr since the last poll)."""
        code = self.proc.poll()
        if code is not None:
            for reader in self.readers:  # the last chunks, up to the pipes' end
                reader.join(timeout=10)
        with self.lock:
            out, err = b"".join(self.out), b"".join(self.err)
            self.out.clear()
            self.err.clear()
        return code, out, err

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)

    def stop(self, grace: float = GRACE) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.store:
            import shutil
            shutil.rmtree(self.store, ignore_errors=True)


def launch(argv: list[str], ranks: int, settings: RayConfig) -> int:
    """Run `opd <argv>` as `ranks` learner ranks placed by Ray (module docstring) and wait -> the exit status."""
    ray = _ray()
    started = join(settings)
    pg, actors = None, []
    try:
        pg, actors = _place(ray, ranks, settings)
        return _run(ray, actors, argv, settings)
    finally:
        stopping = [a.stop.remote() for a in actors]  # all at once: SIGTERM, then SIGKILL after GRACE
        ray.wait(stopping, num_returns=len(stopping), timeout=GRACE + 10)
        for a in actors:
            ray.kill(a)
        if pg is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(pg)
        if started:
            ray.shutdown()


def _place(ray, ranks: int, settings: RayConfig) -> tuple:
    """The placement group and one RankActor in each bundle, or one line on why the cluster cannot hold them."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    cpus, gpus = settings.learner_cpus, settings.learner_gpus
    total = ray.cluster_resources()
    have = f"the Ray cluster has {total.get('CPU', 0.0):g} CPUs and {total.get('GPU', 0.0):g} GPUs"
    need = f"{ranks} learner ranks of {cpus:g} CPUs and {gpus:g} GPUs each"
    fix = "lower compute.learner_ranks, ray.learner_cpus or ray.learner_gpus, or add nodes to the cluster"
    require(ranks * cpus <= total.get("CPU", 0.0) + 1e-9 and ranks * gpus <= total.get("GPU", 0.0) + 1e-9,
            f"{have}; {need} do not fit", fix)
    bundle = {k: v for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0}
    pg = placement_group([bundle] * ranks, strategy="PACK")
    done, _ = ray.wait([pg.ready()], timeout=settings.connect_timeout)
    if not done:
        remove_placement_group(pg)
        raise OpdError(f"{have}, but {need} could not be placed within {settings.connect_timeout:g} s (its free "
                       f"resources: {ray.available_resources().get('CPU', 0.0):g} CPUs, "
                       f"{ray.available_resources().get('GPU', 0.0):g} GPUs)", fix + ", or raise ray.connect_timeout")
    actor = ray.remote(RankActor)
    actors = [actor.options(num_cpus=cpus, num_gpus=gpus, max_restarts=0, scheduling_strategy=(
        PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i))).remote()
        for i in range(ranks)]
    return pg, actors


def _run(ray, actors: list, argv: list[str], settings: RayConfig) -> int:
    try:
        _start(ray, actors, argv, settings)
    except OpdError:
        raise
    except Exception as e:  # noqa: BLE001 (an actor that does not start: Ray's errors, a timeout)
        raise OpdError(f"the learner ranks did not start on the Ray cluster: {first_line(e)}",
                       "check that every node has this opd installed, or raise ray.connect_timeout") from None
    return _wait(ray, actors, settings)


def _start(ray, actors: list, argv: list[str], settings: RayConfig) -> None:
    """Each actor's rank process started, with its rank's variables and the rendezvous."""
    where = ray.get([a.where.remote() for a in actors], timeout=settings.connect_timeout)
    nodes = [w["node"] for w in where]
    meet = ray.get(actors[0].rendezvous.remote(len(set(nodes)) == 1, where[0]["ip"]), timeout=settings.connect_timeout)
    ranks = len(actors)
    threads = os.environ.get("OMP_NUM_THREADS")  # the user's, not the one Ray sets for its workers
    refs = []
    for rank, (a, w) in enumerate(zip(actors, where)):
        local = 0 if w["gpus"] else nodes[:rank].count(w["node"])
        env = meet | {"RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(local), "OPD_LAUNCHER": "ray",
                      "TORCH_CPP_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": threads}
        refs.append(a.start.remote(argv, env, os.getcwd(), rank == 0))
    ray.get(refs, timeout=settings.connect_timeout)


def _wait(ray, actors: list, settings: RayConfig) -> int:
    """Rank 0's output passed through until every rank has exited, or one failed -> the exit status."""
    ranks = len(actors)
    codes, tails, said = [None] * ranks, [b""] * ranks, False
    interrupted = False
    while True:
        try:
            for rank, a in enumerate(actors):
                if codes[rank] is not None:
                    continue
                try:
                    code, out, err = ray.get(a.poll.remote(), timeout=settings.connect_timeout)
                except Exception as e:  # noqa: BLE001 (RayActorError, GetTimeoutError: the rank is lost)
                    code, out, err = -1, b"", f"opd: error: learner rank {rank}'s Ray actor was lost: " \
                        f"{first_line(e)}\n".encode()
                if rank == 0:
                    sys.stdout.buffer.write(out)
                    sys.stdout.flush()
                    sys.stderr.buffer.write(err)
                    sys.stderr.flush()
                    said = said or b"opd: error:" in err
                else:
                    tails[rank] = (tails[rank] + err)[-65536:]
                codes[rank] = code
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed or all(c == 0 for c in codes):
                break
            time.sleep(POLL)
        except KeyboardInterrupt:  # every rank stops at its next step boundary and saves
            if interrupted:
                raise
            interrupted = True
            for a in actors:
                a.signal.remote(signal.SIGINT)
    if not failed:
        return 0
    for a in actors:  # the others are stopped; the failing rank's line is the one to show
        a.signal.remote(signal.SIGTERM)
    rank, code = failed[0]
    if rank > 0 and not said:
        print(failure_line(rank, code, tails[rank].decode(errors="replace")), file=sys.stderr)
    return code if code > 0 else 1
