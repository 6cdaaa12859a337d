"""Does the bias a candidate's rollouts put in the OPD gradient, against the recipe's own BF16 gradient noise, predict
a run's label on a pair it was not fitted on? (issue 57, candidate (a): measured on the model, no run trained.)

For one stored configuration (pair, estimator, recipe) and a candidate (a plan, weight noise, or staleness k), on the
student the run starts from (after k BF16 steps of the recipe for staleness k):

    g_i  the OPD gradient of batch i with BF16 rollouts, c_i the same batch (same prompts, same sampling seed: common
         random numbers) with the candidate's rollouts (for staleness: sampled by the student k steps earlier),
         i = 1..M;  d_i = c_i - g_i
    bias^2  = |mean d|^2 - var(d) / M      (unbiased: the coupling noise of d taken out)
    noise^2 = var(g)                        (the per-batch SGD noise of BF16 rollouts)
    z = sqrt(T / 2) * bias / noise          (T the run's steps: a bias drifts T steps the same way while the gap
                                             between two BF16 seeds grows as sqrt(2 T); learning rate cancels)

each in the raw gradient and in AdamW's coordinates (every coordinate over the root of its mean square over both
rollouts' gradients, the scale Adam divides by). The rule `degraded if z > c` takes its cut c from the other pairs
(leave one pair out), the cut with the most right decisions, an admitted run that degraded counting twice; each accuracy is printed beside
never-admit and always-admit on the same runs.

    python studies/gradient_bias.py --out studies/data/gradient_bias.jsonl          # the toy pairs' stored configs
    python studies/gradient_bias.py --quick                                         # one group, M = 4: seconds
    python studies/gradient_bias.py --report studies/data/gradient_bias.jsonl      # the accuracies, no model run

One JSON line per (study, pair, estimator, source, level) is appended to --out; one already there is not measured
again, so a stopped run resumes; a configuration that differs from one measured only in its learning rate and
schedule, with no staleness, reuses its numbers (`measured_as`): the initial student's gradients do not see them.
"""
import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import admission as bench  # noqa: E402 (the stored, labelled runs)

from opd.models.devices import restored_threads  # noqa: E402
from opd.study.sweep import stored_config  # noqa: E402
from opd.training.learner import Scoring, collate, score_batch  # noqa: E402
from opd.training.setup import setup  # noqa: E402
from opd.training.trainer import run_step  # noqa: E402

PAIRS = ("llama", "qwen3", "smollm2")


def gradient(run, index: int) -> torch.Tensor:
    """The OPD gradient (unclipped, flattened, float32) of prompt batch `index` sampled by the run's engine as it is."""
    sampled = run.rollouts.next_batch(index, run.state.version)
    return batch_gradient(run, collate(sampled.rollouts, run.tok.pad_id), sampled.engine_logprobs)


def batch_gradient(run, batch, engine_logprobs=None) -> torch.Tensor:
    """The OPD gradient (unclipped, flattened, float32) of the run's student on a batch of rollouts."""
    run.student.zero_grad(set_to_none=True)
    score_batch(run.student, batch, run.teacher, Scoring.of(run.cfg), engine_logprobs, backward=True)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in run.student.parameters()]
    out = torch.cat([g.reshape(-1).float() for g in grads])
    run.student.zero_grad(set_to_none=True)
    return out


@torch.no_grad()
def _move(params: list, flat: torch.Tensor) -> None:
    at = 0
    for p in params:
        p += flat[at:at + p.numel()].view_as(p).to(p.dtype)
        at += p.numel()


