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
REJECT against one unitless cut. Memory: five float32 vectors the size of the student on the CPU (20 bytes a
parameter; `Sums`).

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
(studies/progress_deficit.py; docs/admission-results.md, "The progress share r"). Its cost: a chunk's temporaries
while a pair is added.
"""
import math
import shutil
from pathlib import Path

import torch

from opd.io.errors import require
from opd.models.devices import available_memory


class Sums:
    """Per-coordinate running sums of g, g^2, c^2, d, d^2: every statistic is a sum over coordinates of these, so M
    gradients of a student need five vectors, not 2M.

    Memory: the sums are float32 on the CPU (a sum of M terms loses nothing float32 holds here; every sum over
    coordinates is taken in float64), 20 bytes a parameter, wherever the gradients live (a GPU's memory holds none of
    them); add() and stats() work a chunk of coordinates at a time, so no float64 vector of the student's size is ever
    made (before session 40: float64 sums and whole-vector temporaries, ~70 bytes a parameter at the peak, which an
    0.5B student did not fit in 24 GiB). `bytes_needed` is what a caller checks before it starts.

    successive: the pairs come from a running training run (canary.py), whose weights move between pairs, so var(g)
    over the pairs would count the drift of the mean gradient along the run as noise; the noise is then taken from
    successive differences, |g_i - g_{i-1}|^2 / 2 (what one step's drift adds is small beside a batch's noise), which
    costs two more vectors (the last g and the sum)."""
    CHUNK = 1 << 22  # coordinates a step of add() and stats() works on (float64 temporaries of 32 MB each)

    def __init__(self, successive: bool = False, spill: str | Path | None = None):
        self.M, self.sums, self.successive, self.spill = 0, None, successive, spill
        self.projections: list[tuple[float, float]] = []  # (p_i, q_i) of pairs 2..M (module docstring)

    def _zeros(self, size: int, k: int) -> torch.Tensor:
        """A float32 vector of zeros: in memory, or with `spill` a file in that folder mapped into memory (the
        kernel writes its pages out and drops them under pressure: a student whose sums do not fit in memory)."""
        if self.spill is None:
            return torch.zeros(size, dtype=torch.float32)
        path = Path(self.spill) / f"sums{k}.f32"
        with open(path, "wb") as f:
            f.truncate(4 * size)  # sparse: zeros that take no disk until written
        return torch.from_file(str(path), shared=True, size=size, dtype=torch.float32)

    @staticmethod
    def bytes_needed(size: int, successive: bool = False) -> int:
        """The sums' memory for gradients of `size` coordinates (float32 vectors on the CPU)."""
        return (7 if successive else 5) * 4 * size

    def add(self, g: torch.Tensor, c: torch.Tensor) -> None:
        if self.sums is None:
            self.sums = [self._zeros(g.numel(), k) for k in range(7 if self.successive else 5)]
        p = q = 0.0
        for start in range(0, g.numel(), self.CHUNK):
            part = slice(start, start + self.CHUNK)
            gc, cc = (x[part].to("cpu", torch.float64) for x in (g, c))
            dc = cc - gc
            sg, sgg, scc, sd, sdd = (x[part] for x in self.sums[:5])
            if self.M:  # the progress share: this pair on the descent of the pairs before it (module docstring)
                h = (sgg.double() + scc).div_(2 * self.M).sqrt_().add_(1e-8).reciprocal_().mul_(sg).div_(self.M)
                p += torch.dot(h, gc).item()
                q += torch.dot(h, dc).item()
            sg += gc
            sgg += gc * gc
            scc += cc * cc
            sd += dc
            sdd += dc * dc
            if self.successive:
                last, total = self.sums[5][part], self.sums[6][part]
                if self.M:
                    total += (gc - last) ** 2
                last.copy_(gc)
        if self.M:
            self.projections.append((p, q))
        self.M += 1

    def state_dict(self) -> dict:
        """What a checkpoint keeps (canary training resumes its measurement exactly)."""
        return {"M": self.M, "sums": list(self.sums) if self.sums is not None else [],
                "projections": [list(x) for x in self.projections]}

    @classmethod
    def from_state(cls, saved, size: int, successive: bool = False) -> "Sums | None":
        """state_dict()'s output for gradients of `size` coordinates, or None where it is not one (a checkpoint from
        before session 40 holds float64 sums: read as float32)."""
        sums = saved.get("sums") if isinstance(saved, dict) else None
        M = saved.get("M") if isinstance(saved, dict) else None
        n = 7 if successive else 5
        if not isinstance(M, int) or isinstance(M, bool) or M < 0 or not isinstance(sums, list) or \
                len(sums) != (n if M else 0) or not all(isinstance(t, torch.Tensor)
                                                         and t.dtype in (torch.float32, torch.float64)
                                                         and t.shape == (size,) and bool(torch.isfinite(t).all())
                                                         for t in sums):
            return None
        projections = saved.get("projections", [])  # (checkpoints before session 39 have none: they restart it)
        if not isinstance(projections, list) or not all(
                isinstance(x, list) and len(x) == 2 and all(isinstance(v, float) and math.isfinite(v) for v in x)
                for x in projections) or len(projections) > max(M - 1, 0):
            return None
        out = cls(successive)
        out.M, out.projections = M, [tuple(x) for x in projections]
        out.sums = [t.to("cpu", torch.float32) for t in sums] or None
        return out

    def stats(self, steps: int) -> dict:
        """bias, noise and z (module docstring), raw and in AdamW's coordinates."""
        M = self.M
        # per space: sum over coordinates of var(d) * w, of the noise * w, of |mean d|^2 * w (float64, a chunk at a time)
        acc = {name: [0.0, 0.0, 0.0] for name in ("raw", "adam")}
        for start in range(0, self.sums[0].numel(), self.CHUNK):
            part = slice(start, start + self.CHUNK)
            sg, sgg, scc, sd, sdd = (x[part].double() for x in self.sums[:5])
            # Adam's denominator, pooled over both rollouts' gradients (a coordinate only the candidate's rollouts
            # reach, an embedding row of a token BF16 never sampled, is not divided by ~0) plus AdamW's eps
            scale = ((sgg + scc) / (2 * M)).sqrt() + 1e-8
            noise = self.sums[6][part].double() if self.successive else sgg - sg * sg / M
            terms = (sdd - sd * sd / M, noise, (sd / M).pow(2))
            for name, w in {"raw": None, "adam": scale.pow(-2)}.items():
                for k, x in enumerate(terms):
                    acc[name][k] += (x if w is None else x * w).sum().item()
        out = {"M": M, "T": steps}
        for name, (var_d, noise2, mean_d2) in acc.items():
            var_d /= M - 1
            noise2 /= (2 if self.successive else 1) * (M - 1)
            bias2 = mean_d2 - var_d / M
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


