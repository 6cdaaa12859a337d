"""Per-step metrics: pure functions over masked [B, T] tensors returning flat `{"namespace/name": float}` dicts.

Names and formulas are those of the project's definitions. Per generated token: `mu` = log-prob of the sampled
token under the rollout engine, `q` = under the trainer's full-precision forward with the weights that sampled
it, `pi` = under the current learner, `T` = under the teacher; `delta = q - mu`.
- `mismatch/`: `kl_k1 = mean(mu - q)`, `kl_k3 = mean(exp(delta) - delta - 1)` (Schulman's k3: non-negative,
  unbiased for KL(rollout || train) when tokens come from the rollout policy), `abs_dlogp_{mean,p99,max}` of
  |delta|, `prob_err = exp(mean |delta|)`, `chi2_token = mean(exp(2 delta)) - 1`, and `kl_exact`, the mean over
  positions of the exact KL(p_rollout || p_train) when both whole distributions are at hand.
- `is/`: importance weights `w = exp(delta)`: mean, min, max, fraction outside [1/C, C], effective sample size
  `ess = (sum w)^2 / sum w^2` (= N when all weights are equal) and `ess_frac = ess / N = 1 / mean((w / mean w)^2)`.
- `opd/`: distortion of the sampled-token OPD signal, `A_mu = T - mu` vs `A_q = T - q`: `adv_sign_flip` (fraction of
  tokens whose advantage changes sign), `adv_snr = mean |A_q| / mean |delta|` (how far the learning signal stands
  above the mismatch noise; infinite when there is no mismatch) and its inverse `nsr = mean |delta| / mean |A_q|`
  (0 when there is no mismatch), the admission check's decision metric.
- `stale/`: the policy-version gap of each rollout, the update-edge mismatch `upd_kl_k3` with `l = pi - q`, and
  `total_kl_k3` with `l = pi - mu`: the rollout engine vs the current learner, numerics and staleness together,
  which is the gap a sampled-token advantage built on `mu` sees (equal to `mismatch/kl_k3` when nothing is stale),
  and `total_nsr = mean |pi - mu| / mean |T - pi|` (trainer.py; `opd/nsr` when nothing is stale).
- `teacher_mismatch/`: the same for the teacher's side (teacher.py), on the rollouts the trainer's teacher also
  scores: `T_e` = the teacher engine's log-prob of the sampled token, `T` = the trainer's full-precision teacher's,
  `d = T - T_e`: the `mismatch/` set with T_e as the sampler and T as the trainer (`kl_k1 = mean(-d)`,
  `kl_k3 = mean(exp(d) - d - 1)`, `abs_dlogp_{mean,p99,max}` of |d|, `prob_err`, `chi2_token`), `kl_exact`
  (mean KL(p_engine || p_trainer), when the engine gives whole rows), `tail_mass` (top-k engines: the mass their k
  tokens leave); the advantage distortion with the learner's baseline, `A_e = T_e - pi` vs `A = T - pi`:
  `adv_sign_flip` and `nsr = mean |d| / mean |A|`. The tokens come from the student, not from either teacher, so k3
  is a distance on the student's tokens rather than an unbiased KL estimate.
- `sampling/` (only with top-k/top-p on): what the truncation does to `mu`, apart from the numerics. With
  `u` = the engine's log-prob before truncation (same temperature), `s = mu - u = -log(kept mass) >= 0`:
  `kept_mass = mean exp(-s)`, `shift_mean = mean s` (the bias a sampler-term advantage `T - mu` gets) and
  `kl_k3 = mean(exp(-s) + s - 1)`, what it would add to `mismatch/kl_k3` if it were counted there. The `mismatch/`,
  `is/` and `opd/` sets then compare `u` with `q` (learner.numerics_mu): numerics only.
- `rollout/`: completion lengths and the truncation rate (completions cut at max_new_tokens).

**Rollout health.** The `mismatch/`, `is/` and `opd/` sets of a batch (`rollout_health`) are what the admission check
is calibrated on: the probe measures them on its batch, the trainer on every step, with this one function.
`RolloutHealth` (and `TeacherHealth` for the teacher's side) are the fields the check judges, read typed from either
(a step's namespaced metrics, or a probe's numbers: the keys' last part, as results lines store them), and averaged
over the runtime guard's window field by field, so a criterion added here reaches the probe, the guard and
admission.decide alike.
"""
import math
from dataclasses import dataclass, fields
from typing import ClassVar

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def _values(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x[mask.bool()].double()


def kl_estimates(log_ratio: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(k1, k3) estimates of KL(a || b) from l = log b(y) - log a(y) on tokens y ~ a."""
    l = _values(log_ratio, mask)
    if l.numel() == 0:
        return 0.0, 0.0
    return (-l).mean().item(), (torch.expm1(l) - l).mean().item()


def mismatch_metrics(mu: torch.Tensor, q: torch.Tensor, mask: torch.Tensor) -> dict:
    delta = _values(q - mu, mask)
    if delta.numel() == 0:
        return {}
    k1, k3 = kl_estimates(q - mu, mask)
    a = delta.abs()
    return {"mismatch/kl_k1": k1, "mismatch/kl_k3": k3, "mismatch/abs_dlogp_mean": a.mean().item(),
            "mismatch/abs_dlogp_p99": torch.quantile(a, 0.99).item(), "mismatch/abs_dlogp_max": a.max().item(),
            "mismatch/prob_err": math.exp(a.mean().item()),
            "mismatch/chi2_token": torch.exp(2 * delta).mean().item() - 1}


def exact_kl_metric(kl_per_token: torch.Tensor, mask: torch.Tensor) -> dict:
    """kl_per_token [B, T]: the exact KL(p_rollout || p_train) at each position (chunked.score computes it from the
    two whole distributions, a chunk of positions at a time) -> its mean over the masked positions."""
    return {"mismatch/kl_exact": masked_mean(kl_per_token.double(), mask).item()}


def importance_metrics(mu: torch.Tensor, q: torch.Tensor, mask: torch.Tensor, cap: float = 2.0) -> dict:
    w = torch.exp(_values(q - mu, mask))
    if w.numel() == 0:
        return {}
    ess = (w.sum() ** 2 / (w ** 2).sum()).item()
    return {"is/w_mean": w.mean().item(), "is/w_min": w.min().item(), "is/w_max": w.max().item(),
            "is/frac_outside": ((w < 1 / cap) | (w > cap)).double().mean().item(),
            "is/ess": ess, "is/ess_frac": ess / w.numel()}


def distortion_metrics(teacher: torch.Tensor, mu: torch.Tensor, q: torch.Tensor, mask: torch.Tensor) -> dict:
    """teacher, mu, q [B, T]: sampled-token log-probs."""
    a_mu, a_q, delta = (_values(x, mask) for x in (teacher - mu, teacher - q, q - mu))
    if delta.numel() == 0:
        return {}
    noise, signal = delta.abs().mean().item(), a_q.abs().mean().item()
    return {"opd/adv_sign_flip": (torch.sign(a_mu) != torch.sign(a_q)).double().mean().item(),
            "opd/adv_snr": signal / noise if noise > 0 else math.inf,
            "opd/nsr": _nsr(noise, signal)}


def noise_to_signal(teacher: torch.Tensor, sampler: torch.Tensor, learner: torch.Tensor, mask: torch.Tensor) -> float:
    """mean |learner - sampler| / mean |teacher - learner|: the rollout mismatch next to the OPD signal it perturbs
    (the advantage T - s). A student far from its teacher has a large signal and tolerates more mismatch."""
    return _nsr(_values(learner - sampler, mask).abs().mean().item(),
                _values(teacher - learner, mask).abs().mean().item())


def _nsr(noise: float, signal: float) -> float:
    return noise / signal if signal > 0 else (math.inf if noise > 0 else 0.0)


def staleness_metrics(versions: list[int], current: int, q: torch.Tensor, pi: torch.Tensor,
                      mask: torch.Tensor, mu: torch.Tensor | None = None,
                      token_mask: torch.Tensor | None = None) -> dict:
    """versions: the (token-weighted) policy version of each rollout; current: the learner's version.
    mask: the tokens whose q is known; token_mask: all generated tokens (for total_kl_k3, which needs only mu)."""
    gaps = [current - v for v in versions]
    out = {"stale/version_gap_mean": sum(gaps) / len(gaps), "stale/version_gap_max": float(max(gaps))}
    if mu is not None and token_mask is not None and token_mask.any():
        out["stale/total_kl_k3"] = kl_estimates(pi - mu, token_mask)[1]
    if mask.any():  # no tokens with a known q: the update's KL is unknown, not zero
        out["stale/upd_kl_k3"] = kl_estimates(pi - q, mask)[1]
    return out


def teacher_mismatch_metrics(engine: torch.Tensor, trainer: torch.Tensor, learner: torch.Tensor, mask: torch.Tensor,
                             kl_exact: torch.Tensor | None = None, tail_mass: torch.Tensor | None = None) -> dict:
    """engine, trainer, learner [B, T]: the teacher engine's, the trainer's teacher's and the learner's log-prob of
    each sampled token (T_e, T, pi); kl_exact [B, T] per position; tail_mass [M] per token."""
    if not mask.any():
        return {}
    # the student side's mismatch/ set with the engine as the sampler and the trainer's teacher as the trainer
    out = {k.replace("mismatch/", "teacher_mismatch/"): v for k, v in mismatch_metrics(engine, trainer, mask).items()}
    a_e, a = _values(engine - learner, mask), _values(trainer - learner, mask)
    out |= {"teacher_mismatch/adv_sign_flip": (torch.sign(a_e) != torch.sign(a)).double().mean().item(),
            "teacher_mismatch/nsr": _nsr(out["teacher_mismatch/abs_dlogp_mean"], a.abs().mean().item())}
    if kl_exact is not None:
        out["teacher_mismatch/kl_exact"] = masked_mean(kl_exact.double(), mask).item()
    if tail_mass is not None and tail_mass.numel():
        out["teacher_mismatch/tail_mass"] = tail_mass.double().mean().item()
    return out


def truncation_metrics(mu: torch.Tensor, untruncated: torch.Tensor, mask: torch.Tensor) -> dict:
    """mu, untruncated [B, T]: the sampler's log-probs after and before top-k/top-p (module docstring)."""
    s = _values(mu - untruncated, mask)
    if s.numel() == 0:
        return {}
    return {"sampling/kept_mass": torch.exp(-s).mean().item(), "sampling/shift_mean": s.mean().item(),
            "sampling/kl_k3": (torch.expm1(-s) + s).mean().item()}


def rollout_metrics(lengths: list[int], truncated: list[bool]) -> dict:
    return {"rollout/length_mean": sum(lengths) / len(lengths), "rollout/length_max": float(max(lengths)),
            "rollout/truncated": sum(truncated) / len(truncated)}


def rollout_health(teacher: torch.Tensor, mu: torch.Tensor, q: torch.Tensor, mask: torch.Tensor,
                   cap: float = 2.0) -> dict:
    """The mismatch/, is/ and opd/ sets of a batch (teacher, mu, q [B, T]: sampled-token log-probs; cap: C of the
    importance weights' frac_outside): what the probe measures and the trainer logs every step."""
    return {**mismatch_metrics(mu, q, mask), **importance_metrics(mu, q, mask, cap),
            **distortion_metrics(teacher, mu, q, mask)}


class _Health:
    """Typed fields read from a step's metrics or a probe's numbers (module docstring)."""
    KEYS: ClassVar[dict] = {}  # field -> its key among a step's metrics
    PREFIX: ClassVar[str] = ""  # a probe's name of a field: PREFIX + the key's last part
    KEEP_NAN: ClassVar[tuple] = ("nsr",)  # a NaN here is news (broken log-probs), not a gap: it survives the mean

    @classmethod
    def of(cls, numbers: dict):
        """The fields `numbers` has (a step's metrics or a probe's numbers); None without an nsr."""
        values = {}
        for name, key in cls.KEYS.items():
            value = numbers.get(key, numbers.get(cls.PREFIX + key.rpartition("/")[2]))
            if value is not None:
                values[name] = float(value)
        return cls(**values) if "nsr" in values else None

    @classmethod
    def mean(cls, window: list):
        """Field by field over the entries that have it (a NaN nsr propagates, other non-finite values are skipped);
        None for an empty window."""
        if not window:
            return None
        out = {}
        for f in fields(cls):
            values = [getattr(h, f.name) for h in window if getattr(h, f.name) is not None and
                      (f.name in cls.KEEP_NAN or math.isfinite(getattr(h, f.name)))]
            if values:
                out[f.name] = sum(values) / len(values)
        return cls(**out)


@dataclass(frozen=True)
class RolloutHealth(_Health):
    """The rollouts' side: the engine's log-probs mu against the trainer's q, next to the OPD signal."""
    nsr: float = math.nan  # opd/nsr = mean |q - mu| / mean |T - q|, the decision metric
    ess_frac: float | None = None  # is/ess_frac of the weights q / mu
    kl_k3: float | None = None
    adv_sign_flip: float | None = None
    kv_clipped_k: float | None = None  # the share of keys / values an FP8 or int8 KV cache saturated (probe only)
    kv_clipped_v: float | None = None
    KEYS: ClassVar[dict] = {"nsr": "opd/nsr", "ess_frac": "is/ess_frac", "kl_k3": "mismatch/kl_k3",
                            "adv_sign_flip": "opd/adv_sign_flip", "kv_clipped_k": "kv_clipped_k",
                            "kv_clipped_v": "kv_clipped_v"}

    @classmethod
    def floor_of(cls, numbers: dict) -> "RolloutHealth | None":
        """The BF16 engine's own health on the probe's prompts (the probe's floor_nsr, floor_kl_k3), if measured."""
        if "floor_nsr" not in numbers:
            return None
        return cls(nsr=float(numbers["floor_nsr"]), kl_k3=numbers.get("floor_kl_k3"))


@dataclass(frozen=True)
class TeacherHealth(_Health):
    """The teacher's side: a served teacher's log-probs T_e against the trainer's teacher's T (teacher_mismatch/)."""
    nsr: float = math.nan  # mean |T - T_e| / mean |T - pi|
    kl_k3: float | None = None
    kl_exact: float | None = None
    adv_sign_flip: float | None = None
    tail_mass: float | None = None  # a top-k teacher's: the mass its k tokens leave
    KEYS: ClassVar[dict] = {name: f"teacher_mismatch/{name}" for name in
                            ("nsr", "kl_k3", "kl_exact", "adv_sign_flip", "tail_mass")}
    PREFIX: ClassVar[str] = "teacher_"

