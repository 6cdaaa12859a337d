"""The Ray backend of the async schedule (`async.backend: ray`): the rollout workers as Ray actors, the learner here.

OPD set-ups outgrow one machine: rollouts on several inference replicas, the learner on its own GPUs. The frameworks
users run that on (verl, NeMo-RL, OpenRLHF, SkyRL, slime) place those roles as Ray actors, so opd does too, on Ray
itself rather than a protocol of its own. What changes against the process backend (async_rollouts.py) is only the
transport: `RayWorkers` is the same worker handle as worker.RolloutWorker (start, send, receive, stop) over N actors,
so the schedule, its bounded staleness, its staleness predicate (rollouts.too_stale), its restarts and its checkpoint
state are the async schedule's, unchanged.

- **Actors.** Each `RolloutActor` hosts a worker.WorkerCore (the process worker's model, engine and message handling)
  and reserves `ray.worker_cpus` / `ray.worker_gpus`. Messages stay wire-encoded bytes (never pickle of our objects);
  Ray runs the calls of one caller to one actor in order, so weights change only between batches, as in a process.
- **Weights** go through Ray's object store: one `ray.put` per published version, one reference to every actor.
- **Shards.** A batch is sampled as `sampling.shards` sub-batches, each from a seed of its own (rollouts.shards);
  shard j of batch i goes to actor (i * shards + j) mod N: with shards = N (the default) every actor samples a part
  of every batch; with shards = 1 whole batches go round-robin, which keeps N actors busy once `async.max_staleness`
  lets N batches be in flight. Every schedule samples a batch this way, so N actors at staleness 0 give the
  synchronous run with the same shards, step for step (tested), wherever each shard ran.
- **Faults.** An actor that dies (killed, out of memory, its node lost) fails its pending calls; one that answers
  nothing for `async.worker_timeout` while it has work counts as hung. Either is `WorkerLost`, and the schedule
  restarts the actors with the newest weights and every outstanding batch, up to `async.max_worker_restarts` times,
  then saves and stops with one line. Every wait is bounded.
- **The cluster.** `ray.address` "" starts a local cluster for the run, bound to 127.0.0.1; "auto" joins the one
  `ray start` began on this machine; HOST:PORT a remote head (checked to answer within `ray.connect_timeout` first:
  Ray itself would retry for minutes). A cluster that cannot hold the actors' resources is refused before anything
  loads. A Ray cluster is a remote-code-execution service for whoever reaches its ports: keep it on a private
  network. opd opens no port of its own.
- **The teacher** (`ray.teacher: true`) can run on a scoring actor of its own (`ray.teacher_cpus/gpus`): its body
  there, its output layer here, applied chunk by chunk (a teacher.Teacher), so what travels per micro-batch
  is token ids one way and [tokens, hidden] back, never [tokens, vocabulary]. The teacher is still loaded here once
  (to check it against the student) and shipped through the object store; then only its output layer stays. A dead
  or silent teacher actor stops the run with one line (`--resume` continues).
- **Not here (yet):** with `kv_scale=calibrate` each rollout actor calibrates its own KV scales on its first shard,
  and the checkpoint keeps the first actor's.
"""
import contextlib
import dataclasses
import logging
import os
import socket
import tempfile
import time

import torch

from opd.io import wire
from opd.io.channel import read
from opd.training.chunked import Source
from opd.io.errors import OpdError, first_line, require
from opd.training.learner import Packed, pack, packed_hidden
from opd.models.model import ModelConfig, empty_model
from opd.training.rollouts import by_sizes
from opd.config.sections import RayConfig
from opd.training.teacher import NoState, timed_source
from opd.training.worker import COMPILE_GRACE, FROM_WORKER, POLL, WorkerCore, WorkerLost, WorkerSpec, error_message, spec_tree


def _ray():
    try:
        import ray
    except ImportError:
        raise OpdError("async.backend ray and ray.learner need Ray, which is not installed",
                       "pip install -e '.[ray]' (or pip install 'ray==2.60.0')") from None
    return ray


