"""opd: on-policy distillation whose rollouts run on cheaper, numerically mismatched inference, with the admission
check that says when that mismatch is safe.

The Python API is the CLI's commands as functions, for notebooks and scripts:

    import opd
    cfg = opd.make_config(family="qwen3", plan="kv=fp8_e4m3", schedule="async", async_={"max_staleness": 1},
                          steps=40)
    verdict = opd.admit(cfg)               # as `opd admit --json`: decision, reasons, proposal
    summary = opd.train(cfg, "runs/api")   # as `opd train`: the run's summary.json
    opd.generate("runs/api/checkpoint", ["Continue the chain: 3 1 4"])

Errors are `opd.OpdError` (the CLI prints them as its one-line `opd: error:`). Importing opd loads nothing heavy:
each function imports what it needs.

In a script, put the calls under `if __name__ == "__main__":`. The async schedule's rollout worker (and vLLM) run
in processes that multiprocessing starts by importing the script's main module: without the guard, its top level
would run again in each of them (train, admit and generate refuse to run there, so that mistake is one error, not a
hang). Notebooks and `python -c` need no guard.
"""
import multiprocessing
import sys
from pathlib import Path

from opd.io.errors import OpdError

__all__ = ["OpdError", "admit", "generate", "make_config", "train"]


def make_config(path: str | Path | None = None, /, **values):
    """A checked training config (opd.config.run.TrainConfig): the YAML file at `path` (optional) with `values` on top,
    given as the file's keys, a section as a dict (`loss={"name": "full_rkl"}`; the async section as `async_=`, since
    `async` is a Python keyword). Unknown keys, wrong types and values out of range raise OpdError naming the key, as
    in a config file. (Not `opd.config.run`: that name is the module opd/config/run.py.)"""
    from opd.config.files import build_config, expand_shorthand, load_config, merge
    if path is not None and not isinstance(path, (str, Path)):
        raise OpdError(f"the config path must be a str or Path, got {type(path).__name__}", "e.g. \"configs/demo.yaml\"")
    base = load_config(Path(path)).to_dict() if path is not None else {}
    if "async_" in values:
        values = {("async" if key == "async_" else key): value for key, value in values.items()}
    return build_config(merge(base, expand_shorthand(values)))


def train(cfg, run_dir: str | Path, resume: bool = False, overwrite: bool = False, progress: bool = True) -> dict:
    """Run (or with resume, continue) one OPD run of `cfg` in run_dir, as `opd train`; returns its summary (held-out
    metrics before and after, steps, the plan it ended with, time), also written to run_dir/summary.json."""
    _not_in_a_starting_worker("opd.train")
    from opd.io.errors import from_os_error, require
    from opd.training.trainer import train as run
    require(isinstance(run_dir, (str, Path)) and str(run_dir), f"run_dir must be a path, got {run_dir!r}",
            "e.g. \"runs/my-run\"")
    try:
        return run(_checked(cfg), Path(run_dir), resume=resume, overwrite=overwrite, progress=progress)
    except OSError as e:
        raise from_os_error(e) from None


def admit(cfg, rollouts: int = 16, thresholds: str | Path = "", limit: float = 0.0, propose: bool = True,
          warmup: int | str = "auto", self_calibrated: bool = False, batches: int = 8, trial: int = 0,
          trial_seeds: int = 2, spill: str | Path = "") -> dict:
    """The admission check of cfg's rollout set-up, as `opd admit --json`: a dict with "decision" (ADMIT, UNCERTAIN:
    run it only under the runtime guard, or REJECT), "reasons", the probe's numbers and, when not admitted, a
    "proposal" (a plan that passes, or what to change). rollouts: the probe's batch of the run's own prompts;
    thresholds: a file from `opd calibrate` ("" = the shipped one: with warmup, the one calibrated at that warm-up
    where it ships); limit > 0 replaces the calibrated nsr limit; warmup K > 0 probes the student after K steps of the
    run's own recipe with BF16 rollouts (check.warm_weights; for a student whose first steps move it far, as a pruned
    one: docs/admission-results.md, "Across models"), 0 the initial student. "auto" (the default): with the shipped
    thresholds, the initial student, and when that probe is not admitted, its student is far from its teacher
    (probe reverse KL > admission.FAR_STUDENT_RKL) and its estimator class escalates (admission.ESCALATE_CLASSES:
    the full-distribution losses), the student after admission.AUTO_WARMUP BF16 steps with the
    thresholds calibrated so (the initial verdict is kept as "initial_probe"); with a thresholds file, the warm-up it
    was calibrated at.
    self_calibrated: decide instead from the candidate's gradient bias against the recipe's own BF16 noise on
    `batches` batches of the run's prompts (opd/admission/bias.py; no calibration of ours on the model; rollouts,
    thresholds, limit and warmup do not apply; propose: on REJECT, a lower staleness or a plan with its most
    sensitive layers in BF16 that passes the same measurement, at most 3 more measurements).
    trial K > 0: decide instead from a paired trial, K steps of the run's own recipe for the candidate, its BF16 twin
    (same seed) and trial_seeds more BF16 seeds, on fixed held-out contexts (opd/admission/trial.py: the recipe's
    learning rate and horizon are in the measurement; its cut is provisional).
    spill: with self_calibrated, a folder where the statistic's sums live as files instead of memory (20 bytes a
    parameter: a student whose sums do not fit; the measurement refuses, in one line, sums that fit neither)."""
    _not_in_a_starting_worker("opd.admit")
    from opd.io.errors import require
    require(_number(limit) and limit >= 0, f"limit must be a number >= 0, got {limit!r}", "0 uses the calibrated limit")
    require(isinstance(rollouts, int) and not isinstance(rollouts, bool) and 0 < rollouts <= 4096,
            f"rollouts must be an integer in [1, 4096], got {rollouts!r}", "the probe needs 16 or so")
    require(warmup == "auto" or isinstance(warmup, int) and not isinstance(warmup, bool) and 0 <= warmup <= 10_000,
            f"warmup must be \"auto\" or an integer in [0, 10000], got {warmup!r}", "0 probes the initial student; 4 or "
            "so a student whose first steps move it far; \"auto\" the first, then the second where it applies")
    require(isinstance(thresholds, (str, Path)), f"thresholds must be a path, got {thresholds!r}",
            "\"\" uses the shipped thresholds")
    require(isinstance(batches, int) and not isinstance(batches, bool) and 2 <= batches <= 4096,
            f"batches must be an integer in [2, 4096], got {batches!r}", "8 or so; more narrows the verdict")
    for name, value, low, high in (("trial", trial, 0, 10_000), ("trial_seeds", trial_seeds, 1, 16)):
        require(isinstance(value, int) and not isinstance(value, bool) and low <= value <= high,
                f"{name} must be an integer in [{low}, {high}], got {value!r}", "trial 4 with 2 seeds or so")
    require(not (trial and self_calibrated), "a paired trial and the gradient bias are two checks", "choose one")
    require(isinstance(spill, (str, Path)), f"spill must be a folder's path, got {spill!r}", "\"\" keeps the sums in "
            "memory")
    require(not spill or self_calibrated, "spill is for the gradient-bias check's sums", "use it with self_calibrated")
    if spill:
        from opd.health.drift import check_spill
        check_spill(spill)  # before the models load
    if trial:
        from opd.admission.trial import check_trial
        return check_trial(_checked(cfg), trial, trial_seeds, propose=propose,
                           progress=lambda text: print(f"opd admit: {text}", file=sys.stderr, flush=True))
    if self_calibrated:
        from opd.admission.check import check_self
        return check_self(_checked(cfg), batches, propose=propose, spill=spill or None)
    from opd.admission.check import check
    return check(_checked(cfg), rollouts, thresholds, limit, propose, warmup)


