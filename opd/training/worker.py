"""The rollout worker: a process of our own that samples batches on request (its pipe: channel.py).

**The worker boundary is message passing, bytes only.** A rollout worker is an address with one `Channel` to it;
every message is one `wire.encode`d tree of plain values and tensors (wire.py: safetensors + a JSON header): tensors
travel as wire-encoded bytes, never pickle, and no shared memory. Receiving therefore runs no code whatever arrives
(a malformed message is refused with one line), which matters once workers live on other machines. The channel is a
`multiprocessing.Pipe` used with `send_bytes` / `recv_bytes` only (`send` / `recv` would pickle). Each end has a
feeder thread with an unbounded local queue (as `multiprocessing.Queue` has): a pipe write blocks while the pipe is
full, and with weights going one way and rollouts the other, two blocked writers would wait for each other forever.
Each end also has a reader thread, so that no wait on a message, even one half written by a worker that then hung,
outlasts its timeout. Starting the worker is `multiprocessing`'s spawn of our own child on this machine: its only
argument is the pipe's handle; its settings and first weights are the first two messages. The same worker could
be hosted as an actor on a cluster engine by swapping the channel. Messages, each a dict with its `kind`:

    trainer -> worker   weights   version, state (state_dict)                     publish new weights
                        generate  key = (index, attempt), prompts, shards         sample one batch (shards:
                                  [size, seed] per sub-batch, rollouts.shards)
                        stop
    worker -> trainer   ready     address, pid
                        rollouts  key, rollouts (rollout_tree), scales, seconds = (generate_s, recompute_s), finished_at
                        error     address, message

The worker handles its inbox in order, so weights change only between batches: every token of a rollout has the
rollout's version. Without staleness the worker sends the engine's hidden states back with the tokens (the trainer
computes the exact KL from them, its output layer being the sampling weights' then).

**The worker also recomputes `q`** when staleness is possible (`WorkerSpec.recompute`): the log-prob of each sampled
token under the weights that sampled it (the rollout copy's unquantized weights), computed as the learner computes
(float32, or bf16 autocast for a bf16 learner), and the exact per-token KL(p_rollout || p_q). The trainer no longer
has those weights; with them the numerics mismatch (mu vs q) and the staleness (q vs pi) are measured apart, as
MISSION defines them. It is one more student forward per batch (the "old log-prob" pass of async RL trainers);
`recompute_fraction` < 1 does it on the batch's first rollouts only (the prompts are i.i.d., so those metrics become
estimates from a subsample), 0 not at all.

**Faults seen from here.** Every wait has a timeout. A worker that exits is noticed within `POLL` seconds; one that
sends nothing for its timeout while it has work counts as hung (`WorkerLost`; what to do about it is the schedule's
business: async_rollouts.py). An exception inside the worker is reported as one "error" message. The worker ignores
Ctrl-C, so the trainer can shut it down cleanly and save; a watchdog thread in it exits the process within 0.2 s of
the trainer process disappearing (even while it is blocked on a pipe).
"""
import functools
import math
import multiprocessing
import os
import queue
import signal
import threading
import time
import traceback
from dataclasses import asdict, dataclass, fields

import torch

from opd.io import wire
from opd.io.channel import Channel, read
from opd.models.devices import autocast_dtype
from opd.engines.kinds import kind, make_engine, worker_env
from opd.io.errors import OpdError, require
from opd.numerics.kernels import Kernels
from opd.numerics.kv_cache import KVSpec
from opd.training.learner import Scoring, collate, score_batch
from opd.models.model import ModelConfig, Transformer, empty_model
from opd.numerics.plan import LayerPrecision, Plan
from opd.training.rollouts import by_sizes, generate_shards
from opd.engines.sampling import Rollout
from opd.engines.sampling import SamplingParams

POLL = 0.2  # seconds between liveness checks while waiting
STOP_GRACE = 5.0  # seconds a worker gets to exit after "stop" before it is terminated
COMPILE_GRACE = 600.0  # extra seconds a starting worker gets when its engine compiles (engine.py: about a minute)
START_GRACE = 60.0  # extra seconds a starting worker gets: a spawned process imports torch and opd first, which a
# loaded machine can stretch past a short async.worker_timeout (that timeout is for a busy worker's silence)
TO_WORKER, FROM_WORKER = ("weights", "generate", "stop"), ("ready", "rollouts", "error")