def _reachable(address: str, timeout: float) -> None:
    """A head address answers TCP within timeout (Ray's own connect retries for minutes before it gives up)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    require(bool(host) and port.isdigit(), f"ray.address {address!r} is not HOST:PORT",
            "e.g. 10.0.0.5:6379, or auto (a `ray start` cluster on this machine), or \"\" (a local one)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise OpdError(f"the Ray cluster at {address} does not answer ({e.strerror or e})",
                       "start it with `ray start --head`, check ray.address, or raise ray.connect_timeout") from None


@contextlib.contextmanager
def _stderr_to_log():
    """File descriptor 2 into a temporary log while Ray starts (its C++ core writes there directly); the log is kept
    for the error message if the start fails."""
    log = tempfile.NamedTemporaryFile("w+b", prefix="opd-ray-", suffix=".log", delete=False)
    saved = os.dup(2)
    try:
        os.dup2(log.fileno(), 2)
        yield log
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        log.close()
    os.unlink(log.name)  # started: nothing to keep


def join(settings: RayConfig) -> bool:
    """Join (or start) the cluster at ray.address: one line on any failure. -> whether this call joined (False: this
    process was already connected)."""
    ray = _ray()
    if ray.is_initialized():
        return False
    address = settings.address
    if address not in ("", "auto"):
        _reachable(address, settings.connect_timeout)
    try:
        with _stderr_to_log() as log:  # Ray's start-up warnings (from C++, past `logging`) would bury opd's lines
            if address:
                ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
            else:  # a cluster of this run's own, reachable from this machine only
                ray.init(include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR,
                         _node_ip_address="127.0.0.1")
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise OpdError(f"cannot join the Ray cluster at {address or 'a new local cluster'!r}: {first_line(e)}",
                       f"start one with `ray start --head`, or set ray.address; Ray's output: {log.name}") \
            from None
    return True


def connect(settings: RayConfig, worker_threads: int) -> None:
    """Join (or start) the cluster and check that it can hold the rollout actors: one line on any failure."""
    ray = _ray()
    join(settings)
    total = ray.cluster_resources()
    cpus, gpus = total.get("CPU", 0.0), total.get("GPU", 0.0)
    n = settings.workers
    need_cpus = n * settings.worker_cpus + (settings.teacher_cpus if settings.teacher else 0)
    need_gpus = n * settings.worker_gpus + (settings.teacher_gpus if settings.teacher else 0)
    require(need_cpus <= cpus + 1e-9 and need_gpus <= gpus + 1e-9,
            f"the Ray cluster has {cpus:g} CPUs and {gpus:g} GPUs; {n} rollout workers"
            f"{' and the teacher' if settings.teacher else ''} need {need_cpus:g} CPUs and {need_gpus:g} GPUs",
            "lower ray.workers, ray.worker_cpus or ray.worker_gpus, or add nodes to the cluster")
    require(worker_threads <= max(1, settings.worker_cpus) or settings.worker_gpus > 0,
            f"async.worker_threads {worker_threads} is more than the {settings.worker_cpus:g} CPUs each rollout "
            "actor reserves", "raise ray.worker_cpus or lower async.worker_threads")


class TeacherActor:
    """The teacher's forward, hosted by Ray: its final hidden states at the positions the learner asks for."""

    def __init__(self, init: bytes):
        tree = wire.decode(init, what="the teacher actor's model")
        torch.set_num_threads(int(tree["threads"]))
        self.device = "cuda" if tree["gpus"] and torch.cuda.is_available() else "cpu"
        model = empty_model(ModelConfig(**tree["config"]))
        model.load_state_dict({k: v.to(self.device) for k, v in tree["state"].items()}, assign=True)
        if model.cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        self.model = model.eval().requires_grad_(False)

    def ready(self) -> bool:
        return True

    def hidden(self, data: bytes) -> bytes:
        """{"ids", "positions" [1, T], "lengths" [S], "index" [M]} (a learner.Packed) -> {"hidden" [M, d]}."""
        tree = wire.decode(data, self.device, "a request to the teacher actor")
        packed = Packed(tree["ids"], tree["positions"], tuple(tree["lengths"].tolist()), tree["index"])
        with torch.no_grad():
            hidden = packed_hidden(self.model, packed)
        return wire.encode({"hidden": hidden.cpu().contiguous()})


