"""Which held-out quality does BF16 OPD improve on the close pair? (issue 55; issue 57's labels rest on it)

The close pair's grid (studies/data/qwen_grid_lr1e5.yaml) labels its runs by the reverse KL on FIXED contexts: the
16 held-out completions the step-0 student sampled, scored exactly at every evaluation. On that pair BF16 OPD itself
raises the number (0.074 at step 0, 0.098-0.146 at step 12), and a run that trains on garbage rollouts (weight noise
0.5, 2.3 nats/token) moves it least and scores best: the metric cannot show a degraded run. This study scores saved
weights (the base student and runs' final checkpoints) on four held-out qualities, each per sequence so that two
weights compare pairwise, on the same held-out prompts:

- `fixed`: the reverse KL and exact entropy on the stored fixed contexts (the grid's metric), also per position
  band, so that the rise can be located;
- `teacher`: the same on completions the TEACHER sampled (temperature 1, one seed, kept in a file and shared by
  every weights): the student where the teacher goes, plus the student's cross-entropy of the teacher's tokens;
- `greedy`: on the weights' own greedy completions (deterministic: no sampling noise, but the contexts move with
  the weights);
- `sampled`: on `--samples` completions per prompt sampled by the weights at temperature 1 (the on-policy reverse
  KL that OPD minimizes), one seed for every weights (common random numbers).

    python studies/close_metric.py --results studies/data/qwen1e5_results.jsonl \
        --contexts studies/data/qwen1e5_contexts/41d88ad658556e83.json \
        --weights base=student bf16s0=/work/runs/qmetric/runs/<id>/checkpoint ... \
        --samples 4 --teacher-contexts /work/runs/qmetric/teacher_contexts.json --out studies/data/close_metric.jsonl
    python studies/close_metric.py --report studies/data/close_metric.jsonl

The report prints each weights' value per quality and its difference from the first weights (`base`) with the
standard error of the per-prompt paired difference (prompts are the unit: 16 held-out problems).
"""
import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from opd.config.run import resolve_generation
from opd.engines.builtin import Engine
from opd.engines.sampling import SamplingParams
from opd.io.errors import OpdError, require
from opd.models.checkpoint import load_model
from opd.models.devices import autocast_dtype
from opd.training.evaluate import load_contexts, sampled_contexts, save_contexts
from opd.training.learner import Scoring, collate, score_batch
from opd.training.setup import load_pair, with_pair_defaults
from opd.training.teacher import LocalTeacher
from opd.data.prompts import PromptFormat, PromptSet, read_prompts
from opd.study.sweep import read_results, stored_config

BANDS = ((0, 32), (32, 128), (128, 10**9))  # positions of a completion, for locating a change in `fixed`
QUALITIES = ("fixed", "teacher", "greedy", "sampled")


def per_sequence(student, teacher, rollouts, pad_id: int, autocast, temperature: float = 1.0) -> list[dict]:
    """Each rollout's sums at its completion positions: exact reverse KL to the teacher, exact entropy, -log p of the
    sampled token (cross-entropy of the context's tokens under the student), tokens, and the reverse KL per position
    band (BANDS)."""
    out = []
    how = Scoring(temperature=temperature, micro_batch_size=1, autocast=autocast)
    for r in rollouts:
        batch = collate([r], pad_id)
        scores = score_batch(student, batch, teacher, how)
        mask = batch.mask[0].bool()
        rkl, surprise = scores.rkl[0][mask].double(), -scores.pi[0][mask].double()
        entropy = scores.terms["entropy"].double()
        at = torch.arange(len(rkl))
        out.append({"tokens": len(rkl), "rkl": rkl.sum().item(), "entropy": entropy.sum().item(),
                    "ce": surprise.sum().item(), "stop": r.finish_reason == "stop",
                    "bands": [[rkl[(at >= lo) & (at < hi)].sum().item(), int(((at >= lo) & (at < hi)).sum())]
                              for lo, hi in BANDS]})
    return out


