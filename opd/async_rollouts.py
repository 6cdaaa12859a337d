"""Asynchronous rollouts: a worker process samples the next batches while the trainer trains, with bounded staleness.

**The worker boundary is message passing.** A rollout worker is an address with an inbox and an outbox; every
message is a tuple of plain values, and tensors travel as `torch.save` bytes, never as shared memory. The same
worker could be hosted as an actor on a cluster engine by swapping `RolloutWorker`'s transport. Messages:

    trainer -> worker   ("weights", version, state_dict bytes)       publish new weights
                        ("generate", key, prompts, seed)             sample one batch, key = (index, attempt)
                        ("stop",)
    worker -> trainer   ("ready", address, pid)
                        ("rollouts", key, result bytes, (generate_s, recompute_s), finished_at)
                        ("error", address, message)

**Staleness is bounded at dispatch.** The trainer keeps at most `lookahead + 1` batches outstanding (dispatched and
not yet trained on; `lookahead` = `prefetch`, by default `max_staleness`). The worker handles its inbox in order, so
the batch trained at step s was sampled by policy version s - lookahead: its version gap is exactly `lookahead` in
steady state (less while the pipeline fills, or after skipped steps), whatever the timing. Runs are therefore
reproducible, and with `max_staleness` 0 the schedule is the synchronous one, computed in another process.
The window is also the back-pressure: the inbox never holds more than `lookahead + 1` requests (and one weights
message per step trained meanwhile), the outbox never more finished batches than that.
A batch whose gap still exceeds `max_staleness` (`prefetch` set above it) is re-sampled with
the same prompts and the newest weights (`stale_policy: requeue`) or discarded (`drop`); both are counted.
Weights change only between batches, so every token of a rollout has the rollout's version (no token weighting).

Without staleness (lookahead 0) the worker sends the engine's hidden states back with the tokens, and the trainer
computes the exact KL as in the sync schedule (its output layer is the sampling weights' then).

**The worker also recomputes `q`** when staleness is possible (lookahead > 0): the log-prob of each sampled token
under the weights that sampled it (the rollout copy's unquantized weights), computed as the learner computes (float32,
or bf16 autocast for a bf16 learner), and the exact per-token KL(p_rollout || p_q). The trainer no longer has those weights; with them the numerics mismatch (mu vs q) and the
staleness (q vs pi) are measured apart, as MISSION defines them. It is one more student forward per batch (the
"old log-prob" pass of async RL trainers); `recompute_fraction` < 1 does it on the batch's first rollouts only
(the prompts are i.i.d., so those metrics become estimates from a subsample), 0 not at all.

**Faults.** Every wait has a timeout. A worker that exits is noticed within `POLL` seconds; one that sends nothing
for `worker_timeout` seconds while it has work is killed as hung. Either is restarted (with the newest weights and
every outstanding request) up to `max_worker_restarts` times, then the run stops with a clear error. An exception
inside the worker is reported as one line and stops the run (it would recur). The worker ignores Ctrl-C, so the
trainer can shut it down cleanly and save; a watchdog thread in it exits the process within 0.2 s of the trainer
process disappearing (even while it is blocked on a pipe).
"""
import functools
import io
import math
import multiprocessing
import os
import queue
import signal
import threading
import time
import traceback
from collections import deque
from dataclasses import asdict, dataclass, replace

import torch

from opd.devices import autocast_dtype
from opd.engine import Engine, Rollout
from opd.errors import OpdError
from opd.learner import collate, score_batch
from opd.model import ModelConfig, Transformer, empty_model
from opd.plan import Plan
from opd.sampling import SamplingParams

POLL = 0.2  # seconds between liveness checks while waiting
STOP_GRACE = 5.0  # seconds a worker gets to exit after "stop" before it is terminated
COMPILE_GRACE = 600.0  # extra seconds a starting worker gets when its engine compiles (engine.py: about a minute)