@dataclass
class WorkerSpec:
    """What a rollout worker needs besides weights: plain values only."""
    model_config: dict
    stop_ids: list[int]
    pad_id: int
    plan: Plan
    noise_seed: int
    params: SamplingParams
    threads: int
    return_hidden: bool  # the engine's hidden states (for the exact KL)
    recompute: bool  # staleness is possible: compute q (and the exact KL) under the sampling weights
    recompute_fraction: float  # of each batch, the share (first rollouts) to recompute
    engine: str = "builtin"  # the rollout engine's kind (engines.KINDS)
    model_dir: str = ""  # the checkpoint folder an engine with its own copy loads (engines.Kind.own_copy)
    compile: bool = False  # the built-in engine's torch.compile (engine.py)
    device: str = "cpu"  # where the worker's model, engine and recompute run
    chunk_tokens: int = 0  # the recompute's chunk of full-vocabulary work (chunked.py)
    dtype: str = "float32"  # the learner's compute dtype: q is recomputed as the learner computes
    micro_batch_size: int = 0  # and in its micro-batches (rollouts per forward; 0: the whole batch)
    context: int = 0  # an own-copy engine's size: the longest prompt + max_new_tokens (engines.make_engine)
    max_seqs: int = 1  # and the most sequences one generate call holds
    bf16_gemm: str = "float32"  # the built-in engine's bf16 matmuls on a CPU (engine.py)


# -- dataclasses <-> wire trees (plain values and tensors), rebuilt exactly --------------------------------------------
def _fields(obj) -> dict:
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def plan_tree(plan: Plan) -> dict:
    """Every field, not `str(plan)`: the canonical string drops settings that do not apply (kv_group off int4)."""
    return {**asdict(plan), "kernels": str(plan.kernels)}


def plan_from_tree(tree: dict) -> Plan:
    layers = tuple(LayerPrecision(**{**layer, "kv": KVSpec(**layer["kv"])}) for layer in tree["layers"])
    return Plan(layers, tree["forward"], Kernels.parse(tree.get("kernels", "fused")))


def spec_tree(spec: WorkerSpec) -> dict:
    return {**_fields(spec), "plan": plan_tree(spec.plan), "params": _fields(spec.params)}


def spec_from_tree(tree: dict) -> WorkerSpec:
    return WorkerSpec(**{**tree, "plan": plan_from_tree(tree["plan"]), "params": SamplingParams(**tree["params"])})


# A rollout's per-token lists travel as tensors: float64 and int64 hold every Python float and token id exactly, and
# as JSON numbers a large batch would encode slowly and could outgrow the header (safetensors caps it at 100 MB).
AS_TENSORS = {"prompt_ids": torch.int64, "completion_ids": torch.int64, "logprobs": torch.float64,
              "raw_logprobs": torch.float64, "q": torch.float64, "kl_exact": torch.float64}


def rollout_tree(r: Rollout) -> dict:
    return {k: torch.tensor(v, dtype=AS_TENSORS[k]) if k in AS_TENSORS and v is not None else v
            for k, v in _fields(r).items()}


def rollout_from_tree(tree: dict, what: str = "a rollout") -> Rollout:
    """The Rollout a tree carries, checked (it comes from another process, or from a checkpoint someone handed over):
    its fields, their dtypes and types, and one entry per completion token in every per-token list."""
    fix = "it was not written by this version of opd, or it is damaged"
    names = {f.name for f in fields(Rollout)}
    require(isinstance(tree, dict) and set(tree) == names, f"{what} does not have the fields of a rollout", fix)
    for k, dtype in AS_TENSORS.items():
        v = tree[k]
        require((v is None and k in ("q", "kl_exact")) or (isinstance(v, torch.Tensor) and v.dtype == dtype and
                v.dim() == 1), f"{what}: {k} is not a 1-D {dtype} tensor", fix)
    hidden = tree["hidden"]
    require(hidden is None or (isinstance(hidden, torch.Tensor) and hidden.dim() == 2 and hidden.is_floating_point()),
            f"{what}: hidden is not a 2-D float tensor", fix)
    require(tree["finish_reason"] in ("stop", "length") and isinstance(tree["policy_version"], int) and
            not isinstance(tree["policy_version"], bool) and tree["policy_version"] >= 0,
            f"{what}: bad finish_reason or policy_version", fix)
    n = len(tree["completion_ids"])
    require(all(len(tree[k]) == n for k in ("logprobs", "raw_logprobs", "q", "kl_exact") if tree[k] is not None)
            and (hidden is None or len(hidden) == n), f"{what}: its per-token lists differ in length", fix)
    return Rollout(**{k: v.tolist() if k in AS_TENSORS and v is not None else v for k, v in tree.items()})