def curvature(cfg, batches: int) -> dict:
    """kappa: the share of the gradient that one step of the recipe removes, in Adam's coordinates. On M batches of
    rollouts (held fixed) at the initial student, with g their mean gradient and s the root mean square of theirs
    (Adam's denominator at steady state), the step -lr * g / s (Adam's, its momentum averaging ~10 batches; one batch's
    own gradient would measure how fast a step overfits that batch) changes the mean gradient to g', and

        kappa = (g - g') . (g / s) / g . (g / s)

    (on a quadratic: lr times the curvature along the preconditioned gradient). A bias b held T steps against a
    restoring rate kappa drifts (b / h)(1 - exp(-kappa T)) while two BF16 seeds part by sigma * lr *
    sqrt((1 - exp(-2 kappa T)) / kappa) (an Ornstein-Uhlenbeck process), so

        z_ou = (bias / noise) * (1 - exp(-kappa T)) / sqrt(kappa (1 - exp(-2 kappa T)))

    which is sqrt(T / 2) * bias / noise while kappa T is small and bias / (noise sqrt(kappa)) once the run has
    settled: how the learning rate enters. A heuristic past kappa ~ 1: on the llama pair's full_rkl recipe kappa is
    0.14, 1.08 and 4.0 at lr 3e-6, 3e-5 and 3e-4 (the recipe's), not linear in lr; Adam runs there at the edge of
    stability along these directions, where the quadratic picture no longer holds (dev/LOG.md)."""
    run = setup(replace(cfg, schedule="sync"))
    run.rollouts.start(run.student.state_dict(), 0, {})
    try:
        fixed = []
        for i in range(batches):
            sampled = run.rollouts.next_batch(1000 + i, 0)
            fixed.append(collate(sampled.rollouts, run.tok.pad_id))
        g0 = [batch_gradient(run, b) for b in fixed]
        scale = torch.stack(g0).pow(2).mean(0).sqrt() + 1e-8
        mean = torch.stack(g0).mean(0)
        step = -cfg.optim.lr * mean / scale  # Adam's step: its momentum averages ~1 / (1 - beta1) = 10 batches
        params = list(run.student.parameters())
        _move(params, step)
        moved = torch.stack([batch_gradient(run, b) for b in fixed]).mean(0)
        _move(params, -step)
        num = ((mean - moved).double() * (mean / scale).double()).sum().item()
        den = (mean.double() * (mean / scale).double()).sum().item()
    finally:
        run.rollouts.close()
    return {"kappa": num / den, "lr": cfg.optim.lr, "T": cfg.steps}


def z_ou(bias: float, noise: float, kappa: float, steps: int) -> float:
    """curvature()'s z: the bias's drift over the seeds' spread after `steps` steps at restoring rate kappa."""
    if kappa * steps < 1e-6:
        return math.sqrt(steps / 2) * bias / max(noise, 1e-30)
    k = max(kappa, 1e-12)
    return bias / max(noise, 1e-30) * (1 - math.exp(-k * steps)) / math.sqrt(k * (1 - math.exp(-2 * k * steps)))


def warmed_run(cfg, steps: int):
    """setup(cfg) (synchronous) after `steps` BF16 training steps of its recipe; -> (run, the initial weights)."""
    run = setup(replace(cfg, schedule="sync"))
    initial = {k: v.detach().clone() for k, v in run.student.state_dict().items()}
    run.rollouts.start(run.student.state_dict(), 0, {})
    for _ in range(steps):
        run_step(run)
    return run, initial


def stale_gradients(run, weights: dict, indices: list[int]) -> list[torch.Tensor]:
    """The gradients at the run's student of batches sampled by `weights` (an older student): staleness."""
    now = {k: v.detach().clone() for k, v in run.student.state_dict().items()}
    run.rollouts.publish(weights, 0)
    try:
        return [gradient(run, i) for i in indices]
    finally:
        run.rollouts.publish(now, run.state.version)


class Sums:
    """Per-coordinate running sums of g, g^2, c^2, d, d^2 (float64): every statistic is a sum over coordinates of
    these, so M gradients of a 100M-parameter student need five vectors, not 2M."""

    def __init__(self):
        self.M, self.sums = 0, None

    def add(self, g: torch.Tensor, c: torch.Tensor) -> None:
        g, d = g.double(), c.double() - g.double()
        if self.sums is None:
            self.sums = [torch.zeros_like(g) for _ in range(5)]
        for total, x in zip(self.sums, (g, g * g, (g + d) ** 2, d, d * d)):
            total += x
        self.M += 1

    def stats(self, steps: int) -> dict:
        """bias, noise and z (module docstring), raw and in AdamW's coordinates."""
        M, (sg, sgg, scc, sd, sdd) = self.M, self.sums
        # Adam's denominator, pooled over both rollouts' gradients (a coordinate only the candidate's rollouts reach,
        # an embedding row of a token BF16 never sampled, is not divided by ~0) plus AdamW's eps
        scale = ((sgg + scc) / (2 * M)).sqrt() + 1e-8
        out = {"M": M, "T": steps}
        for name, w in {"raw": torch.ones_like(scale), "adam": scale.pow(-2)}.items():
            var_d = ((sdd - sd * sd / M) * w).sum().item() / (M - 1)
            noise2 = ((sgg - sg * sg / M) * w).sum().item() / (M - 1)
            bias2 = ((sd / M).pow(2) * w).sum().item() - var_d / M
            bias, noise = math.sqrt(max(bias2, 0.0)), math.sqrt(max(noise2, 0.0))
            out |= {f"{name}_bias": bias, f"{name}_noise": noise, f"{name}_coupling": math.sqrt(max(var_d, 0.0)),
                    f"{name}_bias_se": math.sqrt(max(var_d, 0.0) / M),
                    f"{name}_z": math.sqrt(steps / 2) * bias / max(noise, 1e-30)}
        return out


