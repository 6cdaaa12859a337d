"""OPD losses: what the student minimises on its own rollouts, given the teacher's log-probs.

Notation, per generated position t (mask m_t; every mean is over the masked tokens of the whole batch):
`s_t(v)` the learner's log-probs (with gradient), `T_t(v)` the teacher's, `p = exp(s)`, `y_t` the sampled token,
`mu_t` the sampler's log-prob of `y_t`, and `w_t = exp(sg(s_t(y_t)) - mu_t)` the learner-vs-rollout importance
ratio. `sg` is stop-gradient. In the synchronous schedule the learner's weights are the ones that sampled, so `w_t`
is the numerics ratio `exp(q_t - mu_t)`; under staleness it also carries the policy change since sampling, which is
the ratio that makes the estimate below unbiased for the current policy when `y ~ mu`.

- `sampled_rkl`: the sampled-token reverse KL as a policy-gradient advantage (tinker-cookbook, AsyncOPD):
      A_t = T_t(y_t) - b_t,   b_t = mu_t (student_term "sampler") or sg(s_t(y_t)) (student_term "learner")
      L = -mean_t c_t A_t s_t(y_t)
  with c_t = 1 (correction "none"), TIS c_t = min(w_t, C), or MIS c_t = 1[1/C <= w_t <= C], both detached.
  With b = sg(s) and y ~ pi its gradient is a one-sample estimate of grad KL(pi || T), because
  E_y[(log pi(y) - T(y)) grad log pi(y)] = grad KL(pi || T) (the term E_y[grad log pi(y)] is zero). The value of
  L is a surrogate; the estimate of the reverse KL itself is reported as `loss/rkl_sampled` = mean(s(y) - T(y)).
- `full_rkl`: KL(pi_t || T_t) = sum_v p(v) (s(v) - T(v)) at every position: exact, no sampling noise.
- `topk_rkl`: the same on the k most likely tokens S_t of the student (sg) or of the teacher, both distributions
  renormalised on S_t: sum_{v in S} p~(v) (s~(v) - T~(v)), s~ = s - logsumexp_S(s).
- `fkl`: forward KL(T_t || pi_t) = sum_v p_T(v) (T(v) - s(v)).
- `topk_fkl`, `topk_rkl_tail`: what a teacher served by an inference engine allows, which returns only its k most
  likely tokens S_t and their log-probs (verl, TRL, slime): the forward or reverse KL between the two distributions
  coarsened to k + 1 outcomes, each token of S_t and one tail bucket for the rest,
      topk_fkl       sum_{v in S} p_T(v) (T(v) - s(v)) + T_tail (log T_tail - log p_tail)
      topk_rkl_tail  sum_{v in S} p(v) (s(v) - T(v)) + p_tail (log p_tail - log T_tail)
  with T_tail = 1 - sum_S p_T (from the k log-probs alone) and p_tail = 1 - sum_S p (the learner's, exact:
  logsumexp over the complement). Coarsening never increases a KL, and S for k + 1 refines S for k, so each is at
  most its full-vocabulary loss and grows with k to it (equal at k = V; tests).
- `jsd`: generalised Jensen-Shannon (GKD) JSD_beta = beta KL(T || M) + (1 - beta) KL(pi || M),
  M = beta p_T + (1 - beta) p, for 0 < beta < 1 (its limits are the forward and reverse KL, up to scale).
The full-distribution losses need the learner's and teacher's whole distributions at each position, which a
trainer has (it runs both models, a chunk of positions at a time: chunked.py); only the sampled-token loss sees the
sampler's `mu`.

**Gradients in closed form** (`logit_gradient`). With logits z and s = log_softmax(z / tau) (tau: the training
temperature), ds(v)/dz(u) = (1[u = v] - p(u)) / tau, so for one position:
      full_rkl     dL/dz(u) = p(u) (s(u) - T(u) - L) / tau                    (L = sum_v p(v) (s(v) - T(v)))
      fkl          dL/dz(u) = (p(u) - p_T(u)) / tau                           (sum_v p_T(v) = 1)
      sampled_rkl  dL/dz(u) = c A (p(u) - 1[u = y]) / tau                     (c, A detached)
chunked.py uses them for these three losses: a few passes over [chunk, V] instead of autograd's graph through
log_softmax and the KL (about twice as many, each allocating). jsd and topk_rkl go through autograd. Tests hold both
to the whole-batch `opd_loss` and its autograd gradient in float64.
"""
import math

