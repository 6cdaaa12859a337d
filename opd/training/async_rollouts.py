"""The async schedule: a rollout worker process (worker.py) samples the next batches while the trainer trains, with
bounded staleness; the same `Rollouts` interface as the in-process engine (rollouts.py).

**Staleness is bounded at dispatch.** The trainer keeps at most `lookahead + 1` batches outstanding (dispatched and
not yet trained on; `lookahead` = `prefetch`, by default `max_staleness`). The worker handles its inbox in order, so
the batch trained at step s was sampled by policy version s - lookahead: its version gap is exactly `lookahead` in
steady state (less while the pipeline fills, or after skipped steps), whatever the timing. Runs are therefore
reproducible, and with `max_staleness` 0 the schedule is the synchronous one, computed in another process.
The window is also the back-pressure: the inbox never holds more than `lookahead + 1` requests (and one weights
message per step trained meanwhile), the outbox never more finished batches than that.
A batch that `rollouts.too_stale` refuses (`prefetch` set above `max_staleness`) is re-sampled with the same prompts
and the newest weights (`async.stale_policy: requeue`) or discarded (`drop`); both are counted.

**Faults.** A worker that exits or hangs (worker.py notices both) is restarted with the newest weights and every
outstanding request, up to `async.max_worker_restarts` times; then the run stops with a clear error. An exception inside
the worker stops the run (it would recur), as does a message from it that is not a wire tree of a known kind.
"""
import math
import sys
import time
from collections import deque
from dataclasses import dataclass, replace

from opd.io.errors import OpdError, require
from opd.numerics.plan import Plan
from opd.training.rollouts import (StepRollouts, SyncRollouts, generate_shards, learner_logprobs, sampler_seed, shards,
                                   too_stale)
from opd.engines.sampling import Rollout
from opd.training.worker import RolloutWorker, WorkerLost, WorkerSpec, rollout_from_tree, rollout_tree, weights_message


@dataclass
class Result:
    rollouts: list[Rollout]
    seconds: tuple[float, float]  # the worker's time on this batch: sampling, then recomputing q and encoding
    finished_at: float  # wall clock when the worker finished it