def pack(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def unpack(data: bytes, device: str | torch.device = "cpu"):
    return torch.load(io.BytesIO(data), weights_only=False, map_location=device)


def sampler_seed(seed: int, index: int, attempt: int = 0) -> int:
    """The sampling seed of prompt batch `index` (attempt > 0: a re-sample): both schedules draw batch i alike."""
    return (seed * 1_000_003 + index) * 64 + attempt


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
    vllm_model_dir: str = ""  # set: the worker samples with vLLM (in-process) from this checkpoint folder
    compile: bool = False  # the built-in engine's torch.compile (engine.py)
    device: str = "cpu"  # where the worker's model, engine and recompute run
    chunk_tokens: int = 0  # the recompute's chunk of full-vocabulary work (chunked.py)
    dtype: str = "float32"  # the learner's compute dtype: q is recomputed as the learner computes


def recompute(model: Transformer, rollouts: list[Rollout], pad_id: int, params: SamplingParams, chunk_tokens: int,
              rollout=None, dtype: str = "float32") -> None:
    """Attach q and the exact per-token KL(p_rollout || p_q) to each rollout, from the sampling weights computed as
    the learner computes (`model`: the engine's base model, at full precision, under autocast for a bf16 learner;
    rollout: the engine's hidden rows -> log-probs)."""
    if not rollouts:
        return
    batch = collate(rollouts, pad_id)
    scores = score_batch(model, batch, temperature=params.temperature, chunk_tokens=chunk_tokens, rollout=rollout,
                         autocast=autocast_dtype(dtype))
    for b, r in enumerate(rollouts):
        n = len(r.completion_ids)
        r.q = scores.pi[b, :n].tolist()
        r.kl_exact = scores.kl_exact[b, :n].tolist() if scores.kl_exact is not None else None
        r.hidden = None  # the trainer needs only the per-token numbers


def _exit_with(parent: int) -> None:
    """The worker's watchdog thread: once the trainer is gone (killed with SIGKILL, say), exit at once. Not from the
    main loop: it may be stuck for good in a read of a message the dying trainer only half wrote, or in a write to
    an outbox nobody reads, and a normal exit would also wait for the queues' feeder threads."""
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(0)


def worker_main(address: str, inbox, outbox, init: bytes) -> None:
    """The rollout worker process: build the engine, then serve the inbox until "stop" or the trainer is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer owns Ctrl-C and stops us cleanly
    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    # No named semaphores here: a worker may be killed (the guard's fallback, a hang), and a semaphore it registered
    # would end the trainer with the resource tracker's "leaked semaphore" warning. torch.compile's FX interpreter
    # opens a (disabled) tqdm bar, whose interprocess lock is one; the thread lock is enough in this process.
    from tqdm.std import TqdmDefaultWriteLock
    TqdmDefaultWriteLock.mp_lock = None
    try:
        spec, weights, version, scales = unpack(init)
        torch.set_num_threads(spec.threads)
        model = empty_model(ModelConfig(**spec.model_config))
        model.load_state_dict(unpack(weights, spec.device), assign=True)
        if model.cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.requires_grad_(False)
        if spec.vllm_model_dir:  # in this process (env set at spawn); the published weights are loaded into it
            from opd.vllm_engine import VllmEngine
            engine = VllmEngine(spec.vllm_model_dir, spec.stop_ids, spec.pad_id, spec.plan, version,
                                max_model_len=model.cfg.max_position_embeddings, tied=model.cfg.tie_word_embeddings,
                                in_process=True)
            engine.update_weights(model.state_dict(), version)
        else:
            engine = Engine(model, spec.stop_ids, spec.pad_id, spec.plan, version, spec.noise_seed, spec.compile)
        engine.scales.update(scales)
        outbox.put(("ready", address, os.getpid()))
        while True:
            message = inbox.get()
            if message[0] == "stop":
                return
            if message[0] == "weights":
                _, version, blob = message
                state = unpack(blob, spec.device)
                engine.update_weights(state, version)
                if spec.vllm_model_dir:  # the built-in engine's base *is* `model`; vLLM keeps its own copy
                    model.load_state_dict(state)
            elif message[0] == "generate":
                _, key, prompts, seed = message
                start = time.perf_counter()
                rollouts = engine.generate(prompts, spec.params, seed, return_hidden=spec.return_hidden)
                generated = time.perf_counter()
                if spec.recompute:
                    n = math.ceil(spec.recompute_fraction * len(rollouts))
                    exact = functools.partial(engine.logprobs, params=spec.params) if spec.return_hidden else None
                    recompute(model, rollouts[:n], spec.pad_id, spec.params, spec.chunk_tokens, exact, spec.dtype)
                    for r in rollouts[n:]:
                        r.hidden = None  # stale: the trainer could not use them
                result = pack({"rollouts": rollouts, "scales": engine.scales})
                seconds = (generated - start, time.perf_counter() - generated)
                outbox.put(("rollouts", key, result, seconds, time.time()))
    except Exception as e:  # report one readable line; the trainer decides what to do
        where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
        text = str(e) if isinstance(e, OpdError) else \
            f"{type(e).__name__}: {e}" + (f" (at {os.path.basename(where.filename)}:{where.lineno})" if where else "")
        outbox.put(("error", address, text))


class WorkerLost(Exception):
    """The worker process exited or stopped answering."""


class RolloutWorker:
    """The trainer's handle on one rollout worker: start, send, receive (with timeouts), stop."""

    def __init__(self, address: str, spec: WorkerSpec, timeout: float):
        self.address, self.spec, self.timeout = address, spec, timeout
        self.process = None

    def start(self, weights: bytes, version: int, scales: dict) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        init = pack((self.spec, weights, version, scales))
        self.process = ctx.Process(target=worker_main, args=(self.address, self.inbox, self.outbox, init),
                                   name=self.address, daemon=True)
        # vLLM runs inside the worker (a daemon process may not start its own engine processes); its OpenMP pool
        # must be sized before torch is imported there, and a spawned child reads the environment at start
        extra = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(self.spec.threads)} \
            if self.spec.vllm_model_dir else {}
        saved = {k: os.environ.get(k) for k in extra}
        os.environ.update(extra)
        try:
            self.process.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        message = self.receive(self.timeout + (COMPILE_GRACE if self.spec.compile else 0))  # the engine compiles
        if message[0] == "error":
            raise OpdError(f"rollout worker {self.address} failed to start: {message[2]}")

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def send(self, message: tuple) -> None:
        self.inbox.put(message)

    def receive(self, timeout: float | None = None, block: bool = True) -> tuple | None:
        """The next message; None if not block and nothing is there. Raises WorkerLost if the process exits
        or sends nothing for `timeout` seconds."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            try:
                return self.outbox.get(timeout=POLL) if block else self.outbox.get_nowait()
            except queue.Empty:
                if not self.process.is_alive():
                    raise WorkerLost(f"exited with code {self.process.exitcode}") from None
                if not block:
                    return None
                if time.monotonic() > deadline:
                    raise WorkerLost(f"sent nothing for {limit:.0f} s (hung)") from None

    def stop(self, grace: float = STOP_GRACE) -> None:
        """Ask the worker to exit; kill it if it has not within `grace` seconds (0: a hung worker, kill now)."""
        if self.process is None:
            return
        if self.process.is_alive() and grace > 0:
            try:
                self.inbox.put_nowait(("stop",))
            except (ValueError, OSError, queue.Full):
                pass
            self.process.join(grace)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(STOP_GRACE)
        for q in (self.inbox, self.outbox):
            q.cancel_join_thread()  # never block the trainer's exit on a pipe nobody reads
            q.close()
        self.process = None


@dataclass
class Result:
    rollouts: list[Rollout]
    seconds: tuple[float, float]  # the worker's time on this batch: sampling, then recomputing q and packing
    finished_at: float  # wall clock when the worker finished it


class AsyncRollouts:
    """The trainer side of the async schedule: dispatch within the staleness window, collect, check, restart."""

    def __init__(self, cfg, spec: WorkerSpec, prompts):
        self.cfg, self.spec, self.prompts = cfg, spec, prompts
        self.lookahead = cfg.lookahead
        self.worker = RolloutWorker("rollout-0", spec, cfg.worker_timeout)
        self.order: deque[tuple[int, int]] = deque()  # outstanding keys in dispatch order
        self.ready: dict[tuple[int, int], Result] = {}
        self.next_index = 0
        self.counts = {"dropped": 0, "requeued": 0, "worker_restarts": 0}
        self.weights, self.version, self.scales = b"", 0, {}  # the newest published weights, packed

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def start(self, weights: dict, version: int, scales: dict, saved: dict | None = None) -> None:
        self.weights, self.version, self.scales = pack(weights), version, dict(scales)
        if saved:
            self.next_index, self.counts = saved["next_index"], saved["counts"]
            self.order = deque(tuple(k) for k in saved["order"])
            self.ready = {tuple(k): Result(unpack(blob), (0.0, 0.0), time.time()) for k, blob in saved["ready"]}
        try:
            self.worker.start(self.weights, self.version, self.scales)
        except WorkerLost as e:
            raise OpdError(f"rollout worker {self.worker.address} {e} while starting",
                           "check memory, the plan and the checkpoint; see the message above") from None
        for key in self.order:
            if key not in self.ready:  # in flight when the run stopped: sample again with the current weights
                self._send_generate(key)

    def close(self) -> None:
        self.worker.stop()

    def set_plan(self, plan: Plan) -> None:
        """Sample under another precision plan from now on (the runtime guard's fallback): the worker is restarted
        with it, and every outstanding batch, finished or not, is sampled again under it."""
        started = self.worker.process is not None
        self.worker.stop(grace=0)
        self.spec = replace(self.spec, plan=plan)
        self.worker = RolloutWorker(self.worker.address, self.spec, self.cfg.worker_timeout)
        self.ready.clear()
        self.scales = {}
        if started:
            self._call(lambda: self.worker.start(self.weights, self.version, self.scales))
            for key in self.order:
                self._call(lambda: self._send_generate(key))

    def state_dict(self, wait: bool) -> dict:
        """What a checkpoint needs to continue exactly: counters and finished batches. wait: first collect every
        outstanding batch (a periodic save; exact resume), else keep what has arrived (Ctrl-C; the rest is
        re-sampled)."""
        if wait:
            while any(key not in self.ready for key in self.order):
                self._collect(block=True)
        else:  # saving after a failure too: take what has arrived, restart nothing
            try:
                while self.worker.process is not None and (message := self.worker.receive(block=False)):
                    self._handle(message)
            except (WorkerLost, OpdError):
                pass
        return {"next_index": self.next_index, "counts": dict(self.counts), "order": list(self.order),
                "ready": [(key, pack(self.ready[key].rollouts)) for key in self.order if key in self.ready]}

    # -- the two calls of a training step -------------------------------------------------------------------------
    def publish(self, state_dict: dict, version: int) -> None:
        self.weights, self.version = pack(state_dict), version
        self._call(lambda: self.worker.send(("weights", version, self.weights)))

    def next_batch(self, current_version: int) -> tuple[list[Rollout], dict]:
        """The oldest outstanding batch whose staleness is within bounds, and the step's async metrics."""
        start = time.perf_counter()
        while True:
            while len(self.order) < self.lookahead + 1:
                self._dispatch((self.next_index, 0))
                self.next_index += 1
            key = self.order[0]
            self._drain()
            depth = len(self.ready)
            while key not in self.ready:
                self._collect(block=True)
            result = self.ready.pop(self.order.popleft())
            gap = current_version - result.rollouts[0].policy_version
            if gap <= self.cfg.max_staleness:
                break
            if self.cfg.stale_policy == "requeue":
                self.counts["requeued"] += 1
                self._dispatch((key[0], key[1] + 1))
            else:
                self.counts["dropped"] += 1
        metrics = {"async/queue_depth": depth, "time/rollout_wait": time.perf_counter() - start,
                   "time/rollout_in_queue": max(0.0, time.time() - result.finished_at),
                   "time/generate": result.seconds[0], "time/recompute": result.seconds[1],
                   **{f"async/{k}": v for k, v in self.counts.items()}}
        return result.rollouts, metrics

    # -- internals -------------------------------------------------------------------------------------------------
    def _dispatch(self, key: tuple[int, int]) -> None:
        self.order.append(key)
        self._call(lambda: self._send_generate(key))

    def _send_generate(self, key: tuple[int, int]) -> None:
        index, attempt = key
        self.worker.send(("generate", key, self.prompts.batch(index), sampler_seed(self.cfg.seed, index, attempt)))

    def _drain(self) -> None:
        while self._collect(block=False):
            pass

    def _collect(self, block: bool) -> bool:
        """Receive one message (or none, if not block and nothing waits); returns whether one came."""
        message = self._call(lambda: self.worker.receive(block=block))
        if message is None:
            return False
        self._handle(message)
        return True

    def _handle(self, message: tuple) -> None:
        if message[0] == "error":
            raise OpdError(f"rollout worker {message[1]} failed: {message[2]}",
                           "fix the cause above; the run can be resumed with --resume")
        if message[0] == "rollouts":
            _, key, blob, seconds, finished_at = message
            data = unpack(blob)
            self.scales = data["scales"]
            if tuple(key) in self.order:
                self.ready[tuple(key)] = Result(data["rollouts"], seconds, finished_at)

    def _call(self, fn):
        """Run fn; if the worker is lost, restart it (re-sending weights and outstanding work) and report None."""
        try:
            return fn()
        except WorkerLost as e:
            self._restart(str(e))
            return None

    def _restart(self, reason: str) -> None:
        self.worker.stop(grace=0)
        if self.counts["worker_restarts"] >= self.cfg.max_worker_restarts:
            raise OpdError(f"rollout worker {self.worker.address} {reason}; it was restarted "
                           f"{self.counts['worker_restarts']} times already",
                           "check memory and the worker's threads; raise max_worker_restarts or worker_timeout; "
                           "the run can be resumed with --resume")
        self.counts["worker_restarts"] += 1
        try:
            self.worker.start(self.weights, self.version, self.scales)
        except WorkerLost as e:
            return self._restart(f"{e} while restarting")
        for key in self.order:
            if key not in self.ready:
                self._send_generate(key)


def worker_spec(cfg, model: Transformer, tok, plan: Plan, params: SamplingParams, return_hidden: bool,
                model_dir: str = "") -> WorkerSpec:
    return WorkerSpec(asdict(model.cfg), tok.stop_ids, tok.pad_id, plan, cfg.noise_seed, params, cfg.worker_threads,
                      return_hidden, recompute=cfg.lookahead > 0, recompute_fraction=cfg.recompute_fraction,
                      vllm_model_dir=str(model_dir) if cfg.engine == "vllm" else "", compile=cfg.engine_compile,
                      device=str(model.embed_tokens.weight.device), chunk_tokens=cfg.chunk_tokens, dtype=cfg.dtype)
