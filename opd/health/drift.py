"""The gradient-bias statistic (issue 57, candidate (a)), as arithmetic on gradients: `opd admit --self`
(admission/bias.py) feeds it gradients measured before a run, canary training (training/canary.py) the pairs of a
running one. No model here: M pairs (g_i, c_i) of OPD gradients of the same batch (same prompts and sampling seed:
common random numbers), g_i with the reference rollouts, c_i with the candidate's, d_i = c_i - g_i, and

    bias^2  = |mean d|^2 - var(d) / M      (unbiased: the coupling noise of d taken out; its standard error var(d)/M)
    noise^2 = var(g)                        (the per-batch SGD noise of the reference rollouts)
    z = sqrt(T / 2) * bias / noise          (T steps: a bias drifts T steps the same way while the gap between two
                                             reference seeds grows as sqrt(2 T))

in the raw gradient and in AdamW's coordinates (each coordinate over the root of its mean square over both
rollouts' gradients, the scale Adam divides by). `decide` turns z and its standard error into ADMIT / UNCERTAIN /
REJECT against one unitless cut. Memory: five float64 vectors the size of the student (40 bytes a parameter).

**The progress share** (candidate (a'), session 39): most of the bias vector moves nothing quality measures (a
displacement orthogonal to the descent changes the loss at second order), so the same pairs are also projected on
the descent itself. Each pair i >= 2 is projected, as it arrives, on the mean BF16 gradient of the pairs before it
(h, in Adam's coordinates with the scale of those pairs: independent of pair i, so unbiased, and no vector kept):

    p_i = h . g_i / s      the progress a BF16 step makes along the descent (Adam's step is -lr g / s)
    q_i = h . d_i / s      what the candidate's rollouts change in it
    r   = -mean(q) / mean(p)   the share of a BF16 step's progress the candidate loses (negative: it gains)

with its standard error from the q_i's spread. Reported beside z, not deciding: on the built-in pairs' full_rkl
configurations every degraded one has r >= 0.35 and every fine one r <= 0.23, but held out z decides those runs as
well, the sampled estimators worse, and on the far real pair neither sees the degradations of its lr 3e-5 runs
(studies/progress_deficit.py; docs/admission.md, "The progress share r"). Its cost: one more float64 vector while a
pair is added.
"""
import math

import torch


