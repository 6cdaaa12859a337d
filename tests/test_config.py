"""The config in typed sections: each section checks itself, dotted --set keys, keys from before the sections refused
with their new name (a user's file) or moved (a file opd itself saved: a run's config.yaml, a results line)."""
import json
from dataclasses import fields

import pytest
import yaml

from opd.config.run import SECTIONS, TrainConfig, attribute
from opd.config.files import MOVED, build_config, dump_config, flatten, load_config, migrate
from opd.io.errors import OpdError
from opd.config.sections import AsyncConfig, EvalConfig, GuardConfig

from helpers import config


ADDED_SINCE = {"sampling.shards", "async.backend", "ray.address", "ray.workers", "ray.worker_cpus", "ray.worker_gpus",
               "ray.connect_timeout", "ray.teacher", "ray.teacher_cpus", "ray.teacher_gpus",  # never top-level keys
               "teacher.path",  # the top-level `teacher` path before the teacher section
               "engine.bf16_gemm", "eval.greedy",
               "canary.plan", "canary.every", "canary.min_batches", "canary.max_batches", "canary.cut",
               "canary.watch_every", "canary.start", "canary.max_staleness", "compute.learner_ranks", "eval.samples",
               "compute.sharded", "canary.sigmas", "eval.contexts", "eval.seed", "eval.resample_final", "ray.learner",
               "ray.learner_cpus", "ray.learner_gpus"}


def old_layout(cfg: TrainConfig) -> dict:
    """cfg as a config.yaml written before the sections: every moved key at the top, under its old name."""
    old_name = {new: old for old, new in MOVED.items()}
    out = {}
    for key, value in flatten(cfg.to_dict()).items():
        if key == "teacher.path":
            out["teacher"] = value
            continue
        if key in ADDED_SINCE:
            continue
        if key in old_name:
            out[old_name[key]] = value
        elif key.startswith("loss."):
            out.setdefault("loss", {})[key.removeprefix("loss.")] = value
        else:
            out[key] = value
    return out


def test_every_setting_has_one_place_and_every_old_key_a_new_one():
    dotted = {f"{key}.{f.name}" for key, cls in SECTIONS.items() for f in fields(cls)}
    assert set(MOVED.values()) == {name for name in dotted if not name.startswith("loss.")} - ADDED_SINCE
    assert len(set(MOVED.values())) == len(MOVED)
    top = {f.name for f in fields(TrainConfig)} - {attribute(key) for key in SECTIONS}
    assert not top & set(MOVED), "a moved key is still a top-level setting"
    assert set(flatten(TrainConfig().to_dict())) == dotted | top


def test_sections_check_their_own_values():
    with pytest.raises(OpdError, match="async.max_staleness must be >= 0"):
        AsyncConfig(max_staleness=-1)
    with pytest.raises(OpdError, match="unknown guard.action 'pause'"):
        GuardConfig(action="pause")
    with pytest.raises(OpdError, match=r"eval.fraction must be in \[0, 1\)"):
        EvalConfig(fraction=1.0)
    with pytest.raises(OpdError, match="async.worker_timeout must be a finite number"):
        AsyncConfig(worker_timeout=float("inf"))
    assert AsyncConfig(max_staleness=3).lookahead == 3 and AsyncConfig(max_staleness=3, prefetch=0).lookahead == 0


def test_what_spans_sections_is_checked_by_the_whole_config():
    with pytest.raises(OpdError, match="async needs more threads"):
        build_config({"schedule": "async", "threads": 1})
    with pytest.raises(OpdError, match="compute.micro_batch_size 3 does not divide batch_size 4"):
        build_config({"batch_size": 4, "compute": {"micro_batch_size": 3}})
    build_config({"threads": 1, "async": {"worker_threads": 1}})  # sync: the worker's threads are not used