import torch
  # the loss section of the training config (its names and checks)
from opd.io.errors import require
from opd.health.metrics import masked_mean
from opd.config.sections import LossConfig

CLOSED_FORM = ("full_rkl", "fkl", "sampled_rkl")  # losses whose logit gradient logit_gradient() computes


def kl(logp_a: torch.Tensor, logp_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) over the last dim from log-probs [..., V]; entries with p_a = 0 contribute 0 (-inf is allowed)."""
    terms = logp_a.exp() * (logp_a - logp_b)
    return torch.where(logp_a > float("-inf"), terms, torch.zeros_like(terms)).sum(-1)


def importance_coef(mu: torch.Tensor, learner: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """c_t of the sampled-token loss: 1, min(w, C) (TIS) or 1[1/C <= w <= C] (MIS), with w = exp(learner - mu)."""
    w = torch.exp(learner - mu)
    if cfg.correction == "tis":
        return w.clamp(max=cfg.cap)
    if cfg.correction == "mis":
        return ((w >= 1 / cfg.cap) & (w <= cfg.cap)).to(w.dtype)
    return torch.ones_like(w)


def topk_rkl(student_logp: torch.Tensor, teacher_logp: torch.Tensor, k: int, support: str) -> torch.Tensor:
    """Reverse KL on the renormalised top-k support of the student (sg) or teacher: [..., V] -> [...]."""
    k = min(k, student_logp.shape[-1])
    idx = (student_logp.detach() if support == "student" else teacher_logp).topk(k, dim=-1).indices
    s, t = student_logp.gather(-1, idx), teacher_logp.gather(-1, idx)
    return kl(s.log_softmax(-1), t.log_softmax(-1))


def topk_tail_kl(student_logp: torch.Tensor, teacher_logp: torch.Tensor, k: int, forward: bool) -> torch.Tensor:
    """KL between the student's and the teacher's distributions coarsened to the teacher's top-k tokens and one tail
    bucket (forward: KL(T || pi), else KL(pi || T)); the teacher's tail mass comes from its k log-probs only."""
    V = student_logp.shape[-1]
    if k >= V:
        return kl(teacher_logp, student_logp) if forward else kl(student_logp, teacher_logp)
    idx = teacher_logp.topk(k, dim=-1).indices
    s, t = student_logp.gather(-1, idx), teacher_logp.gather(-1, idx)
    outside = torch.ones_like(student_logp, dtype=torch.bool).scatter_(-1, idx, False)
    s_tail = student_logp.masked_fill(~outside, float("-inf")).logsumexp(-1)  # log p_tail, exact
    t_tail_mass = (1 - t.exp().sum(-1)).clamp(min=0)  # what the k log-probs leave; rounding can make it negative
    t_tail = t_tail_mass.clamp(min=torch.finfo(t.dtype).tiny).log()
    if forward:
        head = (t.exp() * (t - s)).sum(-1)
        tail = t_tail_mass * (t_tail - s_tail)
    else:
        head = (s.exp() * (s - t)).sum(-1)
        tail = s_tail.exp() * (s_tail - t_tail)
    return head + tail


def jsd(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float) -> torch.Tensor:
    """Generalised JSD_beta = beta KL(T || M) + (1 - beta) KL(pi || M), M = beta p_T + (1 - beta) p: [..., V] -> [...]."""
    log_m = torch.logsumexp(torch.stack([teacher_logp + math.log(beta), student_logp + math.log(1 - beta)]), dim=0)
    return beta * kl(teacher_logp, log_m) + (1 - beta) * kl(student_logp, log_m)


