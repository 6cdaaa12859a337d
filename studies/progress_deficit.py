"""Does the share of the BF16 descent a candidate's rollouts lose predict a run's label? (issue 57, candidate (a'):
the gradient bias of candidate (a) projected on the one direction that moves quality.)

Candidate (a) (opd/admission/bias.py) compares the whole bias vector with the whole SGD noise vector; on the far
real pair its bias estimates sat inside their own standard errors (M = 4: se 4,000 against biases of 500-2,000 in
Adam's units) and decided no better than the trivial rules. Most of that vector moves nothing the labels measure:
noise in directions orthogonal to the descent changes the loss only at second order, a bias along it at first order.
So here, from the same M pairs (g_i BF16, c_i candidate, common random numbers; d_i = c_i - g_i), cross-fitted
(each batch projected on the mean BF16 gradient of the other batches, h_-i, so that no batch meets itself):

    p_i = h_-i . W g_i        the progress a BF16 step makes along the descent (W: 1 raw; 1/s adam, s the root
    q_i = h_-i . W d_i        mean square of both rollouts' gradients: Adam's step is -lr c / s)
    r  = -mean(q) / mean(p)   the share of a BF16 step's progress the candidate loses (negative: gains)
    z  = sqrt(T / 2) * -mean(q) / std(p)   its drift over T steps against the BF16 seeds' spread along h

each with its standard error from the batches' spread. The rule `degraded if stat > c` takes c from the other pairs
(leave one pair out); each accuracy beside never-admit and always-admit on the same runs, per recipe too.

    python studies/progress_deficit.py --pairs smollm2 --estimators full_rkl --out studies/data/progress_smollm2.jsonl
    python studies/progress_deficit.py --out studies/data/progress_toys.jsonl --estimators full_rkl
    python studies/progress_deficit.py --report studies/data/progress_toys.jsonl,studies/data/progress_smollm2.jsonl

One JSON line per configuration, appended (resumes); a synchronous configuration that differs from a measured one
only in its learning rate reuses its numbers (the initial student's gradients do not see it).
"""
import argparse
import json
import math
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import admission as bench  # noqa: E402 (the stored, labelled runs)
from gradient_bias import groups, read_lines, recipe, signature  # noqa: E402
from paired_trial import held_out  # noqa: E402

from opd.admission.bias import measure  # noqa: E402
from opd.models.devices import restored_threads  # noqa: E402
from opd.study.sweep import read_results, stored_config  # noqa: E402
from opd.study.tolerance import label, latest  # noqa: E402

STATS = ("adam_r", "adam_zp", "raw_r", "raw_zp", "adam_u", "raw_u", "adam_absr", "raw_absr", "z_adam_z")
# (a line without a statistic, an Online one's raw_*, is left out of that statistic's report)


class Pairs:
    """Keeps every (g_i, c_i) (float32): the cross-fitted projections need each batch against the others' mean."""

    def __init__(self):
        self.g, self.c = [], []

    def add(self, g: torch.Tensor, c: torch.Tensor) -> None:
        self.g.append(g.float().clone())
        self.c.append(c.float().clone())

    def stats(self, steps: int) -> dict:
        """The projections, and candidate (a)'s z on the same pairs (drift.stats: its bias, noise and z)."""
        from opd.health import drift
        z = {f"z_{k}": v for k, v in drift.stats(self.g, self.c, steps).items() if k.split("_")[0] in ("raw", "adam")
             and k.split("_")[1] != "r"}
        return projections(self.g, self.c, steps) | z


def dot64(a: torch.Tensor, b: torch.Tensor, chunk: int = 1 << 24) -> float:
    """a . b summed in float64, a chunk at a time (no float64 copy of a 500M-parameter vector)."""
    return sum(torch.dot(a[i:i + chunk].double(), b[i:i + chunk].double()).item() for i in range(0, a.numel(), chunk))