class AsyncRollouts:
    """The trainer side of the async schedule: dispatch within the staleness window, collect, check, restart."""

    def __init__(self, spec: WorkerSpec, prompts, seed: int, max_staleness: int, lookahead: int, stale_policy: str,
                 worker_timeout: float, max_worker_restarts: int, lm_head=None, n_shards: int = 1,
                 new_worker=RolloutWorker, rank: int | None = None):
        """lookahead: batches sampled ahead of the one trained (`prefetch`, by default max_staleness); lm_head: the
        learner's output layer, for the exact KL of the rows the worker sends hidden states with (staleness 0, when
        the spec asks for hidden states), or None; n_shards: sub-batches per batch (rollouts.shards); new_worker:
        (address, spec, timeout) -> the worker handle (RolloutWorker: a process of our own; ray_backend.RayWorkers:
        Ray actors); rank: sample only sub-batch `rank` of each batch (a sharded learner's rank, sharded.py)."""
        self.new_worker, self.n_shards, self.rank = new_worker, n_shards, rank
        self.spec, self.prompts, self.seed = spec, prompts, seed
        self.max_staleness, self.lookahead, self.stale_policy = max_staleness, lookahead, stale_policy
        self.worker_timeout, self.max_worker_restarts = worker_timeout, max_worker_restarts
        self.lm_head = lm_head
        self.engine_logprobs = self._engine_logprobs()
        self.worker = new_worker("rollout-0", spec, worker_timeout)
        self.order: deque[tuple[int, int]] = deque()  # outstanding keys in dispatch order
        self.ready: dict[tuple[int, int], Result] = {}
        self.next_index = 0
        self.counts = {"dropped": 0, "requeued": 0, "worker_restarts": 0}
        self.weights, self.scales = b"", {}  # the newest "weights" message (encoded once, re-sent at restarts)

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def start(self, weights: dict, version: int, saved: dict) -> None:
        """saved: what `state_dict` returned, as `wire.decode` gives it back ({}: a fresh run)."""
        self.weights, self.scales = weights_message(weights, version), dict(saved.get("engine_scales", {}))
        if saved.get("async"):
            self.load_state_dict(saved["async"])
        try:
            self.worker.start(self.weights, self.scales)
        except WorkerLost as e:
            raise OpdError(f"rollout worker {self.worker.address} {e} while starting",
                           "check memory, the plan and the checkpoint; see the message above (from a script: its "
                           "code must be under `if __name__ == \"__main__\":`, since a worker process imports it)") \
                from None
        for key in self.order:
            if key not in self.ready:  # in flight when the run stopped: sample again with the current weights
                self._send_generate(key)

    def close(self) -> None:
        self.worker.stop()

    def set_plan(self, plan: Plan) -> None:
        """Sample under another precision plan from now on (the runtime guard's fallback): the worker is restarted
        with it, and every outstanding batch, finished or not, is sampled again under it."""
        started = self.worker.started
        self.worker.stop(grace=0)
        self.spec = replace(self.spec, plan=plan)
        self.engine_logprobs = self._engine_logprobs()  # the new plan's forward precision
        self.worker = self.new_worker(self.worker.address, self.spec, self.worker_timeout)
        self.ready.clear()
        self.scales = {}
        if started:
            self._call(self._start_and_resend)

    def state_dict(self, wait: bool) -> dict:
        """What a checkpoint needs to continue exactly, as a wire tree: counters and finished batches. wait: first
        collect every outstanding batch (a periodic save; exact resume), else keep what has arrived (Ctrl-C; the rest
        is re-sampled)."""
        if wait:
            while any(key not in self.ready for key in self.order):
                self._collect(block=True)
        else:  # saving after a failure too: take what has arrived, restart nothing
            try:
                while self.worker.started and (message := self.worker.receive(block=False)):
                    self._handle(message)
            except (WorkerLost, OpdError):
                pass
        return {"async": write_state(self.next_index, self.counts, self.order,
                                     {key: result.rollouts for key, result in self.ready.items()}),
                "engine_scales": dict(self.scales)}

    def load_state_dict(self, saved: dict) -> None:
        """What state_dict saved (a checkpoint: checked, since it may come from elsewhere)."""
        self.next_index, self.counts, self.order, ready = read_state(saved, self.counts)
        self.ready = {key: Result(rollouts, (0.0, 0.0), time.time()) for key, rollouts in ready.items()}

    # -- the two calls of a training step -------------------------------------------------------------------------
    def publish(self, weights: dict, version: int) -> None:
        self.weights = weights_message(weights, version)
        self._call(lambda: self.worker.send(self.weights))

    def next_batch(self, step: int, version: int) -> StepRollouts:
        """The oldest outstanding batch that is not `too_stale` for the learner at `version`, with the step's async
        metrics. (`step` is not used: the prompt batches are dispatched in order, `next_index`, and a skipped step
        trains on the next batch.)"""
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
            reason = too_stale(result.rollouts[0].policy_version, version, self.max_staleness)
            if reason is None:
                break
            if not self.counts["requeued"] + self.counts["dropped"]:  # the first time: why (then counted only)
                what = "re-sampled" if self.stale_policy == "requeue" else "dropped"
                print(f"opd: note: prompt batch {key[0]} was {what}: {reason}; further ones are counted in "
                      f"async/{'requeued' if self.stale_policy == 'requeue' else 'dropped'}", file=sys.stderr)
            if self.stale_policy == "requeue":
                self.counts["requeued"] += 1
                self._dispatch((key[0], key[1] + 1))
            else:
                self.counts["dropped"] += 1
        metrics = {"async/queue_depth": depth, "time/rollout_wait": time.perf_counter() - start,
                   "time/rollout_in_queue": max(0.0, time.time() - result.finished_at),
                   "time/generate": result.seconds[0], "time/recompute": result.seconds[1],
                   **{f"async/{k}": v for k, v in self.counts.items()}}
        return StepRollouts(result.rollouts, metrics, self.engine_logprobs, key)

    # -- internals -------------------------------------------------------------------------------------------------
    def _engine_logprobs(self):
        """Hidden rows -> the sampling engine's log-probs, from the learner's head under the plan's forward."""
        if self.lm_head is None or not self.spec.return_hidden:
            return None
        return learner_logprobs(self.lm_head, self.spec.params, self.spec.plan.forward)

    def _dispatch(self, key: tuple[int, int]) -> None:
        self.order.append(key)
        self._call(lambda: self._send_generate(key))

    def _send_generate(self, key: tuple[int, int]) -> None:
        index, attempt = key
        parts = shards(self.prompts.batch(index), sampler_seed(self.seed, index, attempt), self.n_shards)
        if self.rank is not None:
            parts = parts[self.rank:self.rank + 1]
        self.worker.send({"kind": "generate", "key": key, "prompts": [p for prompts, _ in parts for p in prompts],
                          "shards": [[len(prompts), seed] for prompts, seed in parts]})

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

    def _handle(self, message: dict) -> None:
        try:
            self._take(message)
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # a well-formed wire tree, not one of ours
            raise OpdError(f"rollout worker {self.worker.address} sent a malformed {message.get('kind')!r} message "
                           f"({type(e).__name__}: {e})", "it is not this version of opd's worker") from None

    def _take(self, message: dict) -> None:
        if message["kind"] == "error":
            raise OpdError(f"rollout worker {message['address']} failed: {message['message']}",
                           "fix the cause above; the run can be resumed with --resume")
        if message["kind"] == "rollouts":
            self.scales = message["scales"]
            key = tuple(message["key"])
            if key in self.order:
                rollouts = [rollout_from_tree(t) for t in message["rollouts"]]
                self.ready[key] = Result(rollouts, tuple(message["seconds"]), message["finished_at"])

    def _call(self, fn):
        """Run fn; if the worker is lost, restart it and report None. The restart re-sends the weights and every
        outstanding request, so a call that was sending one needs no retry, and a receive that got nothing is one."""
        try:
            return fn()
        except WorkerLost as e:
            self._restart(str(e))
            return None

    def _start_and_resend(self) -> None:
        """Start the worker with the newest weights and send it every outstanding request that has no result."""
        self.worker.start(self.weights, self.scales)
        for key in self.order:
            if key not in self.ready:
                self._send_generate(key)

    def _restart(self, reason: str) -> None:
        """Restart the lost worker, up to max_worker_restarts times in the run (a restart that is lost too counts)."""
        while True:
            self.worker.stop(grace=0)
            if self.counts["worker_restarts"] >= self.max_worker_restarts:
                raise OpdError(f"rollout worker {self.worker.address} {reason}; it was restarted "
                               f"{self.counts['worker_restarts']} times already",
                               "check memory and the worker's threads; raise async.max_worker_restarts or "
                               "async.worker_timeout; the run can be resumed with --resume")
            self.counts["worker_restarts"] += 1
            try:
                return self._start_and_resend()
            except WorkerLost as e:
                reason = f"{e} while restarting"


