"""Peak memory of OPD on a real-vocabulary pair, as a function of batch x tokens; step time against the code before
chunking and against TRL.

The pair is benchmarks/realvocab.py's (Qwen3-shaped, vocabulary 151,936, random weights, a real BPE tokenizer.json,
built here on first use). Each measurement runs in a process of its own, which resets the peak right before the
measured work (after the models are loaded) and reads it after: on the CPU the process's peak resident set (VmHWM,
reset through /proc/self/clear_refs), on CUDA `torch.cuda.max_memory_allocated`. Measured:
- `step`: one OPD step with the defaults (sampling with BF16 rollouts, teacher, learner, full_rkl, exact KL) at batch B
  and two numbers of new tokens;
- `admit`: `opd admit --no-propose`'s probe (the candidate plan and the BF16 floor) with B rollouts, same two sizes;
- `eval`: an evaluation (greedy and sampled, with the reverse KL to the teacher) of two numbers of examples;
- `load`: loading the teacher's bf16 checkpoint as a float32 model (`load_peak_over_model`: the process's peak
  growth over the model's own bytes; it counts the pages of the file that safetensors maps, 0.5 of the model for a
  bf16 file, so ~1.5 means the weights never existed twice; the code before this change measured 1.87).
`*_bnv` = (peak at the larger size - peak at the smaller) / bytes of one float32 [B, added tokens, V] tensor
(evaluation: [added examples, tokens, V]): how many such tensors the path holds per added token. Before chunking it
was ~8.5 (step), ~12.9 (admit) and > 1 (eval) (issue 19).

Step time, each the median of the steps after the first, in processes that alternate: `step_s_ratio` is this code
over the code before chunking (the git commit BASELINE, extracted to a temporary folder) on the built-in llama pair
with the demo's settings (batch 64, BF16 rollouts, full_rkl); `trl_step_ratio` and `trl_mem_ratio` compare one OPD
step here with TRL's DistillationTrainer (beta 1: reverse KL, float32, no gradient checkpointing, `pip install -e
'.[bench]'`) on the real-vocabulary pair, same batch, prompts and new tokens, both sampling in float32 (opd: plan "").

    python benchmarks/memory.py                  # what docs/benchmarks.md quotes (~30 minutes on 2 CPU cores)
    python benchmarks/memory.py --quick          # < 1 minute: small sizes, no TRL or baseline comparison
    python benchmarks/memory.py --device cuda    # on a GPU (benchmarks/gpu.sh)

The last line is `RESULT key=value ...`.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BASELINE = "9b501b9"  # the last commit before chunked full-vocabulary work (issue 19)
V = 151_936


# ---- workers: one measurement each, in a process of its own --------------------------------------------------------

def worker(job: dict) -> dict:
    import torch
    torch.set_num_threads(job["threads"])
    if job["kind"] == "builtin":
        return builtin_steps(job)
    if job["kind"] == "trl":
        return trl_steps(job)
    from opd.models import devices
    if job["kind"] == "load":  # a bf16 checkpoint into float32: one model's worth, not two
        from opd.models.checkpoint import load_checkpoint
        device = devices.resolve(job["device"])
        base = devices.current_memory(device)
        devices.reset_peak_memory(device)
        model, _ = load_checkpoint(job["teacher"], torch.float32, device)
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        return {"peak": devices.peak_memory(device) - base, "model": size}
    from opd.config.files import build_config, merge
    device = devices.resolve(job["device"])
    cfg = build_config(merge({"student": job["student"], "teacher": job["teacher"], "batch_size": job["batch"],
                              "sampling": {"max_new_tokens": job["tokens"]}, "threads": job["threads"],
                              "compute": {"device": job["device"]}, "eval": {"examples": job.get("examples", 8)}},
                             job.get("set", {})))
    if job["kind"] == "admit":
        from opd.health.thresholds import load_thresholds
        from opd.admission.check import decide_plan as admit
        from opd.training.setup import probe_setup
        setup, plan = probe_setup(cfg, job["batch"])
        devices.reset_peak_memory(device)
        admit(setup, plan, load_thresholds(), propose=False)
        return {"peak": devices.peak_memory(device)}
    from opd.training.setup import setup
    from opd.training.trainer import evaluate, run_step
    run = setup(cfg)
    devices.reset_peak_memory(device)
    if job["kind"] == "eval":
        evaluate(run, cfg)
        return {"peak": devices.peak_memory(device)}
    times = []
    for _ in range(job.get("steps", 1)):
        start = time.perf_counter()
        run_step(run)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"peak": devices.peak_memory(device), "times": times}


def builtin_steps(job: dict) -> dict:
    """Step times on the built-in pair with the API both this code and BASELINE have (BASELINE's setup is in its
    trainer module)."""
    from opd.config.files import build_config
    from opd.training.trainer import run_step
    try:
        from opd.training.setup import setup
    except ImportError:
        from opd.training.trainer import setup
    run = setup(build_config({"family": job["family"], "batch_size": job["batch"], "threads": job["threads"]}))
    times = []
    for _ in range(job["steps"]):
        start = time.perf_counter()
        run_step(run)
        times.append(time.perf_counter() - start)
    return {"times": times}


def trl_steps(job: dict) -> dict:
    """TRL's DistillationTrainer on the same pair: the peak over its steps and each step's time."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer
    from opd.models import devices
    device = torch.device("cuda" if job["device"] == "cuda" else "cpu")
    times = []

    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            devices.reset_peak_memory(device)

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)
    tok = AutoTokenizer.from_pretrained(job["student"], padding_side="left")
    with tempfile.TemporaryDirectory() as out:
        args = DistillationConfig(
            output_dir=out, use_cpu=device.type == "cpu", bf16=False, fp16=False, gradient_checkpointing=False,
            model_init_kwargs={"dtype": "float32"}, teacher_model_init_kwargs={"dtype": "float32"},
            per_device_train_batch_size=job["batch"], gradient_accumulation_steps=1, max_steps=job["steps"],
            learning_rate=1e-5, lr_scheduler_type="constant", max_grad_norm=1.0, beta=1.0, temperature=1.0,
            top_k=0, top_p=1.0, max_completion_length=job["tokens"], shuffle_dataset=False, report_to="none",
            logging_strategy="no", save_strategy="no", eval_strategy="no", disable_tqdm=True, seed=0)
        trainer = DistillationTrainer(model=job["student"], teacher_model=job["teacher"], args=args,
                                      train_dataset=Dataset.from_dict({"prompt": job["prompts"]}), processing_class=tok,
                                      callbacks=[Timer()])
        trainer.train()
    return {"peak": devices.peak_memory(device), "times": times}