class Online:
    """drift.Sums' online progress share in two float32 vectors (8 bytes a parameter, for a student that does not fit
    Pairs or Sums in memory): each pair on the mean BF16 gradient of the pairs before it, in Adam's coordinates with
    their scale. Tested against Sums (tests/test_study.py)."""

    def __init__(self):
        self.total, self.sq, self.M, self.proj = None, None, 0, []

    def add(self, g: torch.Tensor, c: torch.Tensor) -> None:
        g, c = g.float(), c.float()
        if self.M:
            h = self.sq.div(2 * self.M).sqrt_().add_(1e-8).reciprocal_().mul_(self.total).div_(self.M)
            pg, pc = dot64(h, g), dot64(h, c)
            self.proj.append((pg, pc - pg))
            del h
        if self.total is None:
            self.total, self.sq = torch.zeros_like(g), torch.zeros_like(g)
        self.total += g
        self.sq.addcmul_(g, g).addcmul_(c, c)
        self.M += 1

    def stats(self, steps: int) -> dict:
        return projected(self.proj, self.M, steps)


def projected(proj: list[tuple[float, float]], M: int, steps: int) -> dict:
    """The online statistic's numbers (Online, Spilled) from its projections (p_i, q_i) of M pairs, in the lines'
    names."""
    n = len(proj)
    p = sum(x for x, _ in proj) / n
    q = [y for _, y in proj]
    mq = sum(q) / n
    se = math.sqrt(sum((y - mq) ** 2 for y in q) / (n - 1) / n)
    sd_p = math.sqrt(sum((x - p) ** 2 for x, _ in proj) / (n - 1))
    return {"M": M, "T": steps, "online": True, "adam_progress": p, "adam_deficit": -mq,
            "adam_deficit_se": se, "adam_progress_sd": sd_p, "adam_r": -mq / max(abs(p), 1e-30),
            "adam_r_se": se / max(abs(p), 1e-30), "adam_zp": math.sqrt(steps / 2) * -mq / max(sd_p, 1e-30),
            "adam_zp_se": math.sqrt(steps / 2) * se / max(sd_p, 1e-30), "adam_cos": math.nan}


class Spilled:
    """drift.Sums itself, its sums in files in `folder` (`opd admit --self --spill`): candidate (a)'s exact z and the
    progress share r in one pass, for a student whose sums do not fit in memory (the close pair's 0.5B student)."""

    def __init__(self, folder: str):
        from opd.health.drift import Sums
        self.sums = Sums(spill=folder)

    def add(self, g: torch.Tensor, c: torch.Tensor) -> None:
        self.sums.add(g, c)

    def stats(self, steps: int) -> dict:
        z = {f"z_{k}": v for k, v in self.sums.stats(steps).items() if k.split("_")[0] in ("raw", "adam")}
        return projected(self.sums.projections, self.sums.M, steps) | z


def projections(g: list[torch.Tensor], c: list[torch.Tensor], steps: int) -> dict:
    """The module docstring's r and z, raw and in Adam's coordinates, with standard errors, from M paired flat
    gradients (one batch at a time: a few vectors the student's size, not [M, n] temporaries)."""
    M = len(g)
    # float32 vectors, float64 sums: on a 100M-parameter student each vector is 400 MB
    total, total_c, sq = torch.zeros_like(g[0]), torch.zeros_like(g[0]), torch.zeros_like(g[0])
    for gi, ci in zip(g, c):
        total += gi
        total_c += ci
        sq.addcmul_(gi, gi).addcmul_(ci, ci)
    scale = sq.div_(2 * M).sqrt_().add_(1e-8)
    out = {"M": M, "T": steps}
    for name, w in {"raw": None, "adam": scale.reciprocal()}.items():
        p, q = [], []
        for gi, ci in zip(g, c):
            hw = (total - gi).div_(M - 1)  # each batch's direction from the others
            if w is not None:
                hw.mul_(w)
            p.append(torch.dot(hw.double(), gi.double()).item())
            q.append((torch.dot(hw.double(), ci.double()) - torch.dot(hw.double(), gi.double())).item())
            del hw
        p, q = torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64)
        P, D = p.mean().item(), q.mean().item()
        se_q, sd_p = q.std().item() / math.sqrt(M), p.std().item()
        wg = total if w is None else total * w
        cos = (torch.dot(wg.double(), total_c.double()) / (torch.dot(wg.double(), total.double()) * torch.dot(
            (total_c if w is None else total_c * w).double(), total_c.double())).sqrt()).item()
        del wg
        out |= {f"{name}_progress": P, f"{name}_deficit": -D, f"{name}_deficit_se": se_q,
                f"{name}_progress_sd": sd_p, f"{name}_r": -D / max(abs(P), 1e-30),
                f"{name}_r_se": se_q / max(abs(P), 1e-30),
                f"{name}_zp": math.sqrt(steps / 2) * -D / max(sd_p, 1e-30),
                f"{name}_zp_se": math.sqrt(steps / 2) * se_q / max(sd_p, 1e-30), f"{name}_cos": cos}
    return out


