"""The Ray backend (ray_backend.py) on a local cluster the tests start (2 CPUs, no dashboard), inside a network
namespace with only loopback (`make test` runs pytest under `unshare -n`): N rollout actors at staleness 0 are the
synchronous run with the same shards, a killed actor is restarted, restarts run out into one line, and a crash then
--resume is the whole run. Ray is the optional extra `.[ray]`, which `make test` installs."""
import os
import sys
import time

import pytest

from opd.io.errors import OpdError
from opd.training.trainer import train

from helpers import assert_one_line_error, comparable, config, crash_at, opd, same_as_sync

pytestmark = pytest.mark.ray


def loopback_only() -> bool:
    """This process's network namespace has no interface but loopback (if_nameindex asks the kernel about this
    namespace; /sys/class/net may still show the host's)."""
    import socket
    return [name for _, name in socket.if_nameindex()] == ["lo"]


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]'; make test installs it)")
    if not loopback_only():
        pytest.skip("a Ray cluster here would use the machine's network address: run pytest inside a network "
                    "namespace with only loopback (make test does: unshare -n)")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
             logging_level="ERROR")
    yield ray
    ray.shutdown()


def ray_config(pair, **overrides):
    """An async run of the pair on the cluster's rollout actors (one thread each, the trainer one)."""
    values = {"schedule": "async", "threads": 2, "plan": "kv=fp8_e4m3", "save_every": 0,
              "async_": {"backend": "ray", "worker_timeout": 60.0}, "ray": {"workers": 2, "worker_cpus": 1.0}}
    for key in ("async_", "ray"):
        values[key] = values[key] | overrides.pop(key, {})
    return config(pair, **(values | overrides))


def actors(run):
    return run.rollouts.worker.actors


def kill_actor_at(at_step: int, which: int = 0):
    def kill(step, run):
        if step == at_step:
            import ray
            ray.kill(actors(run)[which], no_restart=True)
    return kill


def test_n_actors_at_staleness_0_are_the_sync_run_with_the_same_shards(cluster, pair, tmp_path):
    """Every step's metrics (mismatch, losses, the exact KL from the actors' hidden states) equal the synchronous
    run that samples each batch as the same two sub-batches in this process."""
    from opd.config.runlog import read_metrics
    train(config(pair, plan="kv=fp8_e4m3", sampling={"shards": 2}, save_every=0), tmp_path / "sync", progress=False)
    summary = train(ray_config(pair, async_={"max_staleness": 0}), tmp_path / "ray", progress=False)
    assert summary["steps"] == 6 and summary["async/worker_restarts"] == 0
    sync, ray_rows = read_metrics(tmp_path / "sync"), read_metrics(tmp_path / "ray")
    assert same_as_sync(ray_rows, sync) and "mismatch/kl_exact" in ray_rows[0]


def test_the_shards_do_not_depend_on_the_number_of_actors(cluster, pair, tmp_path):
    """Four shards on two actors (shards 0, 2 and 1, 3) equal four shards sampled in this process. (Two prompts a
    shard: with one, an engine in another process, a Ray actor or the process backend's worker alike, gives log-probs
    that differ from this process's in the last bits, tokens equal; dev/LOG.md.)"""
    from opd.config.runlog import read_metrics
    train(config(pair, plan="kv=fp8_e4m3", steps=3, batch_size=8, sampling={"shards": 4}, save_every=0),
          tmp_path / "sync", progress=False)
    train(ray_config(pair, steps=3, batch_size=8, sampling={"shards": 4}, async_={"max_staleness": 0}),
          tmp_path / "ray", progress=False)
    assert same_as_sync(read_metrics(tmp_path / "ray"), read_metrics(tmp_path / "sync"))


def test_the_teacher_on_an_actor_of_its_own_scores_as_the_teacher_here(cluster, pair, tmp_path):
    """ray.teacher: the teacher's forward on a scoring actor, its output layer in the learner: every per-step metric
    (teacher log-probs, losses, gradients) and the held-out reverse KL as with the teacher in the learner."""
    from opd.config.runlog import read_metrics
    from opd.training.setup import setup
    base = {"steps": 3, "batch_size": 8, "async_": {"max_staleness": 0}, "ray": {"workers": 1}}
    train(ray_config(pair, **base), tmp_path / "here", progress=False)
    train(ray_config(pair, **(base | {"ray": {"workers": 1, "teacher": True}})), tmp_path / "actor", progress=False)
    assert comparable(read_metrics(tmp_path / "actor")) == comparable(read_metrics(tmp_path / "here"))
    from opd.training.ray_backend import RemoteTeacher
    run = setup(ray_config(pair, **(base | {"ray": {"workers": 1, "teacher": True}})))
    assert isinstance(run.teacher, RemoteTeacher)  # the learner keeps the teacher's output layer only
    assert tuple(run.teacher.lm_head.weight.shape) == (run.student.cfg.vocab_size, run.teacher.cfg.hidden_size)
    run.teacher.close()