def record_text(record: dict) -> str:
    """A rule's record (RECORD, trial.TRIAL_RECORD) in words: how often its ADMIT and REJECT were wrong."""
    parts = lambda n, of: ", ".join(f"{x[n]} of {x[of]} on {x['what']}" for x in record.values()  # noqa: E731
                                    if x[of])  # (a study where it never decided so is left out)
    return (f"; the rule's record on stored runs: ADMIT was wrong (the run degraded) for "
            f"{parts('admitted_degraded', 'admitted')}; REJECT was wrong (the run trained fine) for "
            f"{parts('rejected_fine', 'rejected')} (docs/admission-results.md)")


def check_spill(spill: str | Path) -> None:
    """A folder for Sums' files (`--spill`): refused in one line where it is not one."""
    require(Path(spill).is_dir(), f"--spill {spill}: not a folder", "name an existing folder on a local disk")


def require_memory(student: torch.nn.Module, successive: bool, what: str, fix: str,
                   spill: str | Path | None = None) -> None:
    """Refuse, before any work, a measurement whose sums (and, for a student on the CPU, the pair of float32 gradients
    and the one being flattened) do not fit the memory this machine has left: the kernel would otherwise kill the
    process minutes in, with no message. With `spill` (a folder: the sums in files there) the sums need its disk
    instead."""
    size = sum(p.numel() for p in student.parameters())
    on_cpu = next(student.parameters()).device.type == "cpu"
    sums = Sums.bytes_needed(size, successive)
    need = (0 if spill else sums) + (3 * 4 * size if on_cpu else 0)
    free = available_memory()
    parts = [] if spill else [f"{7 if successive else 5} float32 sums"]
    parts += ["its gradients"] if on_cpu else []
    require(need <= free, f"{what} needs about {need / 2 ** 30:.1f} GiB more for a student of {size / 1e6:.0f}M "
            f"parameters ({' and '.join(parts)}), and this machine has {free / 2 ** 30:.1f} GiB available", fix)
    if spill:
        check_spill(spill)
        disk = shutil.disk_usage(spill).free
        require(sums <= disk, f"--spill {spill}: the sums need {sums / 2 ** 30:.1f} GiB of disk and it has "
                f"{disk / 2 ** 30:.1f} GiB free", "name a folder on a disk with room")


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
# The rule's record where it was not fitted, three ways at CUT and SIGMAS (the error rate `opd admit --self`
# states): `python studies/gradient_bias.py --report studies/data/gradient_bias_toys.jsonl,studies/data/
# gradient_bias_smollm2.jsonl,studies/data/progress_qwen_spill.jsonl --record` (tests/test_study.py recomputes it from
# those files). Each built-in pair is decided by the cut fitted on the other; the real pairs' studies by the built-in
# pairs' cut (this CUT).
RECORD = {
    "built-in": {"what": "the built-in pairs (each by the other's cut)", "runs": 208, "admitted": 93,
                 "admitted_degraded": 3, "rejected": 35, "rejected_fine": 6},
    "real smollm2": {"what": "the smollm2 pair at lr 1e-4 (never fitted)", "runs": 17, "admitted": 13,
                     "admitted_degraded": 0, "rejected": 2, "rejected_fine": 2},
    "real smollm2 lr 3e-5": {"what": "the smollm2 pair at lr 3e-5 (never fitted)", "runs": 23, "admitted": 21,
                             "admitted_degraded": 8, "rejected": 0, "rejected_fine": 0},
    "real qwen2.5-coder lr 1e-5": {"what": "the Qwen2.5-Coder pair at lr 1e-5 (never fitted)", "runs": 3,
                                   "admitted": 3, "admitted_degraded": 0, "rejected": 0, "rejected_fine": 0},
}


def chance_other_side(z: float, se: float, cut: float) -> float:
    """The chance that the measurement's noise put z on the other side of the cut from where the true value lies (z
    taken as normal with standard deviation se): the measurement's own error rate, apart from the rule's record."""
    if se <= 0:
        return 0.0
    return 0.5 * math.erfc(abs(z - cut) / se / math.sqrt(2))


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