def token_losses(cfg: LossConfig, student_logp: torch.Tensor, teacher_logp: torch.Tensor, tokens: torch.Tensor,
                 mu: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per generated position, for log-probs [..., V] and tokens, mu [...]: "loss" (with the gradient of
    student_logp), and, detached, "s_y" and "t_y" (the student's and teacher's log-prob of the sampled token) and for
    sampled_rkl "advantage" and "coef". Positions are independent: any chunk of them gives the same values."""
    s_y = student_logp.gather(-1, tokens[..., None])[..., 0]
    t_y = teacher_logp.gather(-1, tokens[..., None])[..., 0]
    out = {"s_y": s_y.detach(), "t_y": t_y}
    if cfg.name == "sampled_rkl":
        baseline = mu if cfg.student_term == "sampler" else s_y.detach()
        advantage, coef = t_y - baseline, importance_coef(mu, s_y.detach(), cfg)
        return out | {"loss": -coef * advantage * s_y, "advantage": advantage, "coef": coef}
    if cfg.name == "full_rkl":
        return out | {"loss": kl(student_logp, teacher_logp)}
    if cfg.name == "topk_rkl":
        return out | {"loss": topk_rkl(student_logp, teacher_logp, cfg.topk, cfg.topk_support)}
    if cfg.name == "fkl":
        return out | {"loss": kl(teacher_logp, student_logp)}
    if cfg.name in ("topk_fkl", "topk_rkl_tail"):
        return out | {"loss": topk_tail_kl(student_logp, teacher_logp, cfg.topk, cfg.name == "topk_fkl")}
    require(cfg.name == "jsd", f"unknown loss {cfg.name!r}", "use one of the losses LossConfig names")  # never fall through
    return out | {"loss": jsd(student_logp, teacher_logp, cfg.jsd_beta)}


def logit_gradient(cfg: LossConfig, student_logp: torch.Tensor, teacher_logp: torch.Tensor, tokens: torch.Tensor,
                   mu: torch.Tensor, temperature: float) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
    """For full_rkl, fkl and sampled_rkl: (token_losses' terms, without a graph; dL_t/dz_t [..., V], the gradient of
    each position's loss with respect to its logits, module docstring). None for the losses left to autograd."""
    if cfg.name not in CLOSED_FORM:
        return None
    p = student_logp.exp()
    if cfg.name == "sampled_rkl":
        terms = token_losses(cfg, student_logp, teacher_logp, tokens, mu)
        ca = (terms["coef"] * terms["advantage"])[..., None]
        grad = (p * ca).scatter_add_(-1, tokens[..., None], -ca)
    else:
        terms = {"s_y": student_logp.gather(-1, tokens[..., None])[..., 0],
                 "t_y": teacher_logp.gather(-1, tokens[..., None])[..., 0]}
        if cfg.name == "full_rkl":
            d = student_logp - teacher_logp
            terms["loss"] = (p * d).sum(-1)
            grad = d.sub_(terms["loss"][..., None]).mul_(p)  # in place: d is not needed again
        else:
            q = teacher_logp.exp()
            terms["loss"] = (q * (teacher_logp - student_logp)).sum(-1)
            grad = p.sub_(q)
    return terms, grad if temperature == 1 else grad.div_(temperature)


def loss_metrics(terms: dict[str, torch.Tensor], mask: torch.Tensor) -> dict:
    """The "loss/..." metrics of per-token terms (token_losses' keys) over the masked positions."""
    mask = mask.to(terms["s_y"].dtype)
    out = {"loss/value": masked_mean(terms["loss"].detach(), mask).item(),
           "loss/rkl_sampled": masked_mean(terms["s_y"] - terms["t_y"], mask).item()}
    if "advantage" in terms:
        out |= {"loss/advantage_mean": masked_mean(terms["advantage"], mask).item(),
                "loss/coef_mean": masked_mean(terms["coef"], mask).item()}
    return out


def opd_loss(cfg: LossConfig, student_logp: torch.Tensor, teacher_logp: torch.Tensor, tokens: torch.Tensor,
             mu: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """student_logp, teacher_logp [B, T, V]; tokens, mu, mask [B, T] -> (scalar loss, {"loss/...": float}).

    mask is 1 on generated tokens. student_logp carries the gradient; everything else is treated as data. This is
    the whole-batch form: the oracle of chunked.py's, which never holds [B, T, V]."""
    B, T, V = student_logp.shape
    assert teacher_logp.shape == (B, T, V) and tokens.shape == mu.shape == mask.shape == (B, T)
    terms = token_losses(cfg, student_logp, teacher_logp, tokens, mu)
    loss = masked_mean(terms["loss"], mask.to(student_logp.dtype))
    return loss, loss_metrics(terms, mask)