def measure(job: dict, pythonpath: Path | None = None, for_memory: bool = True) -> dict:
    """Run one worker in a fresh process; its result. for_memory: with glibc's mmap threshold fixed (below), which
    makes every large allocation a system call: right for peaks, ~40% slower steps, so timings run without it."""
    # glibc raises its mmap threshold to the size of each large block freed, after which freed tensors stay in the
    # heap and in the resident set: peaks would then measure its caching, not what is live. A fixed threshold
    # returns every block of 1 MiB or more to the system when it is freed (as CUDA's allocator statistics count).
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(job["threads"]),
               **({"MALLOC_MMAP_THRESHOLD_": str(1 << 20)} if for_memory else {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath or REPO), env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(job)],
                          capture_output=True, text=True, env=env, cwd=str(pythonpath or REPO))
    lines = [line for line in done.stdout.splitlines() if line.startswith("MEASURED ")]
    if done.returncode or not lines:
        raise SystemExit(f"memory.py: the {job['kind']} worker failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("MEASURED "):])


# ---- the benchmark ---------------------------------------------------------------------------------------------------

def prompts(n: int) -> list[str]:
    from opd.data.task import get_task, train_examples
    stream = train_examples(get_task("chain"), seed=12345)
    return [next(stream).prompt for _ in range(n)]


def growth(small: dict, large: dict, rows: int) -> float:
    """Peak growth per float32 [rows, V] tensor."""
    return (large["peak"] - small["peak"]) / (4 * rows * V)


def gib(x: float) -> str:
    return f"{x / 2 ** 30:.2f} GiB"


def baseline_tree(tmp: Path) -> Path | None:
    """BASELINE's opd package, extracted into tmp (None if this is not a git checkout that has it)."""
    try:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", BASELINE, "opd"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return tmp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, nargs=2, default=[128, 512], help="the two numbers of new tokens")
    ap.add_argument("--examples", type=int, nargs=2, default=[8, 64], help="the two evaluation sizes")
    ap.add_argument("--eval-tokens", type=int, default=128)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("MEASURED " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    chunks = {}
    if args.quick:  # small sizes, with chunks and evaluation batches smaller than both (memory in its steady state)
        args.batch, args.tokens, args.examples, args.eval_tokens = 2, [16, 80], [2, 10], 16
        chunks = {"compute": {"chunk_tokens": 16}, "eval": {"batch_size": 2}}
    sys.path.insert(0, str(HERE))
    from realvocab import build
    student, teacher = map(str, build())
    B, (n1, n2), (e1, e2) = args.batch, args.tokens, args.examples
    common = {"student": student, "teacher": teacher, "threads": args.threads, "device": args.device, "batch": B,
              "set": chunks}
    threads = "1 thread each, two processes at a time" if args.quick else f"{args.threads} threads"
    print(f"real-vocabulary pair (V = {V}), batch {B}, {threads}, device {args.device}")
    jobs = [common | {"kind": "step", "tokens": n} for n in (n1, n2)] + \
        [common | {"kind": "admit", "tokens": n} for n in (n1, n2)] + \
        [common | {"kind": "eval", "tokens": args.eval_tokens, "examples": e} for e in (e1, e2)]
    if args.quick:  # two processes at a time, a thread each: only peaks are measured here, not time
        with ThreadPoolExecutor(2) as pool:
            step, probe, evals = zip(*[iter(pool.map(measure, [job | {"threads": 1} for job in jobs]))] * 2)
    else:
        step, probe, evals = zip(*[iter(map(measure, jobs))] * 2)
    result = {"step_bnv": growth(*step, B * (n2 - n1)), "admit_bnv": growth(*probe, B * (n2 - n1)),
              "eval_bnv": growth(*evals, (e2 - e1) * args.eval_tokens)}
    load = measure(common | {"kind": "load"})
    result["load_peak_over_model"] = load["peak"] / load["model"]
    print(f"loading the teacher (a bf16 file of half the model's size, mapped; a float32 model of "
          f"{gib(load['model'])}): the process grew by at most {gib(load['peak'])}")
    print(f"{'':8} {'peak (small)':>14} {'peak (large)':>14} {'growth / [rows, V] f32':>24}")
    for name, (a, b) in (("step", step), ("admit", probe), ("eval", evals)):
        print(f"{name:8} {gib(a['peak']):>14} {gib(b['peak']):>14} {result[name + '_bnv']:>24.3f}")
    if not args.quick:
        result |= compare_trl(common, n1)
    if not args.quick and args.device == "cpu":  # BASELINE runs on the CPU only
        result |= compare_baseline(args.threads)
    if args.quick:
        print("(--quick: a [rows, V] tensor is only 0.07 GiB at these sizes, and peaks vary by ~0.015 GiB between "
              "runs: the ratios carry about +-0.2)")
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in result.items())
          + f" batch={B} tokens={n1},{n2} examples={e1},{e2} device={args.device}")