class RemoteTeacher(NoState):
    """The trainer's teacher on a Ray actor (a teacher.Teacher): its body runs there, its output layer here, applied
    chunk by chunk, so what travels per micro-batch is token ids one way and [tokens, hidden] back."""
    whole_rows = True

    def __init__(self, model, settings: RayConfig, threads: int, timeout: float):
        ray = _ray()
        init = wire.encode({"config": dataclasses.asdict(model.cfg), "state": model.state_dict(), "threads": threads,
                            "gpus": settings.teacher_gpus})
        actor = ray.remote(TeacherActor).options(num_cpus=settings.teacher_cpus, num_gpus=settings.teacher_gpus,
                                                 max_restarts=0)
        self.actor = actor.remote(ray.put(init))
        self.lm_head, self.cfg, self.timeout = model.lm_head, model.cfg, timeout
        self._call(self.actor.ready.remote(), settings.connect_timeout + timeout, "to start")

    def completion_hidden(self, batch) -> torch.Tensor:
        packed = pack(batch)
        data = wire.encode({"ids": packed.ids, "positions": packed.positions, "lengths": torch.tensor(packed.lengths),
                            "index": packed.index})
        out = self._call(self.actor.hidden.remote(data), self.timeout, "for a batch")
        return wire.decode(out, self.lm_head.weight.device, "the teacher actor's hidden states")["hidden"]

    @property
    def trainer(self) -> "RemoteTeacher":
        return self

    def source(self, mb) -> Source:
        return timed_source(self.completion_hidden, self, mb)

    def close(self) -> None:
        _ray().kill(self.actor, no_restart=True)

    def _call(self, ref, timeout: float, what: str):
        ray = _ray()
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.RayActorError as e:
            raise OpdError(f"the teacher actor died: {first_line(e)[:200]}",
                           "check its node's memory; the run can be resumed with --resume") from None
        except ray.exceptions.GetTimeoutError:
            raise OpdError(f"the teacher actor answered nothing within {timeout:.0f} s {what}",
                           "check the cluster (ray status); raise async.worker_timeout for a slow teacher") from None


class RolloutActor:
    """A rollout worker hosted by Ray (made a Ray actor class by RayWorkers.start): worker.WorkerCore behind two calls
    that take and return wire-encoded bytes."""

    def __init__(self, address: str, init: bytes, weights: bytes):
        self.address, self.core, self.error = address, None, None
        try:
            self.core = WorkerCore(init, weights)
        except Exception as e:  # reported by ready(), as the process worker reports it
            self.error = error_message(address, e)

    def ready(self) -> bytes:
        return self.error or wire.encode({"kind": "ready", "address": self.address, "pid": os.getpid()})

    def handle(self, data: bytes) -> bytes | None:
        try:
            return self.core.handle(self.core.read(data))
        except Exception as e:
            return error_message(self.address, e)