def generate(model: str | Path, prompts: list, max_new_tokens: int = 64, plan: str = "", seed: int = 0,
             temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
             chat: bool = False, engine: str = "builtin", device: str = "auto") -> list[str]:
    """Sample one completion per prompt from the HF checkpoint folder `model` (a run's checkpoint works) under a
    precision plan ("" = float32), as `opd generate`; returns the completions' text. prompts: strings (chat: sent
    through the model's chat template as one user message) or lists of chat messages. Sampling settings not given
    come from the checkpoint's generation_config.json, else temperature 1 with no top-k/top-p."""
    _not_in_a_starting_worker("opd.generate")
    from opd.models import devices
    from opd.models.checkpoint import load_checkpoint
    from opd.config.run import generation_defaults
    from opd.io.errors import require
    from opd.engines.kinds import NAMES, kind, make_engine, require_installed
    from opd.engines.sampling import SamplingParams
    require(isinstance(prompts, list) and prompts, "prompts must be a non-empty list", "e.g. [\"3 + 4 =\"]")
    require(all(isinstance(p, str) or (isinstance(p, list) and all(isinstance(m, dict) for m in p)) for p in prompts),
            "each prompt must be a string or a list of chat messages", 'e.g. ["3 + 4 ="] or '
            '[[{"role": "user", "content": "3 + 4 ="}]]')
    require(isinstance(seed, int) and 0 <= seed < 2 ** 32, f"seed must be an integer in [0, 2**32), got {seed!r}")
    require(engine in NAMES, f"unknown engine {engine!r}", f"use one of {', '.join(NAMES)}")
    require(isinstance(model, (str, Path)), f"model must be a checkpoint folder's path, got {model!r}")
    require(isinstance(plan, str), f"plan must be a plan string, got {plan!r}", "e.g. \"kv=fp8_e4m3; 0: kv=bf16\"")
    require(isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool),
            f"max_new_tokens must be an integer, got {max_new_tokens!r}")
    for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        require(value is None or _number(value), f"{name} must be a number or None, got {value!r}")
    net, tok = load_checkpoint(Path(model), device="cpu" if kind(engine).own_copy else devices.resolve(device))
    texts = [[{"role": "user", "content": p}] if chat and isinstance(p, str) else p for p in prompts]
    params = SamplingParams(max_new_tokens, **generation_defaults(tok.generation, temperature=temperature,
                                                                  top_k=top_k, top_p=top_p))
    require_installed(engine)
    ids = [tok.encode_prompt(t) for t in texts]
    rollout_engine = make_engine(engine, net, tok.stop_ids, tok.pad_id, plan, model_dir=Path(model), seed=seed,
                                 context=max(map(len, ids)) + params.max_new_tokens, max_seqs=len(ids))
    try:
        rollouts = rollout_engine.generate(ids, params, seed)
    finally:
        rollout_engine.close()
    return [tok.decode(r.completion_ids) for r in rollouts]


def _not_in_a_starting_worker(what: str) -> None:
    """Refuse to run while multiprocessing starts a child process (it is importing the parent's main module: a
    script without the `__main__` guard); in that state the child never gets to its real work, and the parent would
    wait for it."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise OpdError(f"{what} was called while a worker process was starting: it imports the script's main module, "
                       "whose top level runs again there", "put the script's code under "
                       "`if __name__ == \"__main__\":`")


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # x == x: not NaN


def _checked(cfg):
    from opd.config.run import TrainConfig
    if isinstance(cfg, dict):
        return make_config(**cfg)
    if not isinstance(cfg, TrainConfig):
        raise OpdError(f"expected a config from opd.make_config(), got {type(cfg).__name__}", "cfg = opd.make_config(...)")
    return cfg