def write_state(next_index: int, counts: dict, order: deque, ready: dict) -> dict:
    """An async schedule's checkpoint state (a wire tree): its counters, the outstanding keys in order and the
    finished batches' rollouts (ready: key -> rollouts). read_state reads it back."""
    return {"next_index": next_index, "counts": dict(counts), "order": list(order),
            "ready": [(key, [rollout_tree(r) for r in ready[key]]) for key in order if key in ready]}


def read_state(saved: dict, counts: dict) -> tuple[int, dict, deque, dict]:
    """An async schedule's saved state (state_dict's "async" part, from a checkpoint: checked, since it may come from
    elsewhere) -> next_index, counts (the keys of `counts`), the outstanding keys in order, and the finished batches'
    rollouts by key. The worker and the inline schedule save it alike."""
    try:
        next_index, counts = saved["next_index"], {k: int(saved["counts"][k]) for k in counts}
        order = deque(tuple(int(i) for i in k) for k in saved["order"])
        ready = {tuple(int(i) for i in k): [rollout_from_tree(t) for t in trees] for k, trees in saved["ready"]}
        require(isinstance(next_index, int) and next_index >= 0 and set(ready) <= set(order), "", "")
    except (KeyError, TypeError, ValueError, AttributeError, OpdError):
        raise OpdError("the checkpoint's async rollout state is malformed",
                       "it was not written by this version of opd, or it is damaged: start again with --overwrite")\
            from None
    return next_index, counts, order, ready