def spreads(trials: list[dict], step: str = "4") -> dict:
    """Per recipe, s: the BF16 seeds' mean |held-out reverse KL - the twin's| at `step` over the twin's change from
    step 0 (paired_trial.py's lines; the twin is seed 0): how far this recipe's own seeds part, relative to how far
    it moves, in its first steps."""
    out = {}
    for recipe_ in {x["recipe"] for x in trials}:
        seeds = {x["seed"]: x["evals"] for x in trials if x["recipe"] == recipe_ and x["source"] == "bf16"
                 and step in x["evals"] and "0" in x["evals"]}
        if 0 not in seeds or len(seeds) < 2:
            continue
        twin = seeds[0]
        gap = sum(abs(e[step]["rkl"] - twin[step]["rkl"]) for s, e in seeds.items() if s) / (len(seeds) - 1)
        out[recipe_] = gap / max(abs(twin["0"]["rkl"] - twin[step]["rkl"]), 1e-12)
    return out


def report(lines: list[dict]) -> dict:
    """Leave one pair out per statistic (the cut with the most right decisions on the other pairs, an admitted run
    that degraded counting twice), then per recipe of the held-out pair; beside the trivial rules."""
    for x in lines:  # two-sided: a candidate that moves further along the descent than BF16 is biased too
        x |= {f"{m}_absr": abs(x[f"{m}_r"]) for m in ("adam", "raw") if f"{m}_r" in x}
    result = {}
    for stat in STATS:
        runs = [{"pair": x["pair"], "recipe": recipe(x["key"]), "degraded": d, "s": x[stat]}
                for x in lines if stat in x for d in x["degraded"]]
        for pair in sorted({r["pair"] for r in runs}):
            test = [r for r in runs if r["pair"] == pair]
            if len(test) == len(runs):
                continue
            cut = held_out(runs, pair, "s")["cut"]  # paired_trial's leave-one-pair-out cut
            for name in ["all"] + sorted({r["recipe"] for r in test}):
                mine = test if name == "all" else [r for r in test if r["recipe"] == name]
                n, bad = len(mine), sum(r["degraded"] for r in mine)
                acc = sum((r["s"] > cut) == r["degraded"] for r in mine) / n
                unsafe = sum(r["s"] <= cut and r["degraded"] for r in mine) / n
                print(f"{stat:8} held out {pair:8} {name:36} ({n:3} runs) > {cut:8.3g}: accuracy {acc:.3f}, "
                      f"admitted and degraded {unsafe:.3f} | never-admit {bad / n:.3f}, always-admit {1 - bad / n:.3f}")
                if name == "all":
                    result[f"{stat}_{pair}"] = acc
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="", help="append one line per configuration here (resumes)")
    parser.add_argument("--pairs", default="llama,qwen3", help="comma-separated pairs to measure")
    parser.add_argument("--estimators", default="", help="comma-separated estimators (default: all)")
    parser.add_argument("--threads", type=int, default=1, help="threads per measurement")
    parser.add_argument("--batches", type=int, default=8, help="M: batches per configuration")
    parser.add_argument("--sync-only", action="store_true", help="no staleness configurations")
    parser.add_argument("--warm", type=int, default=0, help="measure synchronous configurations at the student after "
                        "this many BF16 steps of their recipe (its learning rate: no reuse across rates)")
    parser.add_argument("--study", action="append", default=[], metavar="NAME=FILE",
                        help="a stored grid's results (studies/data/FILE) as one more study, e.g. "
                        "'real qwen2.5-coder lr 1e-5=qwen1e5_results.jsonl' (the close pair's grid)")
    parser.add_argument("--online", action="store_true", help="the two-vector online statistic (Online), Adam's "
                        "units only: for a student whose M gradients do not fit in memory")
    parser.add_argument("--spill", default="", metavar="DIR", help="drift.Sums with its sums in files in DIR "
                        "(Spilled): z and r exactly, for a student whose sums do not fit in memory")
    parser.add_argument("--only", default="", help="comma-separated source=level (and study=NAME) filters")
    parser.add_argument("--report", default="", help="only print the accuracies of these files' lines")
    parser.add_argument("--trials", default="", help="with --report: paired_trial.py lines (comma-separated files) "
                        "whose BF16 seeds give each recipe's spread s, for u = r / s")
    args = parser.parse_args()
    if args.report:
        lines = [x for f in args.report.split(",") for x in read_lines(Path(f))]
        if args.trials:
            s = spreads([x for f in args.trials.split(",") for x in read_lines(Path(f))])
            for x in lines:
                if recipe(x["key"]) in s:
                    x |= {"spread": s[recipe(x["key"])]} | {f"{m}_u": x[f"{m}_r"] / s[recipe(x["key"])]
                                                           for m in ("adam", "raw")}
            print("relative BF16 spread after 4 steps: " + ", ".join(f"{k} {v:.3g}" for k, v in sorted(s.items())))
        result = report(lines)
        print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in result.items()))
        return
    rows = bench.stored_rows()
    for item in args.study:
        name, file = item.split("=", 1)
        rows += [r | {"study": name, "new": True}
                 for r in label(latest(read_results(bench.DATA / file))) if r["degraded"] is not None]
    todo = groups(rows, tuple(args.pairs.split(",")))
    if args.estimators:
        todo = [g for g in todo if g["estimator"] in args.estimators.split(",")]
    if args.sync_only or args.warm:
        todo = [g for g in todo if not g["staleness"]]
    for item in [x for x in args.only.split(",") if x]:
        key, value = item.split("=", 1)
        if key == "study":
            todo = [g for g in todo if g["study"] == value]
    levels = [x for x in args.only.split(",") if x and not x.startswith("study=")]
    if levels:
        todo = [g for g in todo if f"{g['source']}={g['level']}" in levels]
    out = Path(args.out)
    done = {x["key"]: x for x in read_lines(out)}
    by_signature = {signature(g): done[g["key"]] for g in todo if g["key"] in done}
    todo = sorted((g for g in todo if g["key"] not in done), key=lambda g: g["staleness"] > 0)
    with restored_threads():
        for n, g in enumerate(todo):
            start = time.perf_counter()
            same = None if args.warm else by_signature.get(signature(g))
            if same is not None:
                numbers = {k: v for k, v in same.items() if k.split("_")[0] in ("raw", "adam") or k in ("M", "T")}
                numbers["measured_as"] = same["key"]
            else:
                # (the staleness travels apart: measure() warms a synchronous run; one thread takes no async)
                bf16, cand = (replace(stored_config(g[k]), threads=args.threads, schedule="sync")
                              for k in ("bf16", "cand"))
                with tempfile.TemporaryDirectory(dir=args.spill, prefix="opd-sums-") if args.spill \
                        else nullcontext() as folder:
                    sums = Spilled(folder) if args.spill else Online() if args.online else Pairs()
                    numbers = measure(bf16, cand, g["staleness"], args.batches, sums=sums, warm=args.warm) | (
                        {"warm": args.warm} if args.warm else {})
                    del sums
            line = {k: v for k, v in g.items() if k not in ("bf16", "cand")} | numbers | {
                "seconds": time.perf_counter() - start}
            by_signature.setdefault(signature(g), line)
            print(f"[{n + 1}/{len(todo)}] {g['key']}: r adam {numbers['adam_r']:.3g} +- {numbers['adam_r_se']:.2g}, "
                  f"zp adam {numbers['adam_zp']:.3g}, z adam {numbers.get('z_adam_z', math.nan):.3g}, degraded "
                  f"{sum(g['degraded'])}/{g['runs']} ({line['seconds']:.0f} s)", flush=True)
            with out.open("a") as f:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