class Sums:
    """Per-coordinate running sums of g, g^2, c^2, d, d^2 (float64): every statistic is a sum over coordinates of
    these, so M gradients of a 100M-parameter student need five vectors, not 2M.

    successive: the pairs come from a running training run (canary.py), whose weights move between pairs, so var(g)
    over the pairs would count the drift of the mean gradient along the run as noise; the noise is then taken from
    successive differences, |g_i - g_{i-1}|^2 / 2 (what one step's drift adds is small beside a batch's noise), which
    costs two more vectors (the last g and the sum)."""

    def __init__(self, successive: bool = False):
        self.M, self.sums, self.successive = 0, None, successive
        self.projections: list[tuple[float, float]] = []  # (p_i, q_i) of pairs 2..M (module docstring)

    def add(self, g: torch.Tensor, c: torch.Tensor) -> None:
        g, d = g.double(), c.double() - g.double()
        if self.M:  # the progress share: this pair on the descent of the pairs before it
            h = torch.add(self.sums[1], self.sums[2])  # one vector more while it lives: in place from here on
            h.div_(2 * self.M).sqrt_().add_(1e-8).reciprocal_().mul_(self.sums[0]).div_(self.M)
            self.projections.append((torch.dot(h, g).item(), torch.dot(h, d).item()))
            del h
        if self.sums is None:
            self.sums = [torch.zeros_like(g) for _ in range(7 if self.successive else 5)]
        for total, x in zip(self.sums, (g, g * g, (g + d) ** 2, d, d * d)):
            total += x
        if self.successive:
            last, total = self.sums[5], self.sums[6]
            if self.M:
                total += (g - last) ** 2
            last.copy_(g)
        self.M += 1

    def state_dict(self) -> dict:
        """What a checkpoint keeps (canary training resumes its measurement exactly)."""
        return {"M": self.M, "sums": list(self.sums) if self.sums is not None else [],
                "projections": [list(x) for x in self.projections]}

    @classmethod
    def from_state(cls, saved, size: int, successive: bool = False) -> "Sums | None":
        """state_dict()'s output for gradients of `size` coordinates, or None where it is not one."""
        sums = saved.get("sums") if isinstance(saved, dict) else None
        M = saved.get("M") if isinstance(saved, dict) else None
        n = 7 if successive else 5
        if not isinstance(M, int) or isinstance(M, bool) or M < 0 or not isinstance(sums, list) or \
                len(sums) != (n if M else 0) or not all(isinstance(t, torch.Tensor) and t.dtype == torch.float64
                                                         and t.shape == (size,) and bool(torch.isfinite(t).all())
                                                         for t in sums):
            return None
        projections = saved.get("projections", [])  # (checkpoints before session 39 have none: they restart it)
        if not isinstance(projections, list) or not all(
                isinstance(x, list) and len(x) == 2 and all(isinstance(v, float) and math.isfinite(v) for v in x)
                for x in projections) or len(projections) > max(M - 1, 0):
            return None
        out = cls(successive)
        out.M, out.sums, out.projections = M, (sums or None), [tuple(x) for x in projections]
        return out

    def stats(self, steps: int) -> dict:
        """bias, noise and z (module docstring), raw and in AdamW's coordinates."""
        M, (sg, sgg, scc, sd, sdd) = self.M, self.sums[:5]
        # Adam's denominator, pooled over both rollouts' gradients (a coordinate only the candidate's rollouts reach,
        # an embedding row of a token BF16 never sampled, is not divided by ~0) plus AdamW's eps
        scale = ((sgg + scc) / (2 * M)).sqrt() + 1e-8
        out = {"M": M, "T": steps}
        for name, w in {"raw": torch.ones_like(scale), "adam": scale.pow(-2)}.items():
            var_d = ((sdd - sd * sd / M) * w).sum().item() / (M - 1)
            noise2 = ((self.sums[6] if self.successive else sgg - sg * sg / M) * w).sum().item() / (
                (2 if self.successive else 1) * (M - 1))
            bias2 = ((sd / M).pow(2) * w).sum().item() - var_d / M
            bias, noise = math.sqrt(max(bias2, 0.0)), math.sqrt(max(noise2, 0.0))
            out |= {f"{name}_bias": bias, f"{name}_noise": noise, f"{name}_coupling": math.sqrt(max(var_d, 0.0)),
                    f"{name}_bias_se": math.sqrt(max(var_d, 0.0) / M),
                    f"{name}_z": math.sqrt(steps / 2) * bias / max(noise, 1e-30)}
        return out | self.progress()

    def progress(self) -> dict:
        """The progress share r (module docstring) with its standard error, from the pairs after the first; {} with
        fewer than 2 projected pairs."""
        n = len(self.projections)
        if n < 2:
            return {}
        p = sum(x for x, _ in self.projections) / n
        q = [y for _, y in self.projections]
        mean_q = sum(q) / n
        se = math.sqrt(sum((y - mean_q) ** 2 for y in q) / (n - 1) / n)
        return {"progress": p, "progress_deficit": -mean_q, "r": -mean_q / max(abs(p), 1e-30),
                "r_se": se / max(abs(p), 1e-30), "projected": n}


def stats(ref: list[torch.Tensor], cand: list[torch.Tensor], steps: int) -> dict:
    """Sums.stats of paired lists of gradients."""
    sums = Sums()
    for g, c in zip(ref, cand):
        sums.add(g, c)
    return sums.stats(steps)


# The cut on z (Adam's coordinates) in units of the recipe's own noise: the one with the most right decisions (an
# admitted run that degraded counting twice) over the 208 stored runs of the built-in pairs (172 configurations,
# studies/data/gradient_bias_toys.jsonl, `python studies/gradient_bias.py --report ...`); each pair held out in turn
# in docs/admission.md, "Self-calibrated". Unitless: the same number on any model and recipe.
CUT = 2.88
SIGMAS = 1.0  # ADMIT needs z + SIGMAS * se <= CUT, REJECT z - SIGMAS * se > CUT; between them UNCERTAIN


def decide(numbers: dict, cut: float, sigmas: float = SIGMAS, mode: str = "adam",
           reject_sigmas: float | None = None) -> dict:
    """ADMIT / UNCERTAIN / REJECT from measure()'s numbers: z against the cut with its standard error (ADMIT needs
    z + sigmas * se <= cut, REJECT z - reject_sigmas * se > cut, reject_sigmas defaulting to sigmas), and for
    UNCERTAIN how many batches would decide (the standard error falls as 1 / sqrt(M))."""
    T, M = numbers["T"], numbers["M"]
    z = numbers[f"{mode}_z"]
    se = math.sqrt(T / 2) * numbers[f"{mode}_bias_se"] / max(numbers[f"{mode}_noise"], 1e-30)
    reject_sigmas = sigmas if reject_sigmas is None else reject_sigmas
    if z + sigmas * se <= cut:
        verdict = "ADMIT"
    elif z - reject_sigmas * se > cut:
        verdict = "REJECT"
    else:
        verdict = "UNCERTAIN"
    out = {"decision": verdict, "z": z, "z_se": se, "cut": cut, "sigmas": sigmas, "batches": M, "steps": T}
    if verdict == "UNCERTAIN":
        gap = abs(z - cut)
        out["batches_to_decide"] = math.ceil(M * (sigmas * se / gap) ** 2) if gap > 0 else None
    return out
