"""The asynchronous schedule: it reproduces sync at staleness 0, bounds and measures staleness, survives its worker.

Each async run spawns a worker process (about 2-3 s to import torch), so these runs are short.
"""
import json
import multiprocessing
import os
import pickle
import signal
import time
from dataclasses import asdict, dataclass, fields
from functools import partial

import pytest
import torch

from opd.io import wire
from opd.training.async_rollouts import AsyncRollouts, Result
from opd.io.channel import Channel
from opd.models.checkpoint import load_checkpoint
from opd.engines.builtin import Engine
from opd.io.errors import OpdError
from opd.training.learner import collate, completion_logprobs
from opd.training.losses import kl
from opd.health.metrics import exact_kl_metric
from opd.models.model import ModelConfig
from opd.numerics.plan import Plan
from opd.config.runlog import read_metrics
from opd.engines.sampling import Rollout
from opd.engines.sampling import SamplingParams
from opd.config.sections import AsyncConfig
from opd.training.trainer import train
from opd.training.worker import (RolloutWorker, WorkerLost, WorkerSpec, plan_from_tree, plan_tree, recompute, rollout_from_tree,
                        rollout_tree, spec_from_tree, spec_tree)

from helpers import (assert_one_line_error, comparable, config, crash_at, opd, recorded_distributions, same_as_sync,
                     tiny)

pytestmark = pytest.mark.slow

def async_config(pair, **overrides):
    """An async run of the pair; the async section's settings (max_staleness=1, ...) may be given as keywords."""
    settings = {key: overrides.pop(key) for key in [f.name for f in fields(AsyncConfig)] if key in overrides}
    # threads=2: one for the worker, one for the trainer, so the trainer's arithmetic matches a threads=1 sync run
    return config(pair, **({"schedule": "async", "threads": 2, "plan": "kv=fp8_e4m3", "async_": settings} | overrides))


def no_worker_left():
    return multiprocessing.active_children() == []


@pytest.mark.parametrize("plan, gemm", [("kv=fp8_e4m3", "float32"), ("forward=bf16 kv=fp8_e4m3", "float32"),
                                        ("forward=bf16 kv=fp8_e4m3", "native")])
def test_staleness_zero_reproduces_the_sync_run(pair, tmp_path, plan, gemm):
    """Including the exact KL, which the trainer computes from the worker's hidden states with the sampling engine's
    output layer (bf16 in a bf16 forward: that case used to fail on mixed dtypes), and the engine's bf16 GEMMs (the
    worker builds its engine with the run's engine.bf16_gemm)."""
    engine = {"bf16_gemm": gemm}
    train(config(pair, plan=plan, engine=engine), tmp_path / "sync", progress=False)
    train(async_config(pair, max_staleness=0, plan=plan, engine=engine), tmp_path / "async", progress=False)
    sync, asyn = read_metrics(tmp_path / "sync"), read_metrics(tmp_path / "async")
    assert len(sync) == 7 and same_as_sync(asyn, sync)
    assert all(row.get("async/requeued", 0) == 0 for row in asyn)
    assert no_worker_left()