def stats(ref: list[torch.Tensor], cand: list[torch.Tensor], steps: int) -> dict:
    """Sums.stats of paired lists of gradients."""
    sums = Sums()
    for g, c in zip(ref, cand):
        sums.add(g, c)
    return sums.stats(steps)


def measure(bf16_cfg, cand_cfg, staleness: int, batches: int) -> dict:
    """The candidate's stats on the recipe's initial student (after `staleness` BF16 steps for a stale candidate)."""
    run, initial = warmed_run(bf16_cfg, staleness)
    try:
        indices = [1000 + i for i in range(batches)]  # prompt batches the warm-up did not train on
        sums = Sums()
        if staleness:  # the candidate's rollouts come from the weights `staleness` versions back
            for i in indices:
                sums.add(gradient(run, i), stale_gradients(run, initial, [i])[0])
        else:
            cand_run = setup(replace(cand_cfg, schedule="sync", steps=bf16_cfg.steps))
            try:
                cand_run.student.load_state_dict(run.student.state_dict())
                cand_run.rollouts.start(cand_run.student.state_dict(), 0, {})
                for i in indices:
                    sums.add(gradient(run, i), gradient(cand_run, i))
            finally:
                cand_run.rollouts.close()
    finally:
        run.rollouts.close()
    return sums.stats(bf16_cfg.steps)


def signature(group: dict) -> str:
    """What a measurement depends on: both configs, less the learning rate and its schedule where nothing trains
    before the gradients (staleness 0: the initial student's gradients do not see them)."""
    def settings(row):
        cfg = json.loads(json.dumps(row["config"]))
        if not group["staleness"]:
            cfg["optim"] = {}
        return cfg
    return json.dumps([settings(group["bf16"]), settings(group["cand"])], sort_keys=True)


def groups(rows: list[dict], pairs: tuple) -> list[dict]:
    """One {key, bf16 row, candidate row, staleness, degraded share} per stored configuration with a BF16 run."""
    by: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["family"] in pairs:
            by.setdefault((r["study"], r["family"], r["estimator"]), []).append(r)
    out = []
    for (study, family, estimator), rs in sorted(by.items()):
        bf16 = sorted((r for r in rs if r["source"] == "bf16"), key=lambda r: r["seed"])
        if not bf16:
            continue
        points: dict[tuple, list[dict]] = {}
        for r in rs:
            if r["source"] != "bf16":
                points.setdefault((r["source"], str(r["level"])), []).append(r)
        for (source, level), prs in sorted(points.items()):
            prs.sort(key=lambda r: r["seed"])
            out.append({"key": f"{study}|{family}|{estimator}|{source}|{level}", "study": study, "pair": family,
                        "estimator": estimator, "source": source, "level": level, "bf16": bf16[0], "cand": prs[0],
                        "staleness": prs[0]["staleness"], "runs": len(prs),
                        "degraded": [bool(r["degraded"]) for r in prs]})
    return out


def read_lines(path: Path | None) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path and path.is_file() else []


def recipe(key: str) -> str:
    return "|".join(key.split("|")[:3])  # study|pair|estimator: one learning rate, horizon and batch