def compare_trl(common: dict, tokens: int) -> dict:
    """One OPD step (plan "": float32 rollouts, like TRL's generate) vs TRL's: times from 3 steps each, twice,
    alternating; peaks from 2 more steps each."""
    try:
        import trl
    except ImportError:
        print("TRL not installed (pip install -e '.[bench]'): no TRL comparison")
        return {}
    job = common | {"tokens": tokens, "steps": 3}
    ours = job | {"kind": "step", "set": job["set"] | {"plan": ""}}
    theirs = job | {"kind": "trl", "prompts": prompts(job["steps"] * job["batch"])}
    timed_ours, timed_trl = [], []
    for _ in range(2):  # alternating, with the allocator as users run it
        timed_ours += measure(ours, for_memory=False)["times"][1:]
        timed_trl += measure(theirs, for_memory=False)["times"][1:]
    t_ours, t_trl = statistics.median(timed_ours), statistics.median(timed_trl)
    m_ours, m_trl = measure(ours | {"steps": 2})["peak"], measure(theirs | {"steps": 2})["peak"]
    print(f"vs TRL {trl.__version__} at batch {job['batch']} x {tokens} new tokens: step "
          f"{t_ours:.1f} s vs {t_trl:.1f} s, peak {gib(m_ours)} vs {gib(m_trl)}")
    return {"trl_step_ratio": t_ours / t_trl, "trl_mem_ratio": m_ours / m_trl}


def compare_baseline(threads: int) -> dict:
    """The demo's step (built-in llama pair, batch 64) here and at BASELINE: 4 steps each, twice, alternating."""
    with tempfile.TemporaryDirectory() as tmp:
        old = baseline_tree(Path(tmp))
        if old is None:
            print(f"git commit {BASELINE} not found: no comparison with the code before chunking")
            return {}
        job = {"kind": "builtin", "family": "llama", "batch": 64, "threads": threads, "steps": 4}
        new_times, old_times = [], []
        for _ in range(2):
            new_times += measure(job, for_memory=False)["times"][1:]
            old_times += measure(job, pythonpath=old, for_memory=False)["times"][1:]
    new, before = statistics.median(new_times), statistics.median(old_times)
    print(f"built-in llama pair, batch 64: {new:.3f} s a step here, {before:.3f} s at {BASELINE}")
    return {"step_s_ratio": new / before}


if __name__ == "__main__":
    main()
