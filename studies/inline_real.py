"""Does async.backend inline equal the worker process on a real pair? The smollm2 pair, staleness 2, an FP8 e4m3 cache,
a bf16 learner: every metric but timing (tests/helpers.py `comparable`), 4 steps of 4 rollouts x 24 tokens, ~2 minutes.

    python studies/inline_real.py      # the version gaps, the staleness and numerics KLs, then "equal True" or False
"""
import shutil
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from opd import make_config
from opd.training.trainer import train
from opd.config.runlog import read_metrics
from helpers import comparable

if __name__ == "__main__":
    out = Path("/tmp/inline_real")
    shutil.rmtree(out, ignore_errors=True)
    base = dict(family="smollm2", steps=4, batch_size=4, sampling=dict(max_new_tokens=24), save_every=0,
                eval=dict(every=0, examples=4), plan="forward=bf16 kv=fp8_e4m3", optim=dict(lr=1e-4),
                compute=dict(dtype="bf16", teacher_dtype="bf16"), schedule="async")
    train(make_config(**base, threads=2, async_=dict(max_staleness=2)), out / "process", progress=False)
    train(make_config(**base, threads=1, async_=dict(max_staleness=2, backend="inline")), out / "inline", progress=False)
    p, i = read_metrics(out / "process"), read_metrics(out / "inline")
    print("gaps", [r.get("stale/version_gap_max") for r in i])
    print("upd_kl_k3", [r.get("stale/upd_kl_k3") for r in i])
    print("kl_exact", [r.get("mismatch/kl_exact") for r in i])
    print("equal", comparable(p) == comparable(i))
    if comparable(p) != comparable(i):
        for a, b in zip(comparable(p), comparable(i)):
            print({k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)})