def setup_pair(results: Path, which: str = "held_out", count: int = 0):
    """The grid's pair, prompts and precision, from its first stored result line. which: "held_out" (the grid's
    evaluation prompts) or "trained" (the first `count` distinct prompts that line's run trained on, in step order:
    every run of that seed trained on them, whatever its mismatch)."""
    rows = read_results(results)
    require(bool(rows), f"{results}: no result lines", "give a sweep's results.jsonl")
    cfg = with_pair_defaults(stored_config(rows[0]))
    student, teacher, tok, student_dir = load_pair(cfg)
    cfg = resolve_generation(cfg, tok.generation)
    prompts = PromptSet(cfg, tok, min(student.cfg.context, teacher.cfg.context), cfg.new_tokens)
    if which == "held_out":
        return cfg, student, teacher, tok, student_dir, prompts.held_out
    require(prompts.train is not None, "--prompts trained needs a grid on a prompt file", "use --prompts held_out")
    by_ids = {tuple(tok.encode_prompt(ex.prompt)): ex
              for ex in read_prompts(cfg.data.prompts, PromptFormat(cfg.data.prompt_key, cfg.data.answer_key,
                                                                    cfg.data.chat), tok)}
    seen = list(dict.fromkeys(tuple(ids) for step in range(cfg.steps) for ids in prompts.batch(step)))
    return cfg, student, teacher, tok, student_dir, [by_ids[ids] for ids in seen[:count or len(seen)]]


def measure(cfg, teacher_model, tok, examples, weights: dict, contexts: list, teacher_contexts: list, samples: int,
            seed: int, progress=print, qualities=QUALITIES, suffix: str = "") -> list[dict]:
    """One line per (weights, quality): {"weights", "quality" (+ suffix: "@trained" on the prompts a run trained
    on), "prompt" per sequence (its index in examples), "seqs": per_sequence's}."""
    teacher, autocast = LocalTeacher(teacher_model), autocast_dtype(cfg.compute.dtype)
    params = SamplingParams(cfg.new_tokens, **cfg.sampling.params())  # the run's (temperature 1, no truncation)
    greedy = replace(params, temperature=0.0)
    plan = "forward=bf16 kv=bf16" if autocast == torch.bfloat16 else ""
    index = {tuple(tok.encode_prompt(ex.prompt)): i for i, ex in enumerate(examples)}
    prompt_of = lambda rollouts: [index[tuple(r.prompt_ids)] for r in rollouts]  # noqa: E731
    lines = []
    for name, model in weights.items():
        start = time.perf_counter()
        model = model if isinstance(model, torch.nn.Module) else model()  # a loader: one checkpoint in memory at a time
        runs = {"fixed": contexts, "teacher": teacher_contexts}
        if "greedy" in qualities:
            engine = Engine(model, tok.stop_ids, tok.pad_id, plan, bf16_gemm="auto")
            runs["greedy"] = engine.generate([tok.encode_prompt(ex.prompt) for ex in examples], greedy, 0)
        if "sampled" in qualities:
            repeated = [ex for ex in examples for _ in range(samples)]  # the trainer's eval.samples order
            runs["sampled"] = sampled_contexts(model, tok, repeated, params, seed, autocast=autocast)
        runs = {q: runs[q] for q in qualities}
        for quality, rollouts in runs.items():
            lines.append({"weights": name, "quality": quality + suffix, "prompt": prompt_of(rollouts),
                          "seqs": per_sequence(model, teacher, rollouts, tok.pad_id, autocast,
                                               params.temperature or 1.0)})
        progress(f"close_metric: {name} measured in {time.perf_counter() - start:.0f} s")
        del model
    return lines


def pooled(seqs: list[dict], key: str = "rkl") -> float:
    return sum(s[key] for s in seqs) / max(1, sum(s["tokens"] for s in seqs))


def by_prompt(line: dict, key: str = "rkl") -> dict:
    """Per prompt: its sequences' token-pooled mean of `key`."""
    groups = {}
    for p, s in zip(line["prompt"], line["seqs"]):
        groups.setdefault(p, []).append(s)
    return {p: pooled(g, key) for p, g in groups.items()}


def paired(a: dict, b: dict) -> tuple[float, float]:
    """(mean, standard error) of b - a over the prompts both have (per-prompt means)."""
    diffs = [b[p] - a[p] for p in a if p in b]
    n = len(diffs)
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1) if n > 1 else float("nan")
    return mean, math.sqrt(var / n)