def test_a_dead_teacher_actor_stops_the_run_with_one_line(cluster, pair, tmp_path):
    def kill_teacher(step, run):
        if step == 1:
            import ray
            ray.kill(run.teacher.actor, no_restart=True)
    with pytest.raises(OpdError, match="the teacher actor died"):
        train(ray_config(pair, steps=4, ray={"workers": 1, "teacher": True}), tmp_path / "run", progress=False,
              on_step=kill_teacher)
    assert (tmp_path / "run" / "checkpoint").is_dir()


def test_a_killed_actor_is_restarted_with_the_newest_weights(cluster, pair, tmp_path):
    start = time.monotonic()
    summary = train(ray_config(pair, async_={"max_staleness": 1}), tmp_path / "run", progress=False,
                    on_step=kill_actor_at(2, which=1))
    assert summary["async/worker_restarts"] == 1 and summary["steps"] == 6
    assert time.monotonic() - start < 120


def test_a_hung_actor_is_detected_and_restarted(cluster, pair, tmp_path):
    """An actor that stops answering (its process stopped with SIGSTOP) counts as hung after async.worker_timeout."""
    import signal

    def stop_actor(step, run):
        if step == 2:
            os.kill(run.rollouts.worker.pids[1], signal.SIGSTOP)
    start = time.monotonic()
    summary = train(ray_config(pair, async_={"max_staleness": 1, "worker_timeout": 3.0}), tmp_path / "run",
                    progress=False, on_step=stop_actor)
    assert summary["async/worker_restarts"] == 1 and summary["steps"] == 6
    assert time.monotonic() - start < 120


def test_restarts_used_up_stop_the_run_with_one_line_and_a_checkpoint(cluster, pair, tmp_path):
    with pytest.raises(OpdError, match=r"rollout worker rollout-0 \(Ray actor 0\) died.*restarted 0 times"):
        train(ray_config(pair, async_={"max_staleness": 1, "max_worker_restarts": 0}), tmp_path / "run",
              progress=False, on_step=kill_actor_at(1))
    assert (tmp_path / "run" / "checkpoint").is_dir()


def test_crash_then_resume_is_the_whole_run(cluster, pair, tmp_path):
    from opd.config.runlog import read_metrics
    cfg = ray_config(pair, save_every=3, async_={"max_staleness": 1})
    train(cfg, tmp_path / "whole", progress=False)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(cfg, tmp_path / "cut", progress=False, on_step=crash_at(4))
    train(cfg, tmp_path / "cut", resume=True, progress=False)
    assert comparable(read_metrics(tmp_path / "cut")) == comparable(read_metrics(tmp_path / "whole"))


def listening_addresses() -> list[str]:
    """The local addresses of this namespace's listening TCP sockets, as the kernel lists them (/proc/net/tcp{,6}:
    what `ss -tln` shows, without needing ss)."""
    import ipaddress
    out = []
    for name, size in (("tcp", 4), ("tcp6", 16)):
        for line in open(f"/proc/net/{name}").read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A":  # LISTEN
                raw = bytes.fromhex(local.split(":")[0])
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, size, 4))  # each 32-bit word little-endian
                out.append(str(ipaddress.ip_address(raw)))
    return out


def test_only_loopback_sockets(cluster):
    """The cluster listens on 127.0.0.1 only (and the namespace has no other interface to reach)."""
    addresses = listening_addresses()
    loopback = [a for a in addresses if ipaddress_loopback(a)]
    assert addresses and loopback == addresses, addresses


def ipaddress_loopback(address: str) -> bool:
    import ipaddress
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


# -- bad input: one line, no hang -----------------------------------------------------------------------------------
def cli_args(pair, tmp_path, *sets):
    student, teacher = pair
    base = [f"student={student}", f"teacher={teacher}", "task=add", "steps=2", "batch_size=4", "eval.examples=4",
            "schedule=async", "async.backend=ray", *sets]
    return ["train", *[a for s in base for a in ("--set", s)], "--run-dir", str(tmp_path / "run"), "--quiet"]


def test_an_address_that_does_not_answer(pair, tmp_path):
    pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]'; make test installs it)")
    start = time.monotonic()
    result = opd(*cli_args(pair, tmp_path, "ray.address=127.0.0.1:9", "ray.connect_timeout=5"))
    assert_one_line_error(result, "the Ray cluster at 127.0.0.1:9 does not answer", "ray start --head")
    assert time.monotonic() - start < 60


def test_resources_the_cluster_cannot_give(cluster, pair, tmp_path):
    result = opd(*cli_args(pair, tmp_path, "ray.workers=2", "ray.worker_gpus=1"))
    assert_one_line_error(result, "rollout workers need", "GPUs", "lower ray.workers")


def test_ray_not_installed(pair, tmp_path):
    shadow = tmp_path / "shadow" / "ray"
    shadow.mkdir(parents=True)  # a stand-in `ray` that fails to import, first on the path
    (shadow / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    import subprocess
    result = subprocess.run([sys.executable, "-m", "opd.cli", *cli_args(pair, tmp_path)], capture_output=True,
                            text=True, env=os.environ | {"PYTHONPATH": str(tmp_path / "shadow")}, timeout=300)
    assert_one_line_error(result, "async.backend ray and ray.learner need Ray, which is not installed",
                          "pip install -e '.[ray]'")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