# -- the worker process ------------------------------------------------------------------------------------------------
@torch.no_grad()
def recompute(model: Transformer, rollouts: list[Rollout], pad_id: int, params: SamplingParams, chunk_tokens: int,
              rollout=None, dtype: str = "float32", micro_batch_size: int = 0) -> None:
    """Attach q and the exact per-token KL(p_rollout || p_q) to each rollout, from the sampling weights computed as
    the learner computes (`model`: the engine's base model, at full precision, under autocast for a bf16 learner;
    rollout: the engine's hidden rows -> log-probs; micro_batch_size: rollouts per forward, the learner's)."""
    if not rollouts:
        return
    batch = collate(rollouts, pad_id)
    scores = score_batch(model, batch, how=Scoring(temperature=params.temperature, chunk_tokens=chunk_tokens,
                                                   micro_batch_size=micro_batch_size,
                                                   autocast=autocast_dtype(dtype)), rollout=rollout)
    for b, r in enumerate(rollouts):
        n = len(r.completion_ids)
        r.q = scores.pi[b, :n].tolist()
        r.kl_exact = scores.kl_exact[b, :n].tolist() if scores.kl_exact is not None else None
        r.hidden = None  # the trainer needs only the per-token numbers


def _exit_with(parent: int) -> None:
    """The worker's watchdog thread: once the trainer is gone (killed with SIGKILL, say), exit at once. Not from the
    main loop: it may be busy for minutes in a batch, and a normal exit could wait on a feeder thread blocked in a
    write to a pipe nobody reads."""
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(0)


class WorkerCore:
    """A rollout worker's model, engine and message handling, whatever hosts it: worker_main's process here, or a Ray
    actor (ray_backend.py). Built from the wire-encoded {"spec", "scales"} and the latest "weights" message."""

    def __init__(self, init: bytes, weights: bytes):
        spec = spec_from_tree(wire.decode(init, what="the rollout worker's settings")["spec"])
        scales = wire.decode(init, spec.device, "the rollout worker's settings")["scales"]  # again: onto spec.device
        first = read(weights, spec.device, "the rollout worker's weights", ("weights",))
        torch.set_num_threads(spec.threads)
        model = empty_model(ModelConfig(**spec.model_config))
        model.load_state_dict(first["state"], assign=True)
        if model.cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.requires_grad_(False)
        # an engine with its own copy (vLLM: in this process, its environment set at spawn) is sent the published
        # weights; the built-in engine's base is `model`
        engine = make_engine(spec.engine, model, spec.stop_ids, spec.pad_id, spec.plan, model_dir=spec.model_dir,
                             version=first["version"], noise_seed=spec.noise_seed, compile=spec.compile,
                             in_process=True, context=spec.context, max_seqs=spec.max_seqs, bf16_gemm=spec.bf16_gemm)
        if kind(spec.engine).own_copy:
            engine.update_weights(model.state_dict(), first["version"])
        engine.scales.update(scales)
        self.spec, self.model, self.engine = spec, model, engine

    def read(self, data: bytes) -> dict:
        return read(data, self.spec.device, "a message from the trainer", TO_WORKER)

    def handle(self, message: dict) -> bytes | None:
        """A "weights" or "generate" message -> None, or the "rollouts" message to send back."""
        if message["kind"] == "weights":
            self.engine.update_weights(message["state"], message["version"])
            if kind(self.spec.engine).own_copy:  # the built-in engine's base *is* `model`; others keep their own
                self.model.load_state_dict(message["state"])
            return None
        return rollouts_message(self.engine, self.model, self.spec, message)


def error_message(address: str, e: Exception) -> bytes:
    """An exception inside a worker -> one readable "error" message (the trainer decides what to do)."""
    where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    text = str(e) if isinstance(e, OpdError) else \
        f"{type(e).__name__}: {e}" + (f" (at {os.path.basename(where.filename)}:{where.lineno})" if where else "")
    return wire.encode({"kind": "error", "address": address, "message": text})


