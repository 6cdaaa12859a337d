"""A bf16 learner's micro-batch with the output weight cast once a call against autocast's cast in every matmul.

Under `compute.dtype: bf16` the learner runs under autocast with float32 master weights. The chunked loss multiplies
the tied [V, d] output weight in each chunk twice (the logits, the hidden states' gradient), and autocast copied it
to bf16 in each of those matmuls; `chunked.as_multiplied` casts it once a call instead, which is the same values bit
for bit. This times one micro-batch (a rollout of 150 prompt and 200 completion tokens of random ids, full_rkl, the
student's own bf16 copy as its teacher, forward and backward) both ways, alternated so the machine's drift hits both
alike, and checks that loss and every gradient are equal.

    python benchmarks/learner_cast.py --quick   # the smollm2 student (V = 49,152), 4 alternations, ~20 s
    python benchmarks/learner_cast.py           # the Qwen2.5-Coder student (V = 151,936), 4 alternations, ~2 min

The real pair is built on first use (as `opd pairs build` does). The last line is `RESULT key=value ...`.
"""
import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bf16 import cpu  # noqa: E402
from opd.config.sections import LossConfig  # noqa: E402
from opd.data.real_pairs import build_pair  # noqa: E402
from opd.models.checkpoint import load_checkpoint  # noqa: E402
from opd.training import chunked  # noqa: E402
from opd.training.learner import Batch, Scoring, score_batch  # noqa: E402
from opd.training.teacher import LocalTeacher  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the smollm2 student")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    student_dir, _ = build_pair("smollm2" if args.quick else "qwen2.5-coder")
    student, _ = load_checkpoint(student_dir, torch.float32, torch.device("cpu"))
    P, N = 150, 200
    ids = torch.randint(0, student.cfg.vocab_size, (1, P + N), generator=torch.Generator().manual_seed(0))
    batch = Batch(ids, torch.arange(P - 1, P + N - 1)[None], ids[:, P:], torch.ones(1, N, dtype=torch.bool),
                  torch.zeros(1, N), [0])
    teacher = LocalTeacher(copy.deepcopy(student).to(torch.bfloat16).eval().requires_grad_(False))
    how = Scoring(LossConfig(name="full_rkl"), 1.0, 1, 0, torch.bfloat16)
    ways = {"once": chunked.as_multiplied, "per matmul": lambda weight: weight.detach()}

    def run(way: str) -> tuple[float, float, dict]:
        chunked.as_multiplied = ways[way]
        student.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = score_batch(student, batch, teacher, how, backward=True).loss
        return time.perf_counter() - start, loss, {n: p.grad for n, p in student.named_parameters()}

    print(f"{student_dir.name}: V = {student.cfg.vocab_size}, one micro-batch of {P} + {N} tokens, bf16 autocast, "
          f"{args.threads} thread(s), {cpu()}", flush=True)
    results = {way: run(way) for way in ways}  # warm, and the equality check
    equal = results["once"][1] == results["per matmul"][1] and all(
        torch.equal(g, results["per matmul"][2][n]) for n, g in results["once"][2].items())
    seconds = {way: [] for way in ways}
    for r in range(args.rounds):
        for way in ways:
            seconds[way].append(run(way)[0])
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{w} {s[-1]:.2f} s" for w, s in seconds.items()), flush=True)
    chunked.as_multiplied = ways["once"]
    once, each = statistics.median(seconds["once"]), statistics.median(seconds["per matmul"])
    print(f"median: once {once:.2f} s, per matmul {each:.2f} s -> {each / once:.2f}x; loss and gradients equal: {equal}")
    print(f"RESULT cast_once_speedup={each / once:.3f} once_s={once:.3f} per_matmul_s={each:.3f} "
          f"equal={int(equal)} vocab={student.cfg.vocab_size} threads={args.threads}")


if __name__ == "__main__":
    main()