class RayWorkers:
    """The schedule's worker handle (worker.RolloutWorker's methods) over `settings.workers` rollout actors: a
    "generate" request is split by shard among them, and its "rollouts" message is received once every actor's part
    has arrived, in shard order."""

    def __init__(self, address: str, spec: WorkerSpec, timeout: float, settings: RayConfig):
        self.address, self.spec, self.timeout, self.settings = address, spec, timeout, settings
        self.actors: list = []
        self.pids: list[int] = []  # the actors' processes (on their nodes)
        self.pending: dict = {}  # object ref -> (key, actor index); key None: a weights update
        self.parts: dict = {}  # key -> {actor index: its "rollouts" message}
        self.layout: dict = {}  # key -> [(actor index, shard sizes)] in shard order

    @property
    def started(self) -> bool:
        """The actors run (until `stop`)."""
        return bool(self.actors)

    def start(self, weights: bytes, scales: dict) -> None:
        ray = _ray()
        init = wire.encode({"spec": spec_tree(self.spec), "scales": scales})
        actor = ray.remote(RolloutActor).options(num_cpus=self.settings.worker_cpus,
                                                 num_gpus=self.settings.worker_gpus, max_restarts=0)
        ref = ray.put(weights)
        self.actors = [actor.remote(f"{self.address}/{i}", init, ref) for i in range(self.settings.workers)]
        limit = self.settings.connect_timeout + self.timeout + (COMPILE_GRACE if self.spec.compile else 0)
        refs = [a.ready.remote() for a in self.actors]
        done, waiting = ray.wait(refs, num_returns=len(refs), timeout=limit)
        if waiting:
            raise WorkerLost(f"did not start within {limit:.0f} s (the cluster may be out of the "
                             f"{self.settings.worker_cpus:g} CPUs / {self.settings.worker_gpus:g} GPUs each needs)")
        self.pids = []
        for i, ref in enumerate(refs):
            message = self._message(self._get(ref, i))
            if message["kind"] == "error":
                raise OpdError(f"rollout worker {message['address']} failed to start: {message['message']}")
            self.pids.append(message["pid"])

    def send(self, message: dict | bytes) -> None:
        ray = _ray()
        if isinstance(message, bytes):  # weights: into the object store once, a reference to every actor
            ref = ray.put(message)
            for i, a in enumerate(self.actors):
                self.pending[a.handle.remote(ref)] = (None, i)
            return
        if message["kind"] != "generate":
            return
        key, n, m = tuple(message["key"]), len(self.actors), len(message["shards"])
        chunks = by_sizes(message["prompts"], [size for size, _ in message["shards"]])
        owner = [(key[0] * m + j) % n for j in range(m)]  # batch i's shard j: actor (i * shards + j) mod actors
        self.parts[key], self.layout[key] = {}, [(owner[j], message["shards"][j][0]) for j in range(m)]
        for i in sorted(set(owner)):
            mine = [j for j in range(m) if owner[j] == i]
            part = {"kind": "generate", "key": list(key), "prompts": [p for j in mine for p in chunks[j]],
                    "shards": [message["shards"][j] for j in mine]}
            self.pending[self.actors[i].handle.remote(wire.encode(part))] = (key, i)

    def receive(self, timeout: float | None = None, block: bool = True) -> dict | None:
        """The next message (a batch's "rollouts" once all its parts are in, or an "error"); None if not block and
        nothing is there. WorkerLost if an actor died or nothing arrived for `timeout` seconds."""
        ray = _ray()
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            if self.pending:
                done, _ = ray.wait(list(self.pending), num_returns=1, timeout=POLL if block else 0)
                for ref in done:
                    key, i = self.pending.pop(ref)
                    data = self._get(ref, i)
                    if data is None:
                        continue  # weights taken
                    message = self._message(data)
                    if message["kind"] == "error":
                        return message
                    if key not in self.parts:
                        continue  # not a batch of this run's actors (cannot happen: stop() forgets everything)
                    self.parts[key][i] = message
                    if len(self.parts[key]) == len({i for i, _ in self.layout[key]}):
                        return self._merged(key)
            elif block:
                time.sleep(POLL)
            if not block:
                return None
            if time.monotonic() > deadline:
                raise WorkerLost(f"sent nothing for {limit:.0f} s (hung)")

    def stop(self, grace: float = 0.0) -> None:
        """Kill the actors (their state is rebuilt from the newest weights at a restart)."""
        if self.actors:
            ray = _ray()
            for a in self.actors:
                ray.kill(a, no_restart=True)
        self.actors, self.pids, self.pending, self.parts, self.layout = [], [], {}, {}, {}

    # -- internals -------------------------------------------------------------------------------------------------
    def _get(self, ref, i: int):
        ray = _ray()
        try:
            return ray.get(ref, timeout=self.timeout)
        except ray.exceptions.RayActorError as e:
            raise WorkerLost(f"(Ray actor {i}) died: {first_line(e)[:200]}") from None
        except ray.exceptions.GetTimeoutError:
            raise WorkerLost(f"(Ray actor {i}) sent nothing for {self.timeout:.0f} s (hung)") from None

    def _message(self, data: bytes) -> dict:
        return read(data, "cpu", f"a message from rollout worker {self.address}", FROM_WORKER)

    def _merged(self, key) -> dict:
        """The actors' parts of batch `key` as one "rollouts" message, in shard order."""
        parts, layout = self.parts.pop(key), self.layout.pop(key)
        mine = {i: iter(by_sizes(parts[i]["rollouts"], [size for j, size in layout if j == i])) for i in parts}
        trees = [tree for i, _ in layout for tree in next(mine[i])]  # each actor's shards come back in order
        seconds = [max(p["seconds"][k] for p in parts.values()) for k in (0, 1)]
        return {"kind": "rollouts", "key": list(key), "rollouts": trees, "scales": parts[min(parts)]["scales"],
                "seconds": seconds, "finished_at": max(p["finished_at"] for p in parts.values())}
