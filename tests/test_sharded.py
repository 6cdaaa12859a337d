"""The sharded learner (training/sharded.py: FSDP2 over gloo, 2 ranks on this CPU), against the one-rank learner:
step for step equal within float rounding, checkpoints a run on N ranks resumes on M, bad input is one line, and a
rank that dies ends the run with its checkpoint intact. The ranks rendezvous over TCP, so these run in a network
namespace with only loopback (make test does: unshare -n)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from opd.config.runlog import read_metrics

from helpers import assert_one_line_error, opd

pytestmark = pytest.mark.distributed

ASYNC = ["schedule=async", "async.max_staleness=1", "async.worker_threads=1"]
GUARD = ["guard.every=1", "guard.action=fallback", "guard.limit=1e-12"]  # trips at once: BF16 from step 1
RULES = {"loss/value": 1e-5, "loss/rkl_sampled": 1e-5, "train/grad_norm": 1e-5}  # relative: float rounding only
WEIGHTS = 1e-6  # absolute, on weights of magnitude ~0.02-1 after a few AdamW steps of lr 1e-3


@pytest.fixture(scope="module", autouse=True)
def loopback_only():
    import socket
    if [name for _, name in socket.if_nameindex()] != ["lo"]:
        pytest.skip("the ranks' rendezvous here would listen on the machine's address: run pytest inside a network "
                    "namespace with only loopback (make test does: unshare -n)")


def settings(pair, *extra):
    student, teacher = pair
    values = [f"student={student}", f"teacher={teacher}", "task=add", "steps=4", "batch_size=4", "eval.every=0",
              "eval.examples=8", "save_every=2", "plan=", "sampling.shards=2", "threads=2", "optim.lr=1e-3", *extra]
    return [x for v in values for x in ("--set", v)]


def run(pair, run_dir, *extra, args=()):
    out = opd("train", *settings(pair, *extra), "--run-dir", run_dir, "--quiet", *args)
    assert out.returncode == 0, out.stderr
    return out


def same_run(a, b, steps):
    ra, rb = read_metrics(a), read_metrics(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == list(range(steps + 1))
    for x, y in zip(ra[:steps], rb[:steps]):
        assert x["rollout/length_mean"] == y["rollout/length_mean"]  # the same rollouts
        for key, rel in RULES.items():
            assert y[key] == pytest.approx(x[key], rel=rel), (x["step"], key)
        assert set(x) - {"time/sync"} <= set(y), set(x) - set(y)  # every metric of the whole batch is logged
    wa, wb = load_file(str(a / "checkpoint" / "model.safetensors")), load_file(str(b / "checkpoint" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < WEIGHTS


@pytest.mark.parametrize("loss, plan", [(["loss.name=full_rkl"], "plan="),
                                        (["loss.name=sampled_rkl", "loss.correction=tis"], "plan="),
                                        (["loss.name=full_rkl"], "plan=kv=fp8_e4m3"),
                                        (ASYNC, "plan="),
                                        (GUARD, "plan=noise=0.05")])
def test_two_ranks_train_what_one_rank_trains(pair, tmp_path, loss, plan):
    """Rank r samples sub-batch r (sampling.shards = 2 on one rank samples the same), the gradients averaged by FSDP
    and the all-reduce equal the whole batch's: the same losses, gradient norms and weights within float rounding,
    for the full and a sampled estimator, under an FP8 KV cache too (fixed scale: each rank's engine is the same), and
    in the async schedule (each rank's rollout worker samples its sub-batch one step ahead), and with the runtime guard
    (rank 0 judges the whole batch, every rank falls back at the same step; a sharded guard's ladder skips calibrated
    KV scales, which each rank would calibrate on its own sub-batch: tested in test_guard_ladder_of_a_sharded_run)."""
    one, two = tmp_path / "one", tmp_path / "two"
    run(pair, one, plan, *loss)
    run(pair, two, plan, *loss, "compute.learner_ranks=2")
    same_run(one, two, 4)
    if loss is GUARD:
        events = [[json.loads(x) for x in (r / "guard.jsonl").read_text().splitlines()] for r in (one, two)]
        assert events[0][0]["action"] == "fallback" and [e["step"] for e in events[0]] == [e["step"] for e in events[1]]
        assert json.loads((two / "checkpoint" / "trainer_state.json").read_text())["fallback"] is True


@pytest.mark.ray
def test_ranks_placed_by_ray_train_what_ranks_started_here_train(pair, tmp_path):
    """ray.learner: the 2 ranks as Ray actors in one placement group on a local cluster (each runs the rank's `opd
    train` as a child process with torchrun's variables) log what the 2 ranks `opd train` starts itself log; rank 0's
    output reaches the terminal."""
    pytest.importorskip("ray")
    here, ray = tmp_path / "here", tmp_path / "ray"
    run(pair, here, "compute.learner_ranks=2")
    out = run(pair, ray, "compute.learner_ranks=2", "ray.learner=true")
    assert "learner sharded over 2 ranks, placed by Ray" in out.stdout and "4 steps in" in out.stdout, out.stdout
    same_run(here, ray, 4)


@pytest.mark.ray
@pytest.mark.parametrize("extra, fragments", [
    (["ray.learner_cpus=64"], ["the Ray cluster has", "2 learner ranks of 64 CPUs", "do not fit"]),
    (["compute.learner_ranks=1"], ["ray.learner places the ranks of a sharded learner"]),
    (["ray.learner_cpus=0"], ["ray.learner_cpus and ray.learner_gpus must be >= 0, not both 0"]),
])
def test_ranks_ray_cannot_place_are_one_line_and_start_nothing(pair, tmp_path, extra, fragments):
    pytest.importorskip("ray")
    out = opd("train", *settings(pair, "compute.learner_ranks=2", "ray.learner=true", *extra), "--run-dir",
              tmp_path / "run", "--quiet")
    assert_one_line_error(out, *fragments)
    assert out.returncode == 2 and not (tmp_path / "run").exists()


def test_guard_ladder_of_a_sharded_run():
    """A fixed-scale FP8 cache falls back to calibrated scales on one rank, straight to BF16 on several."""
    from opd.health.guard import safer_plan
    from opd.numerics.plan import Plan
    plan = Plan.parse("kv=fp8_e4m3", 2)
    assert "calibrate" in str(safer_plan(plan, "builtin"))
    assert safer_plan(plan, "builtin", calibrate=False) == Plan.parse("forward=bf16 kv=bf16", 2)


def test_a_run_on_two_ranks_resumes_on_one_or_two_and_exports_a_plain_hf_folder(pair, tmp_path):
    """The checkpoint is whole (gathered to rank 0, the one-rank format): 2 ranks -> 2 and 2 -> 1 both continue the
    run to what the uninterrupted 2-rank run logs; the student folder loads in transformers."""
    run(pair, tmp_path / "straight", "compute.learner_ranks=2", "steps=4")
    for ranks in (2, 1):
        split = tmp_path / f"to{ranks}"
        run(pair, split, "compute.learner_ranks=2", "steps=2")
        state = json.loads((split / "checkpoint" / "trainer_state.json").read_text())
        assert state["step"] == 2
        run(pair, split, f"compute.learner_ranks={ranks}", "steps=4", args=("--resume",))
        same_run(tmp_path / "straight", split, 4)
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "checkpoint")
    weights = load_file(str(tmp_path / "straight" / "checkpoint" / "model.safetensors"))
    assert torch.equal(model.state_dict()["model.norm.weight"], weights["model.norm.weight"])


def test_an_async_run_resumes_on_its_own_rank_count_only(pair, tmp_path):
    """Each rank's batches in flight are in the checkpoint: 2 -> 2 continues exactly; 2 -> 1 is refused in one line
    (the sub-batches in flight are the two ranks')."""
    run(pair, tmp_path / "straight", "compute.learner_ranks=2", *ASYNC, "steps=4")
    split = tmp_path / "split"
    run(pair, split, "compute.learner_ranks=2", *ASYNC, "steps=2")
    out = opd("train", *settings(pair, "compute.learner_ranks=1", *ASYNC, "steps=4"), "--run-dir", split, "--quiet",
              "--resume")
    assert_one_line_error(out, "batches in flight of 2 learner ranks", "compute.learner_ranks=2")
    run(pair, split, "compute.learner_ranks=2", *ASYNC, "steps=4", args=("--resume",))
    same_run(tmp_path / "straight", split, 4)


@pytest.mark.parametrize("extra, fragments", [
    (["compute.learner_ranks=4096", "batch_size=4096", "sampling.shards=0"], ["compute.learner_ranks 4096", "CPU core"]),
    (["compute.learner_ranks=2", "batch_size=5"], ["batch_size 5 does not divide over 2 learner ranks"]),
    (["compute.learner_ranks=2", *ASYNC, "async.backend=ray"], ["not yet Ray actors"]),
    (["compute.learner_ranks=2", "plan=kv=fp8_e4m3 kv_scale=calibrate"], ["calibrated KV scales"]),
    (["compute.learner_ranks=2", "sampling.shards=3"], ["sampling.shards 3"]),
])
def test_bad_sharding_is_one_line_and_starts_no_rank(pair, tmp_path, extra, fragments):
    out = opd("train", *settings(pair, *extra), "--run-dir", tmp_path / "run", "--quiet")
    assert_one_line_error(out, *fragments)
    assert out.returncode == 2 and not (tmp_path / "run").exists()


def test_a_rank_launched_alone_is_told_how_many_the_job_needs(pair, tmp_path):
    """torchrun with the wrong process count: WORLD_SIZE 1 for learner_ranks 2."""
    env = os.environ | {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29581"}
    out = subprocess.run([sys.executable, "-m", "opd.cli", "train", *settings(pair, "compute.learner_ranks=2"),
                          "--run-dir", str(tmp_path / "run"), "--quiet"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert_one_line_error(out, "compute.learner_ranks is 2 but this job has 1 processes", "torchrun --nproc-per-node 2")


@pytest.mark.parametrize("launcher", ["here", pytest.param("ray", marks=pytest.mark.ray)])
def test_a_rank_that_dies_ends_the_run_with_its_checkpoint_intact(pair, tmp_path, launcher):
    """SIGKILL to rank 1 once the first checkpoint is written: the launcher (opd train's own, or Ray's placement)
    stops rank 0 and exits with one line; the checkpoint it left resumes (on one rank) to the end."""
    if launcher == "ray":
        pytest.importorskip("ray")
    run_dir = tmp_path / "run"
    placed = ["ray.learner=true"] if launcher == "ray" else []
    proc = subprocess.Popen([sys.executable, "-m", "opd.cli", "train",
                             *settings(pair, "compute.learner_ranks=2", "steps=400", "save_every=2", *placed),
                             "--run-dir", str(run_dir), "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    state = run_dir / "checkpoint" / "trainer_state.json"
    deadline = time.monotonic() + 240
    while not state.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert state.exists(), proc.stderr.read() if proc.poll() is not None else "no checkpoint in 240 s"
    if launcher == "ray":  # the rank is a child of its actor, a Ray worker process
        rank1 = [int(e) for e in os.listdir("/proc") if e.isdigit() and "\0RANK=1\0" in "\0" + environ(int(e))
                 and "OPD_LAUNCHER=ray\0" in environ(int(e))]
    else:
        rank1 = [pid for pid in children(proc.pid) if "RANK=1\0" in environ(pid)]
    assert len(rank1) == 1
    os.kill(rank1[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "Traceback" not in err, err
    errors = [x for x in err.strip().splitlines() if x.startswith("opd: error:")]
    assert len(errors) == 1 and "rank" in errors[0], err
    done = json.loads(state.read_text())["step"]
    assert done >= 2 and done % 2 == 0
    run(pair, run_dir, "compute.learner_ranks=1", f"steps={done + 2}", args=("--resume",))
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(done + 3))


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def environ(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/environ") as f:
            return f.read()
    except OSError:
        return ""