def test_staleness_one_is_exact_and_measured_apart_from_numerics(pair, tmp_path):
    """k=1: batch s is sampled by version s-1 (0 while the pipeline fills). With a float32 engine the numerics
    mismatch (mu vs q) stays zero although the policy moved (pi vs q): the two are measured apart."""
    train(async_config(pair, max_staleness=1, plan="", optim=dict(lr=1e-2)), tmp_path / "run", progress=False)
    rows = read_metrics(tmp_path / "run")[:-1]
    assert [r["stale/version_gap_max"] for r in rows] == [0, 1, 1, 1, 1, 1]
    assert [r["train/version"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["mismatch/kl_k3"] < 1e-9 and abs(r["mismatch/kl_exact"]) < 1e-7 for r in rows)
    assert rows[0]["stale/upd_kl_k3"] == 0 and all(r["stale/upd_kl_k3"] > 1e-6 for r in rows[1:])


@pytest.mark.parametrize("fraction", [0.5, 0.0])
def test_recomputing_part_of_the_batch_or_none(pair, tmp_path, fraction):
    """Half: the q-based metrics come from the recomputed rows (still zero numerics mismatch at float32).
    None: for stale batches they are left out rather than guessed; the version gaps are still logged."""
    train(async_config(pair, max_staleness=1, plan="", recompute_fraction=fraction), tmp_path / "run", progress=False)
    rows = read_metrics(tmp_path / "run")[:-1]
    assert [r["stale/version_gap_max"] for r in rows] == [0, 1, 1, 1, 1, 1]
    if fraction:
        assert all(r["mismatch/kl_k3"] < 1e-9 and "stale/upd_kl_k3" in r for r in rows)
    else:
        assert "mismatch/kl_k3" in rows[0]  # batch 0 was sampled by the current weights: q = pi
        assert not any("mismatch/kl_k3" in r or "stale/upd_kl_k3" in r or "mismatch/kl_exact" in r for r in rows[1:])


def test_worker_recompute_matches_the_trainers_forward(pair):
    """The worker's q and exact KL come from the sampling weights at full precision: at full precision q equals the
    sampler's mu and the KL is 0; under an fp8 KV cache the per-token KL (from the engine's hidden states, chunked)
    averages to the KL between the distributions the engine drew from (recorded) and the unchunked trainer forward."""
    model, tok = load_checkpoint(pair[0])
    prompts = [[1, 20, 21], [1, 22, 23, 24, 25]]
    for plan in ("", "kv=fp8_e5m2"):
        engine = Engine(model, tok.stop_ids, tok.pad_id, plan)
        with recorded_distributions(engine) as dists:
            rollouts = engine.generate(prompts, SamplingParams(12), 0, return_hidden=True)
        batch = collate(rollouts, tok.pad_id)
        with torch.no_grad():
            want = exact_kl_metric(kl(dists(batch).double(), completion_logprobs(model, batch).double()), batch.mask)
        recompute(engine.base, rollouts, tok.pad_id, SamplingParams(12), 0, partial(engine.logprobs,
                                                                                      params=SamplingParams(12)))
        got = collate(rollouts, tok.pad_id)
        if plan == "":
            assert torch.allclose(got.q[got.mask], got.mu[got.mask], atol=2e-5)
            assert got.kl_exact[got.mask].abs().max() < 1e-6
        else:
            assert want["mismatch/kl_exact"] > 1e-5
            assert got.kl_exact[got.mask].double().mean().item() == pytest.approx(want["mismatch/kl_exact"], rel=1e-4)


@pytest.mark.parametrize("policy", ["requeue", "drop"])
def test_too_stale_batches_are_requeued_or_dropped_and_counted(pair, tmp_path, policy, capsys):
    """prefetch 1 lets the worker sample one batch ahead, so with max_staleness 0 every batch but the first
    arrives one version too old: each is re-sampled or discarded, and no stale batch is trained on. The first one
    says why, once."""
    summary = train(async_config(pair, max_staleness=0, prefetch=1, stale_policy=policy), tmp_path / "run",
                    progress=False)
    notes = [line for line in capsys.readouterr().err.splitlines() if "opd: note: prompt batch" in line]
    assert len(notes) == 1 and "1 steps behind the learner's" in notes[0] and "(max_staleness 0)" in notes[0]
    rows = read_metrics(tmp_path / "run")[:-1]
    assert all(r["stale/version_gap_max"] == 0 for r in rows)
    counted = summary[f"async/{'requeued' if policy == 'requeue' else 'dropped'}"]
    assert counted >= 5 and rows[-1][f"async/{'requeued' if policy == 'requeue' else 'dropped'}"] == counted
    other = summary[f"async/{'dropped' if policy == 'requeue' else 'requeued'}"]
    assert other == 0


@pytest.mark.reliability
def test_resume_after_a_crash_continues_exactly(pair, tmp_path):
    cfg = async_config(pair, max_staleness=1, save_every=3)
    train(cfg, tmp_path / "whole", progress=False)

    with pytest.raises(RuntimeError):
        train(cfg, tmp_path / "cut", progress=False, on_step=crash_at(4))
    assert no_worker_left()
    train(cfg, tmp_path / "cut", resume=True, progress=False)
    assert comparable(read_metrics(tmp_path / "cut")) == comparable(read_metrics(tmp_path / "whole"))


@pytest.mark.reliability
def test_ctrl_c_leaves_a_resumable_run(pair, tmp_path):
    cfg = async_config(pair, max_staleness=2, save_every=0)

    def interrupt(step, run):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: the trainer stops at the step boundary and saves

    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path / "run", progress=False, on_step=interrupt)
    assert no_worker_left()
    state = json.loads((tmp_path / "run" / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 3
    summary = train(cfg, tmp_path / "run", resume=True, progress=False)
    rows = read_metrics(tmp_path / "run")
    assert summary["steps"] == 6 and [r["step"] for r in rows] == list(range(7))


def kill_worker_at(step_to_kill, sig):
    def hook(step, run):
        if step == step_to_kill:
            os.kill(run.rollouts.worker.pid, sig)
    return hook


@pytest.mark.reliability
def test_a_killed_worker_is_restarted(pair, tmp_path):
    start = time.monotonic()
    summary = train(async_config(pair, max_staleness=1), tmp_path / "run", progress=False,
                    on_step=kill_worker_at(2, signal.SIGKILL))
    assert summary["async/worker_restarts"] == 1 and summary["steps"] == 6
    assert time.monotonic() - start < 60
    assert no_worker_left()


@pytest.mark.reliability
def test_a_hung_worker_is_detected_and_restarted(pair, tmp_path):
    summary = train(async_config(pair, max_staleness=1, worker_timeout=3.0), tmp_path / "run", progress=False,
                    on_step=kill_worker_at(2, signal.SIGSTOP))
    assert summary["async/worker_restarts"] == 1 and summary["steps"] == 6
    assert no_worker_left()


@pytest.mark.reliability
def test_a_worker_that_keeps_dying_stops_the_run_with_a_clear_error(pair, tmp_path):
    start = time.monotonic()
    with pytest.raises(OpdError, match="rollout worker rollout-0 exited with code -9; it was restarted 0 times"):
        train(async_config(pair, max_staleness=1, max_worker_restarts=0), tmp_path / "run", progress=False,
              on_step=kill_worker_at(1, signal.SIGKILL))
    assert time.monotonic() - start < 30
    assert no_worker_left()
    state = json.loads((tmp_path / "run" / "checkpoint" / "trainer_state.json").read_text())
    # saved where it stopped: at step 2, or 3 if batch 2 had reached the trainer before the kill
    assert state["step"] in (2, 3)
    summary = train(async_config(pair, max_staleness=1, max_worker_restarts=1), tmp_path / "run", resume=True,
                    progress=False)
    assert summary["steps"] == 6


def test_async_through_the_cli(pair, tmp_path):
    student, teacher = pair
    settings = [f"student={student}", f"teacher={teacher}", "task=add", "steps=3", "batch_size=4", "eval.examples=8",
                "schedule=async", "async.max_staleness=1"]
    result = opd("train", *[a for s in settings for a in ("--set", s)], "--run-dir", str(tmp_path / "run"), "--quiet")
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["schedule"] == "async" and summary["steps"] == 3


@pytest.mark.parametrize("setting,message", [
    ("async.stale_policy=keep", "unknown async.stale_policy 'keep'"),
    ("async.max_staleness=-1", "async.max_staleness must be >= 0"), ("async.prefetch=-2", "async.prefetch must be >= -1"),
    ("async.worker_timeout=0", "async.worker_timeout must be positive"), ("max_staleness=1", "'async.max_staleness'"),
    ("threads=1", "async needs more threads (1) than the rollout worker's (1)")])
def test_bad_async_settings(pair, tmp_path, setting, message):
    student, teacher = pair
    settings = [f"student={student}", f"teacher={teacher}", "schedule=async", setting]
    result = opd("train", *[a for s in settings for a in ("--set", s)], "--run-dir", str(tmp_path / "run"))
    assert_one_line_error(result, message)


# -- the channel: tensors + JSON over a bytes-only pipe, never pickle ------------------------------------------------
class Marker:
    """Unpickling this creates a file: the proof that a payload was executed."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def listening_worker():
    """A trainer-side handle on a pipe whose other end the test writes to (as the worker would)."""
    here, there = multiprocessing.Pipe()
    worker = RolloutWorker("rollout-0", None, timeout=5.0)
    worker.process, worker.channel = multiprocessing.current_process(), Channel(here)  # alive: it is this process
    return worker, there


@pytest.mark.reliability
@pytest.mark.parametrize("payload", ["pickle", "torch.save", "unknown kind"])
def test_a_pickle_payload_from_the_worker_is_refused_never_run(tmp_path, payload):
    marker = tmp_path / "executed"
    if payload == "pickle":
        data = pickle.dumps(Marker(marker))
    elif payload == "torch.save":
        torch.save({"rollouts": Marker(marker)}, tmp_path / "blob.pt")
        data = (tmp_path / "blob.pt").read_bytes()
    else:
        data = wire.encode({"kind": "exec", "code": "open(...)"})
    worker, there = listening_worker()
    there.send_bytes(data)
    with pytest.raises(OpdError, match="a message from rollout worker rollout-0 is not ") as error:
        worker.receive()
    assert "\n" not in str(error.value)
    assert not marker.exists()


@pytest.mark.reliability
def test_both_ends_can_send_large_messages_before_either_reads():
    """The feeder threads: with plain pipe writes, two sides each sending more than the pipe holds would deadlock."""
    a, b = (Channel(conn) for conn in multiprocessing.Pipe())
    big = [bytes([i]) * (4 << 20) for i in range(4)]  # 16 MB each way, far beyond a pipe's buffer
    for data in big:
        a.send(data)
        b.send(data)
    assert [a.receive(timeout=30) for _ in big] == big and [b.receive(timeout=30) for _ in big] == big


def through_wire(tree):
    return wire.decode(wire.encode(tree))


@pytest.mark.parametrize("text", ["", "kv=fp8_e4m3 kv_scale=calibrate; 0,3: kv=bf16", "w=int4 kv=int8 kv_scale=dynamic",
                                  "kv=int4 kv_group=16 kv_per_head=true; 2: kv=fp8_e5m2 kv_scale=dynamic",
                                  "1: noise=0.01 key_outlier=3.5; 2-3: w=fp8_block", "forward=bf16 kv=bf16",
                                  "forward=bf16 kv=fp8_e4m3 kv_round=zero", "kv_group=64 kv=fp8_e4m3"])
def test_a_plan_round_trips_exactly(text):
    plan = Plan.parse(text, 4)
    assert plan_from_tree(through_wire(plan_tree(plan))) == plan
    if text == "kv_group=64 kv=fp8_e4m3":  # why not str(plan): the canonical string drops kv_group off int4
        assert Plan.parse(str(plan), 4) != plan


@pytest.mark.parametrize("gemm", ["float32", "native"])
def test_the_worker_builds_its_engine_with_the_runs_bf16_gemm(gemm):
    from opd.io import wire
    from opd.numerics.weight_quant import QuantLinear
    from opd.training.worker import WorkerCore, weights_message
    model = tiny(0).float()
    spec = WorkerSpec(asdict(model.cfg), [2], 0, Plan.parse("forward=bf16 kv=bf16", model.cfg.num_layers), 0,
                      SamplingParams(4), 1, return_hidden=False, recompute=False, recompute_fraction=1.0,
                      bf16_gemm=gemm)
    core = WorkerCore(wire.encode({"spec": spec_tree(spec), "scales": {}}), weights_message(model.state_dict(), 0))
    up = core.engine.model.layers[0].mlp.up_proj
    assert (isinstance(up, QuantLinear) and up.dequantized is not None) == (gemm == "float32")


def test_a_worker_spec_and_rollouts_round_trip_exactly():
    spec = WorkerSpec(asdict(ModelConfig(rope_scaling={"rope_type": "linear", "factor": 2.0})), [2, 7], 0,
                      Plan.parse("kv=fp8_e4m3 kv_scale=calibrate; 0: kv=bf16 noise=0.02", 4), 5,
                      SamplingParams(16, temperature=0.7, top_k=5, top_p=0.9, stop_token_ids=(3, 4)), 1,
                      return_hidden=True, recompute=True, recompute_fraction=0.5, device="cpu", dtype="bfloat16")
    assert spec_from_tree(through_wire(spec_tree(spec))) == spec
    rollouts = [Rollout([1, 20, 21], [5, 2], [-0.1, -1e-300], [-2.5, -1 / 3], "stop", 3, torch.randn(2, 8),
                        q=[-0.2, 0.0], kl_exact=[1e-9, -0.0]),
                Rollout([1], [], [], [], "length", 0)]
    for r in rollouts:
        back = rollout_from_tree(through_wire(rollout_tree(r)))
        assert (back.hidden is None) == (r.hidden is None) and (r.hidden is None or torch.equal(back.hidden, r.hidden))
        assert {**vars(back), "hidden": None} == {**vars(r), "hidden": None}
        assert all(type(x) is type(y) for k in ("logprobs", "completion_ids")
                   for x, y in zip(getattr(back, k), getattr(r, k)))


def test_the_async_state_round_trips_through_wire():
    """What the trainer saves in a checkpoint: finished batches (with hidden states), keys and counters."""
    def schedule():
        return AsyncRollouts(None, None, seed=0, max_staleness=2, lookahead=2, stale_policy="requeue",
                             worker_timeout=5.0, max_worker_restarts=0)
    one, other = schedule(), schedule()
    one.next_index, one.counts = 4, {"dropped": 1, "requeued": 2, "worker_restarts": 0}
    one.order.extend([(1, 1), (2, 0), (3, 0)])
    batch = [Rollout([1, 2], [3], [-0.5], [-0.6], "length", 1, torch.randn(1, 4))]
    one.ready[(2, 0)] = Result(batch, (1.0, 2.0), 0.0)
    state = one.state_dict(wait=False)["async"]
    other.load_state_dict(through_wire(state))
    assert (other.next_index, other.counts, other.order, list(other.ready)) == (4, one.counts, one.order, [(2, 0)])
    (back,) = other.ready[(2, 0)].rollouts
    assert torch.equal(back.hidden, batch[0].hidden) and {**vars(back), "hidden": 0} == {**vars(batch[0]), "hidden": 0}
    assert other.state_dict(wait=False)["async"]["order"] == state["order"]


@dataclass
class _Spec:  # what AsyncRollouts reads of a WorkerSpec when it does not sample
    plan: object = None
    return_hidden: bool = False


class _FlakyWorker:
    """A worker handle whose start() and send() raise WorkerLost as scripted; it records what reaches a started
    worker."""
    script: dict = {}  # "start" / "send": how many of those calls are lost, across every handle made
    sent: list = []

    def __init__(self, address, spec, timeout):
        self.address, self.process = address, None

    def start(self, weights, scales):
        if _FlakyWorker.script.get("start", 0):
            _FlakyWorker.script["start"] -= 1
            raise WorkerLost("exited")
        self.process = object()
        _FlakyWorker.sent.clear()  # a new process: what the old one was sent is gone

    def send(self, message):
        if _FlakyWorker.script.get("send", 0):
            _FlakyWorker.script["send"] -= 1
            raise WorkerLost("exited")
        _FlakyWorker.sent.append(tuple(message["key"]))

    @property
    def started(self):
        return self.process is not None

    def receive(self, block):
        return None

    def stop(self, grace=0):
        self.process = None


@pytest.mark.parametrize("lost", [{"start": 1}, {"send": 1}, {"start": 2, "send": 1}])
def test_a_worker_lost_while_restarting_gets_each_outstanding_request_once(lost):
    """set_plan restarts the worker; a loss during that start, or while re-sending the outstanding requests, costs
    one restart each, and the worker that stays up is sent every outstanding request exactly once."""
    prompts = type("Prompts", (), {"batch": lambda self, i: [[1, 2, 3]]})()
    schedule = AsyncRollouts(_Spec(), prompts, seed=0, max_staleness=2, lookahead=2, stale_policy="requeue",
                             worker_timeout=5.0, max_worker_restarts=5, new_worker=_FlakyWorker)
    _FlakyWorker.script = {}
    schedule.worker.start(b"", {})
    schedule.order.extend([(0, 0), (1, 0), (2, 0)])
    _FlakyWorker.script = dict(lost)
    schedule.set_plan(None)
    assert sorted(_FlakyWorker.sent) == [(0, 0), (1, 0), (2, 0)]
    assert schedule.counts["worker_restarts"] == sum(lost.values())


def test_a_worker_that_never_starts_stops_the_run_after_its_restarts_without_recursing():
    """Each failed restart is counted in a loop, not a recursion: thousands of allowed restarts end in one line."""
    schedule = AsyncRollouts(_Spec(), None, seed=0, max_staleness=0, lookahead=0, stale_policy="requeue",
                             worker_timeout=5.0, max_worker_restarts=3000, new_worker=_FlakyWorker)
    _FlakyWorker.script = {"start": 10 ** 6}

    def lost():
        raise WorkerLost("stopped answering")
    with pytest.raises(OpdError, match="restarted 3000 times already"):
        schedule._call(lost)
    _FlakyWorker.script = {}


def test_a_tree_written_to_a_file_reads_back_as_the_bytes_path_gives_it(tmp_path):
    """wire.encode_file / decode_file (checkpoints' optimizer state, streamed to disk) against encode / decode: the
    same tree, tensors bit for bit, tied storages and tagged keys included; the two formats are one."""
    weight = torch.randn(6, 4)
    tree = {"optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(6, 4, dtype=torch.bfloat16)},
                                    1: {"step": torch.tensor(3.0), "exp_avg": weight}},
                          "param_groups": [{"lr": 1e-3, "params": [0, 1], "betas": (0.9, 0.999)}]},
            "tied": [weight, weight[:2]], "none": None, "text": "x"}
    wire.encode_file(tree, tmp_path / "state.safetensors")
    from_file = wire.decode_file(tmp_path / "state.safetensors")
    from_bytes = wire.decode(wire.encode(tree))
    assert (tmp_path / "state.safetensors").read_bytes() == wire.encode(tree)

    def same(a, b):
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        if isinstance(a, dict):
            return type(b) is dict and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b and type(a) is type(b)
    assert same(from_file, tree) and same(from_bytes, tree)
    (tmp_path / "bad").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(OpdError, match="bad is not an opd tensors"):
        wire.decode_file(tmp_path / "bad", what=str(tmp_path / "bad"))


@pytest.mark.parametrize("plan, micro", [("kv=fp8_e4m3", 0), ("forward=bf16 kv=fp8_e5m2", 2)])
def test_the_inline_backend_is_the_worker_schedule_without_the_worker(pair, tmp_path, plan, micro):
    """async.backend inline samples the worker's batches with the worker's weights (staleness 2 here, q recomputed
    under the sampling weights, the exact KL among them, in the learner's micro-batches), in the trainer's process:
    every metric equals the worker process's run (the oracle), timing aside; the trainer gets every thread (1 here,
    as the process run's trainer and worker get 1 each, so the arithmetic is the same)."""
    settings = dict(max_staleness=2, plan=plan, optim=dict(lr=1e-2), compute=dict(micro_batch_size=micro))
    train(async_config(pair, **settings), tmp_path / "process", progress=False)
    train(async_config(pair, backend="inline", threads=1, **settings), tmp_path / "inline", progress=False)
    process, inline = read_metrics(tmp_path / "process"), read_metrics(tmp_path / "inline")
    assert [r["stale/version_gap_max"] for r in inline[:-1]] == [0, 1, 2, 2, 2, 2]
    assert inline[2]["stale/upd_kl_k3"] > 1e-6 and inline[2]["mismatch/kl_exact"] > 0
    assert comparable(inline) == comparable(process)


def test_the_inline_backend_at_staleness_zero_is_the_sync_run(pair, tmp_path):
    train(config(pair, plan="kv=fp8_e4m3"), tmp_path / "sync", progress=False)
    train(async_config(pair, max_staleness=0, backend="inline", threads=1), tmp_path / "inline", progress=False)
    assert same_as_sync(read_metrics(tmp_path / "inline"), read_metrics(tmp_path / "sync"))


def test_an_inline_run_resumes_exactly(pair, tmp_path):
    """Cut after the step-3 checkpoint, with batches sampled ahead and saved (at staleness 2, the batch of step 5
    was sampled by version 3): continued, the same metrics as the uncut run."""
    cfg = async_config(pair, backend="inline", threads=1, max_staleness=2, optim=dict(lr=1e-2))
    train(cfg, tmp_path / "straight", progress=False)
    with pytest.raises(RuntimeError):
        train(cfg, tmp_path / "cut", progress=False, on_step=crash_at(4))
    train(cfg, tmp_path / "cut", resume=True, progress=False)
    assert comparable(read_metrics(tmp_path / "cut")) == comparable(read_metrics(tmp_path / "straight"))


def test_the_inline_backend_refuses_to_sample_further_ahead_than_max_staleness(pair):
    with pytest.raises(OpdError, match="inline samples at most max_staleness"):
        async_config(pair, backend="inline", max_staleness=1, prefetch=2)