def worker_main(address: str, conn) -> None:
    """The rollout worker process: read its start-up data from the channel (the wire-encoded {"spec", "scales"},
    then the latest "weights" message), build the engine, then serve the channel until "stop" or the trainer is
    gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer owns Ctrl-C and stops us cleanly
    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    # No named semaphores here: a worker may be killed (the guard's fallback, a hang), and a semaphore it registered
    # would end the trainer with the resource tracker's "leaked semaphore" warning. torch.compile's FX interpreter
    # opens a (disabled) tqdm bar, whose interprocess lock is one; the thread lock is enough in this process.
    from tqdm.std import TqdmDefaultWriteLock
    TqdmDefaultWriteLock.mp_lock = None
    channel = Channel(conn)
    try:
        init, weights = channel.receive(), channel.receive()
        if init is None or weights is None:
            return  # the trainer is gone
        core = WorkerCore(init, weights)
        channel.send(wire.encode({"kind": "ready", "address": address, "pid": os.getpid()}))
        while (data := channel.receive()) is not None:  # None: the trainer is gone
            message = core.read(data)
            if message["kind"] == "stop":
                return
            if (reply := core.handle(message)) is not None:
                channel.send(reply)
    except Exception as e:  # report one readable line; the trainer decides what to do
        channel.send(error_message(address, e))
        channel.close(flush=STOP_GRACE)


def rollouts_message(engine, model: Transformer, spec: WorkerSpec, message: dict) -> bytes:
    """One "generate" request (its prompts, sampled as the sub-batches `shards` lists: [size, seed] each) -> its
    "rollouts" message."""
    start = time.perf_counter()
    sizes, seeds = zip(*message["shards"])
    parts = list(zip(by_sizes(message["prompts"], list(sizes)), seeds))
    rollouts = generate_shards(engine, parts, spec.params, spec.return_hidden)
    generated = time.perf_counter()
    if spec.recompute:
        n = math.ceil(spec.recompute_fraction * len(rollouts))
        exact = functools.partial(engine.logprobs, params=spec.params) if spec.return_hidden else None
        recompute(model, rollouts[:n], spec.pad_id, spec.params, spec.chunk_tokens, exact, spec.dtype,
                  spec.micro_batch_size)
        for r in rollouts[n:]:
            r.hidden = None  # stale: the trainer could not use them
    trees = [rollout_tree(r) for r in rollouts]
    return wire.encode({"kind": "rollouts", "key": message["key"], "rollouts": trees, "scales": engine.scales,
                        "seconds": (generated - start, time.perf_counter() - generated), "finished_at": time.time()})


# -- the trainer side --------------------------------------------------------------------------------------------------
class WorkerLost(Exception):
    """The worker process exited or stopped answering."""


class RolloutWorker:
    """The trainer's handle on one rollout worker: start, send, receive (with timeouts), stop."""

    def __init__(self, address: str, spec: WorkerSpec, timeout: float):
        self.address, self.spec, self.timeout = address, spec, timeout
        self.process = None

    def start(self, weights: bytes, scales: dict) -> None:
        """weights: the latest "weights" message (it carries the version)."""
        ctx = multiprocessing.get_context("spawn")
        conn, child = ctx.Pipe()
        self.channel = Channel(conn)
        # The start-up data goes through the channel, not through spawn's arguments: spawn writes those into a pipe
        # whose read end this process also holds, so a child that exits before reading them (a script without the
        # `__main__` guard, which the child imports) would block that write forever.
        self.process = ctx.Process(target=worker_main, args=(self.address, child), name=self.address, daemon=True)
        # what the engine needs in the worker's environment (engines.Kind.worker_env), read by a spawned child at start
        extra = worker_env(self.spec.engine, self.spec.threads)
        saved = {k: os.environ.get(k) for k in extra}
        os.environ.update(extra)
        try:
            self.process.start()
        finally:
            child.close()  # the worker has its own copy now; ours would keep the pipe open after the worker is gone
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.channel.send(wire.encode({"spec": spec_tree(self.spec), "scales": scales}))
        self.channel.send(weights)
        message = self.receive(self.timeout + START_GRACE + (COMPILE_GRACE if self.spec.compile else 0))
        if message["kind"] == "error":
            raise OpdError(f"rollout worker {self.address} failed to start: {message['message']}")

    @property
    def started(self) -> bool:
        """The process was started (until `stop`): the schedule asks every worker handle this."""
        return self.process is not None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def send(self, message: dict | bytes) -> None:
        self.channel.send(message if isinstance(message, bytes) else wire.encode(message))

    def receive(self, timeout: float | None = None, block: bool = True) -> dict | None:
        """The next message; None if not block and nothing is there. Raises WorkerLost if the process exits
        or sends nothing for `timeout` seconds, OpdError if what it sends is not a message."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            try:
                data = self.channel.receive(POLL if block else 0)
                if data is not None:
                    return read(data, "cpu", f"a message from rollout worker {self.address}", FROM_WORKER)
                self.process.join(POLL)  # its end is closed: it is exiting (this gives its exit code)
            except queue.Empty:
                pass
            if not self.process.is_alive():
                raise WorkerLost(f"exited with code {self.process.exitcode}")
            if not block:
                return None
            if time.monotonic() > deadline:
                raise WorkerLost(f"sent nothing for {limit:.0f} s (hung)")

    def stop(self, grace: float = STOP_GRACE) -> None:
        """Ask the worker to exit; kill it if it has not within `grace` seconds (0: a hung worker, kill now)."""
        if self.process is None:
            return
        if self.process.is_alive() and grace > 0:
            self.send({"kind": "stop"})
            self.process.join(grace)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(STOP_GRACE)
        self.channel.close()  # never blocks the trainer's exit on a pipe nobody reads
        self.process = None



def weights_message(state_dict: dict, version: int) -> bytes:
    return wire.encode({"kind": "weights", "version": version, "state": state_dict})