def test_dotted_set_reaches_its_section_and_the_file_round_trips(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("schedule: async\nasync: {max_staleness: 1, recompute_fraction: 0.5}\noptim: {lr: 1.0e-3}\n")
    cfg = load_config(path, ["async.max_staleness=2", "optim.lr=3e-4", "guard.every=5"])
    assert (cfg.async_.max_staleness, cfg.async_.recompute_fraction, cfg.optim.lr, cfg.guard.every) == (2, 0.5, 3e-4, 5)
    saved = tmp_path / "saved.yaml"
    saved.write_text(dump_config(cfg))
    assert yaml.safe_load(saved.read_text())["async"]["max_staleness"] == 2  # the YAML key, not the attribute's
    assert load_config(saved) == cfg


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_key_is_refused_naming_its_new_one(old):
    value = TrainConfig().to_dict()[MOVED[old].split(".")[0]][MOVED[old].split(".")[1]]
    with pytest.raises(OpdError) as e:
        load_config(None, [f"{old}={json.dumps(value)}"])
    assert f"config key '{old}' is now '{MOVED[old]}'" in e.value.problem
    assert f"--set {MOVED[old]}=" in e.value.fix


def test_a_saved_config_from_before_the_sections_is_moved_not_refused(pair, tmp_path):
    """A run directory written by the release before the sections still reads, and resumes."""
    from opd.config.runlog import read_run_config
    from opd.training.trainer import train
    cfg = config(pair, steps=2, save_every=1, schedule="async", threads=2, async_=dict(max_staleness=1),
                 optim=dict(lr=3e-3), guard=dict(every=1, limit=100.0), sampling=dict(max_new_tokens=8))
    run = tmp_path / "run"
    train(cfg, run, progress=False)
    saved = read_run_config(run)  # resolved: the sampling settings the run took from the checkpoint
    old = old_layout(saved)
    assert "max_staleness" in old and "async" not in old and build_config(migrate(old)) == saved
    (run / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    assert read_run_config(run) == saved
    summary = train(config(pair, steps=3, save_every=1, schedule="async", threads=2, async_=dict(max_staleness=1),
                           optim=dict(lr=3e-3), guard=dict(every=1, limit=100.0), sampling=dict(max_new_tokens=8)),
                    run, resume=True, progress=False)
    assert summary["steps"] == 3


def test_a_results_line_from_before_the_sections_reads_in_todays_layout(tmp_path):
    from pathlib import Path
    from opd.study.sweep import read_results
    stored = Path(__file__).resolve().parents[1] / "studies" / "data" / "numerics_results.jsonl"
    row = json.loads(stored.read_text().splitlines()[0])
    (tmp_path / "results.jsonl").write_text(json.dumps(row | {"config": old_layout(build_config(row["config"]))}))
    read = read_results(tmp_path / "results.jsonl", warn=False)[0]["config"]
    assert set(read) <= set(TrainConfig().to_dict()) and build_config(read) == build_config(row["config"])


def test_the_ray_backend_settings_are_checked():
    with pytest.raises(OpdError, match="async.backend ray is the async schedule's"):
        build_config({"async": {"backend": "ray"}})
    with pytest.raises(OpdError, match="unknown async.backend 'mpi'"):
        build_config({"async": {"backend": "mpi"}})
    with pytest.raises(OpdError, match="sampling.shards 9 is more than batch_size 8"):
        build_config({"batch_size": 8, "sampling": {"shards": 9}})
    with pytest.raises(OpdError, match="ray.teacher needs the Ray backend"):
        build_config({"schedule": "async", "ray": {"teacher": True}})
    with pytest.raises(OpdError, match="ray.workers must be positive"):
        build_config({"ray": {"workers": 0}})
    cfg = build_config({"schedule": "async", "async": {"backend": "ray"}, "ray": {"workers": 3}})
    assert (cfg.rollout_workers, cfg.shards) == (3, 3)
    assert build_config({"sampling": {"shards": 2}}).shards == 2 and TrainConfig().shards == 1


def test_the_teacher_section_and_its_shorthand(tmp_path):
    """teacher: DIR is teacher.path, in a file, in --set (before or after teacher.* keys) and in Python; the keys
    from before the section are refused in a user's config and moved in a config opd stored."""
    from opd import make_config
    from opd.config.sections import TeacherConfig
    assert load_config(None, ["student=s", "teacher=t"]).teacher == TeacherConfig(path="t")
    for order in (["teacher.engine=builtin", "teacher=t"], ["teacher=t", "teacher.engine=builtin"]):
        assert load_config(None, ["student=s", *order]).teacher == TeacherConfig(path="t", engine="builtin")
    (tmp_path / "c.yaml").write_text("student: s\nteacher: t\n")
    assert load_config(tmp_path / "c.yaml", ["teacher.plan={0: kv=fp8_e4m3}", "teacher.engine=builtin"]).teacher == \
        TeacherConfig(path="t", engine="builtin", plan={0: "kv=fp8_e4m3"})
    assert make_config(student="s", teacher="t").teacher.path == "t"
    old = {"student": "s", "teacher": "t", "teacher_engine": "builtin", "teacher_plan": "kv=fp8_e4m3"}
    assert build_config(migrate(old)).teacher == TeacherConfig(path="t", engine="builtin", plan="kv=fp8_e4m3")
    with pytest.raises(OpdError, match="'teacher_engine' is now 'teacher.engine'"):
        build_config(old)
    with pytest.raises(OpdError, match="give both student and teacher"):
        build_config({"teacher": {"engine": "builtin", "plan": "kv=bf16"}, "student": "s"})
    assert TeacherConfig(topk=3).served and TeacherConfig(engine="vllm").served and not TeacherConfig().served


def test_the_config_and_the_devices_know_the_same_names():
    from opd.config import sections
    from opd.models import devices
    assert sections.DTYPE_NAMES == devices.DTYPE_NAMES == tuple(devices.DTYPES)
    for name in ("auto", "cpu", "cuda", "cuda:3", "gpu", "cuda:x", "", "CPU"):
        outcomes = []
        for check in (sections.check_name, devices.check_name):
            try:
                check(name)
                outcomes.append(True)
            except Exception:
                outcomes.append(False)
        assert outcomes[0] == outcomes[1], name