def report(lines: list[dict]) -> str:
    names = list(dict.fromkeys(line["weights"] for line in lines))
    qualities = list(dict.fromkeys(line["quality"] for line in lines))
    at = {(line["weights"], line["quality"]): line for line in lines}
    out = [f"weights: {', '.join(names)}; each value pooled over tokens; in brackets the mean over prompts of the "
           f"per-prompt difference from {names[0]} (every prompt weighing alike: its sign can differ from the pooled "
           "values') and its standard error"]
    for q in qualities:
        keys = ("rkl", "entropy") + (("ce",) if q == "teacher" else ())
        for key in keys:
            cells = []
            for name in names:
                line = at.get((name, q))
                if line is None:
                    cells.append(f"{name} -")
                    continue
                cell = f"{name} {pooled(line['seqs'], key):.4f}"
                if name != names[0] and (names[0], q) in at:
                    d, se = paired(by_prompt(at[names[0], q], key), by_prompt(line, key))
                    cell += f" ({d:+.4f} +- {se:.4f})"
                cells.append(cell)
            n = len(at[names[0], q]["seqs"]) if (names[0], q) in at else 0
            out.append(f"{q:8s} {key:8s} [{n} seqs] " + " | ".join(cells))
        if q == "fixed":
            for b, (lo, hi) in enumerate(BANDS):
                cells = []
                for name in names:
                    seqs = at[name, q]["seqs"]
                    total, count = sum(s["bands"][b][0] for s in seqs), sum(s["bands"][b][1] for s in seqs)
                    cells.append(f"{name} {total / max(1, count):.4f}")
                out.append(f"{q:8s} pos {lo}-{min(hi, 9999)} [{count} tokens] " + " | ".join(cells))
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, help="the grid's results.jsonl (its first line gives the pair and prompts)")
    ap.add_argument("--contexts", type=Path, help="the grid's fixed evaluation contexts (eval_contexts.json)")
    ap.add_argument("--weights", nargs="+", default=[], help="name=folder ...; folder 'student': the pair's student")
    ap.add_argument("--samples", type=int, default=4, help="on-policy completions per held-out prompt")
    ap.add_argument("--seed", type=int, default=2000, help="the sampling seed (the same for every weights)")
    ap.add_argument("--teacher-contexts", type=Path, help="the teacher's completions: sampled once into this file")
    ap.add_argument("--out", type=Path, help="JSONL lines appended per (weights, quality)")
    ap.add_argument("--prompts", choices=("held_out", "trained"), default="held_out",
                    help="trained: the prompts the grid's first run trained on (greedy and sampled qualities only)")
    ap.add_argument("--examples", type=int, default=32, help="under --prompts trained: how many of them")
    ap.add_argument("--qualities", default=",".join(QUALITIES), help="a comma list of " + ", ".join(QUALITIES))
    ap.add_argument("--report", type=Path, help="print the report of a file of lines")
    args = ap.parse_args(argv)
    try:
        if args.report:
            print(report([json.loads(s) for s in args.report.read_text().splitlines() if s.strip()]))
            return 0
        require(args.results and args.weights and args.out and args.teacher_contexts,
                "--results, --weights, --teacher-contexts and --out are needed", "see --help")
        require(args.samples >= 1, f"--samples must be at least 1, got {args.samples}", "give 1 or more")
        pairs = [w.split("=", 1) for w in args.weights]
        require(all(len(p) == 2 for p in pairs), f"--weights takes name=folder, got {args.weights}",
                "e.g. base=student run=runs/x/checkpoint")
        qualities = tuple(q for q in args.qualities.split(",") if q)
        require(bool(qualities) and set(qualities) <= set(QUALITIES), f"--qualities: {args.qualities!r}",
                f"a comma list of {', '.join(QUALITIES)}")
        require(args.prompts == "held_out" or not {"fixed", "teacher"} & set(qualities),
                "--prompts trained scores greedy and sampled completions only", "give --qualities greedy,sampled")
        torch.set_num_threads(2)
        cfg, student, teacher, tok, student_dir, examples = setup_pair(args.results, args.prompts, args.examples)
        require(args.contexts is not None or "fixed" not in qualities, "--contexts is needed for the fixed quality",
                "give the grid's eval_contexts.json")
        contexts = load_contexts(args.contexts) if "fixed" in qualities else []
        if "teacher" not in qualities:
            teacher_contexts = []
        elif args.teacher_contexts.is_file():
            teacher_contexts = load_contexts(args.teacher_contexts)
        else:
            params = SamplingParams(cfg.new_tokens, **cfg.sampling.params())
            teacher_contexts = sampled_contexts(teacher, tok, examples, params, args.seed + 1,
                                                autocast=autocast_dtype(cfg.compute.dtype))
            save_contexts(args.teacher_contexts, teacher_contexts)
        weights = {name: (student if folder == "student" else
                          (lambda f=folder: load_model(f, torch.float32).requires_grad_(False)))
                   for name, folder in pairs}
        progress = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
        lines = measure(cfg, teacher, tok, examples, weights, contexts, teacher_contexts, args.samples, args.seed,
                        progress, qualities, "" if args.prompts == "held_out" else "@" + args.prompts)
        with args.out.open("a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
        print(report(lines))
    except OpdError as e:
        print(f"opd: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