class InlineRollouts(SyncRollouts):
    """The async schedule sampled in the trainer's process (`async.backend: inline`): the same batches, keys, seeds,
    staleness and q recompute as the worker process, one phase at a time. The worker samples batch i once the
    learner takes batch i - lookahead, with the weights published just before (version i - lookahead in steady
    state, whatever the timing: the module docstring); here batch i is sampled at that same moment, with the
    learner's own tensors, which are then those weights. So a run equals its worker-process twin, without the overlap
    (no speed-up) and without the worker's copy of the student (no memory beyond a synchronous run's): the way to
    measure what staleness does to a run whose worker would not fit beside it. It saves the worker schedule's
    checkpoint state (read_state)."""

    def __init__(self, build, plan: Plan, prompts, params, seed: int, exact_kl: bool, n_shards: int,
                 max_staleness: int, lookahead: int, recompute_fraction: float, rescore):
        """rescore(rollouts, rollout=...): the worker's `recompute` with the learner's model (q and the exact KL under the
        sampling weights, computed as the learner computes), for batches that may be stale (lookahead > 0)."""
        super().__init__(build, plan, prompts, params, seed, exact_kl, n_shards)
        require(lookahead <= max_staleness, f"async.backend inline samples at most max_staleness ({max_staleness}) "
                f"batches ahead, not {lookahead}", "set async.prefetch to -1 or at most async.max_staleness")
        self.max_staleness, self.lookahead = max_staleness, lookahead
        self.recompute_fraction, self.rescore = recompute_fraction, rescore
        self.order: deque[tuple[int, int]] = deque()
        self.ready: dict[tuple[int, int], list[Rollout]] = {}
        self.next_index = 0
        self.counts = {"dropped": 0, "requeued": 0, "worker_restarts": 0}  # the worker schedule's, none ever here

    def start(self, weights: dict, version: int, saved: dict) -> None:
        super().start(weights, version, saved)
        if saved.get("async"):
            self.next_index, self.counts, self.order, self.ready = read_state(saved["async"], self.counts)

    def next_batch(self, step: int, version: int) -> StepRollouts:
        """The oldest outstanding batch, after sampling every outstanding one not yet sampled with the weights of now
        (`step` is not used: the batches are taken in order, as the worker schedule takes them)."""
        start = time.perf_counter()
        while len(self.order) < self.lookahead + 1:
            self.order.append((self.next_index, 0))
            self.next_index += 1
        seconds = [0.0, 0.0]
        for key in self.order:
            if key not in self.ready:
                self.ready[key] = self._sample(key, seconds)
        depth = len(self.ready)
        key = self.order.popleft()
        rollouts = self.ready.pop(key)
        reason = too_stale(rollouts[0].policy_version, version, self.max_staleness)
        require(reason is None, f"a batch of the inline schedule was {reason}", "this is a bug in opd; please report it")
        metrics = {"async/queue_depth": depth, "time/rollout_wait": time.perf_counter() - start,
                   "time/rollout_in_queue": 0.0, "time/generate": seconds[0], "time/recompute": seconds[1],
                   **{f"async/{k}": v for k, v in self.counts.items()}}
        return StepRollouts(rollouts, metrics, None if self.lookahead else self.engine_logprobs(), key)

    def _sample(self, key: tuple[int, int], seconds: list[float]) -> list[Rollout]:
        """One batch with the engine's weights of now; q recomputed as the worker does when batches may be stale."""
        index, attempt = key
        start = time.perf_counter()
        rollouts = generate_shards(self.engine, shards(self.prompts.batch(index), sampler_seed(self.seed, index, attempt),
                                                       self.n_shards), self.params, self.exact_kl)
        sampled = time.perf_counter()
        if self.lookahead:
            n = math.ceil(self.recompute_fraction * len(rollouts))
            self.rescore(rollouts[:n], rollout=self.engine_logprobs())
            for r in rollouts[n:]:
                r.hidden = None  # stale: the trainer could not use them
        seconds[0] += sampled - start
        seconds[1] += time.perf_counter() - sampled
        return rollouts

    def set_plan(self, plan: Plan) -> None:
        """As the worker schedule: every outstanding batch, sampled or not, is sampled again under the new plan with
        the newest weights (at the next batch)."""
        super().set_plan(plan)
        self.ready.clear()

    def state_dict(self, wait: bool) -> dict:
        return {"async": write_state(self.next_index, self.counts, self.order, self.ready),
                "engine_scales": dict(self.engine.scales)}