def report(lines: list[dict], kappas: dict | None = None) -> dict:
    """Leave one pair out: the cut on z from the other pairs, accuracy on the held-out pair's runs (each stored run
    one decision) beside never-admit and always-admit. Modes: raw and adam (z = sqrt(T / 2) bias / noise in that
    space), ou (z_ou: Adam's space, carried by the recipe's kappa; the lines whose recipe has one)."""
    kappas = kappas or {}
    for x in lines:
        k = kappas.get(recipe(x["key"]))
        if k is not None:
            x["ou_z"] = z_ou(x["adam_bias"], x["adam_noise"], k["kappa"], x["T"])
    modes = ("raw", "adam", "ou") if kappas else ("raw", "adam")
    runs = [{"pair": x["pair"], "degraded": d, "z": x[f"{mode}_z"], "mode": mode}
            for x in lines for d in x["degraded"] for mode in modes if f"{mode}_z" in x]
    result = {}
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        for pair in sorted({r["pair"] for r in mine}):
            train, test = [r for r in mine if r["pair"] != pair], [r for r in mine if r["pair"] == pair]
            if not train:
                continue
            score = lambda c, rs: sum((r["z"] > c) == r["degraded"] for r in rs) - sum(  # noqa: E731
                r["z"] <= c and r["degraded"] for r in rs)
            cut = max(sorted({r["z"] for r in train} | {0.0}), key=lambda c: score(c, train))
            n, bad = len(test), sum(r["degraded"] for r in test)
            acc = sum((r["z"] > cut) == r["degraded"] for r in test) / n
            adm_deg = sum(r["z"] <= cut and r["degraded"] for r in test) / n
            print(f"{mode:4} held out {pair:8} ({n:3} runs) z > {cut:8.3g}: accuracy {acc:.3f}, admitted and degraded "
                  f"{adm_deg:.3f} | never-admit {bad / n:.3f}, always-admit {1 - bad / n:.3f}")
            result[f"{mode}_accuracy_{pair}"] = acc
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="", help="append one line per configuration here (resumes)")
    parser.add_argument("--pairs", default="llama,qwen3", help="comma-separated pairs to measure")
    parser.add_argument("--batches", type=int, default=8, help="M: batches per plan")
    parser.add_argument("--report", default="", help="only print the accuracies of this file's lines")
    parser.add_argument("--quick", action="store_true", help="one configuration, M = 4, nothing written")
    parser.add_argument("--kappa", default="", help="measure each recipe's kappa (curvature()) into this file "
                        "(resumes), or, with --report, read them from it")
    args = parser.parse_args()
    kappa_file = Path(args.kappa) if args.kappa else None
    kappas = {x["recipe"]: x for x in read_lines(kappa_file)} if kappa_file else {}
    if args.report:
        result = report(read_lines(Path(args.report)), kappas)
        print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in result.items()))
        return
    todo = groups(bench.stored_rows(), tuple(args.pairs.split(",")))
    if kappa_file:
        recipes = {recipe(g["key"]): g for g in todo if recipe(g["key"]) not in kappas}
        with restored_threads():
            for n, (name, g) in enumerate(sorted(recipes.items())):
                start = time.perf_counter()
                line = {"recipe": name} | curvature(stored_config(g["bf16"]), args.batches) | {
                    "seconds": time.perf_counter() - start}
                print(f"[{n + 1}/{len(recipes)}] {name}: kappa {line['kappa']:.3g} at lr {line['lr']:g}, "
                      f"T {line['T']} ({line['seconds']:.0f} s)", flush=True)
                with kappa_file.open("a") as f:
                    f.write(json.dumps(line) + "\n")
        return
    out = Path(args.out) if args.out else None
    done = {}
    if out and out.is_file():
        done = {json.loads(x)["key"]: json.loads(x) for x in out.read_text().splitlines() if x.strip()}
    if args.quick:
        todo, args.batches = [g for g in todo if g["source"] == "kv"][:1], 4
    by_signature = {signature(g): done[g["key"]] for g in todo if g["key"] in done}
    todo = [g for g in todo if g["key"] not in done]
    lines = []
    with restored_threads():
        for n, g in enumerate(todo):
            start = time.perf_counter()
            same = by_signature.get(signature(g))
            if same is not None:  # the same measurement under another learning rate (module docstring)
                numbers = {k: v for k, v in same.items() if k.split("_")[0] in ("raw", "adam") or k in ("M", "T")}
                numbers["measured_as"] = same["key"]
            else:
                numbers = measure(stored_config(g["bf16"]), stored_config(g["cand"]), g["staleness"], args.batches)
            line = {k: v for k, v in g.items() if k not in ("bf16", "cand")} | numbers | {
                "seconds": time.perf_counter() - start}
            lines.append(line)
            by_signature.setdefault(signature(g), line)
            print(f"[{n + 1}/{len(todo)}] {g['key']}: z raw {numbers['raw_z']:.3g} adam {numbers['adam_z']:.3g} "
                  f"degraded {sum(g['degraded'])}/{g['runs']} ({line['seconds']:.0f} s)", flush=True)
            if out:
                with out.open("a") as f:
                    f.write(json.dumps(line) + "\n")
    if out and not args.quick:
        lines = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
    result = report(lines) if len({x["pair"] for x in lines}) > 1 else {}
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in result.items()) if result else
          f"RESULT configurations={len(lines)}")


if __name__ == "__main__":
    main()
