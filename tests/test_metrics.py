"""Metrics on small hand-computed tensors."""
import math

import pytest
import torch

from opd.training.losses import kl
from opd.health.metrics import (distortion_metrics, exact_kl_metric, importance_metrics, mismatch_metrics, noise_to_signal,
                         rollout_metrics, staleness_metrics, truncation_metrics)

MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)


def logprobs(seed=0):
    return -torch.rand(2, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3


def test_identical_rollout_and_trainer_logprobs_have_no_mismatch():
    mu = logprobs()
    m = mismatch_metrics(mu, mu.clone(), MASK) | importance_metrics(mu, mu.clone(), MASK)
    assert m["mismatch/kl_k1"] == 0 and m["mismatch/kl_k3"] == 0 and m["mismatch/abs_dlogp_max"] == 0
    assert m["mismatch/prob_err"] == 1 and m["mismatch/chi2_token"] == 0
    assert m["is/ess"] == pytest.approx(5) and m["is/ess_frac"] == pytest.approx(1)  # N = 5 unmasked tokens
    assert m["is/w_mean"] == 1 and m["is/frac_outside"] == 0


@pytest.mark.parametrize("c", [0.1, -0.4, 0.9])
def test_a_known_shift_gives_the_known_values(c):
    mu = logprobs(1)
    q = mu + c
    q[0, 3] = 50.0  # masked: must not count
    m = mismatch_metrics(mu, q, MASK) | importance_metrics(mu, q, MASK)
    assert m["mismatch/kl_k1"] == pytest.approx(-c)
    assert m["mismatch/kl_k3"] == pytest.approx(math.exp(c) - c - 1)
    assert m["mismatch/abs_dlogp_mean"] == pytest.approx(abs(c)) and m["mismatch/abs_dlogp_max"] == pytest.approx(abs(c))
    assert m["mismatch/prob_err"] == pytest.approx(math.exp(abs(c)))
    assert m["mismatch/chi2_token"] == pytest.approx(math.exp(2 * c) - 1)
    assert m["is/w_max"] == pytest.approx(math.exp(c)) and m["is/ess"] == pytest.approx(5)
    assert m["is/frac_outside"] == (1.0 if math.exp(c) > 2 else 0.0)


def test_importance_weights_by_hand():
    mu = torch.zeros(1, 5, dtype=torch.float64)
    q = torch.log(torch.tensor([[1.0, 1.0, 1.0, 3.0, 99.0]], dtype=torch.float64))
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)
    m = importance_metrics(mu, q, mask, cap=2.0)
    assert m["is/ess"] == pytest.approx(36 / 12)  # (1+1+1+3)^2 / (1+1+1+9)
    assert m["is/ess_frac"] == pytest.approx(3 / 4)
    assert m["is/w_mean"] == pytest.approx(1.5) and m["is/w_min"] == pytest.approx(1) and m["is/w_max"] == pytest.approx(3)
    assert m["is/frac_outside"] == pytest.approx(1 / 4)


def test_p99_of_abs_dlogp():
    mu = torch.zeros(1, 100, dtype=torch.float64)
    q = -torch.arange(1, 101, dtype=torch.float64)[None]
    m = mismatch_metrics(mu, q, torch.ones(1, 100, dtype=torch.bool))
    assert m["mismatch/abs_dlogp_p99"] == pytest.approx(99.01)  # linear interpolation between 99 and 100
    assert m["mismatch/abs_dlogp_max"] == 100


def test_k3_is_an_unbiased_kl_estimate_on_samples_from_the_rollout_policy():
    """Statistical: 400k tokens drawn from p_rollout; k1 and k3 agree with the exact KL within 3e-3 (SE ~ 5e-4)."""
    g = torch.Generator().manual_seed(0)
    rollout = torch.randn(8, generator=g, dtype=torch.float64).log_softmax(-1)
    train = (rollout + 0.3 * torch.randn(8, generator=g, dtype=torch.float64)).log_softmax(-1)
    y = torch.multinomial(rollout.exp(), 400_000, replacement=True, generator=g)[None]
    m = mismatch_metrics(rollout[y], train[y], torch.ones_like(y, dtype=torch.bool))
    exact = exact_kl_metric(kl(rollout, train)[None, None], torch.ones(1, 1, dtype=torch.bool))
    assert exact["mismatch/kl_exact"] > 0.01
    assert m["mismatch/kl_k3"] == pytest.approx(exact["mismatch/kl_exact"], abs=3e-3)
    assert m["mismatch/kl_k1"] == pytest.approx(exact["mismatch/kl_exact"], abs=3e-3)


def test_exact_kl_matches_torch_distributions():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(2, 3, 6, generator=g).log_softmax(-1), torch.randn(2, 3, 6, generator=g).log_softmax(-1)
    mask = torch.tensor([[1, 0, 1], [1, 1, 1]], dtype=torch.bool)
    want = torch.distributions.kl_divergence(torch.distributions.Categorical(logits=a),
                                             torch.distributions.Categorical(logits=b))[mask].mean()
    assert exact_kl_metric(kl(a, b), mask)["mismatch/kl_exact"] == pytest.approx(want.item(), rel=1e-5)


def test_advantage_sign_flips_and_snr_by_hand():
    teacher = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    mu = torch.tensor([[-0.5, -1.5, -0.9, -2.0]])  # A_mu = -0.5, 0.5, -0.1, 1.0
    q = torch.tensor([[-0.5, -0.8, -1.2, -2.0]])  # A_q = -0.5, -0.2, 0.2, 1.0; |delta| = 0, 0.7, 0.3, 0
    m = distortion_metrics(teacher, mu, q, torch.ones(1, 4, dtype=torch.bool))
    assert m["opd/adv_sign_flip"] == pytest.approx(0.5)
    assert m["opd/adv_snr"] == pytest.approx((0.5 + 0.2 + 0.2 + 1.0) / 4 / ((0.7 + 0.3) / 4))
    assert distortion_metrics(teacher, q, q, torch.ones(1, 4, dtype=torch.bool))["opd/adv_snr"] == math.inf
    assert m["opd/nsr"] == pytest.approx((0.7 + 0.3) / (0.5 + 0.2 + 0.2 + 1.0))  # the inverse, 0 without mismatch
    assert distortion_metrics(teacher, q, q, torch.ones(1, 4, dtype=torch.bool))["opd/nsr"] == 0.0
    assert noise_to_signal(teacher, mu, q, torch.tensor([[True, True, False, False]])) == pytest.approx(0.7 / 0.7)
    assert noise_to_signal(q, mu, q, torch.ones(1, 4, dtype=torch.bool)) == math.inf  # no signal, some mismatch


def test_staleness_and_rollout_metrics():
    q = torch.zeros(1, 2, dtype=torch.float64)
    pi = torch.tensor([[0.2, -0.2]], dtype=torch.float64)
    m = staleness_metrics([3, 5, 4.5], current=5, q=q, pi=pi, mask=torch.ones(1, 2, dtype=torch.bool))
    assert m["stale/version_gap_mean"] == pytest.approx(2.5 / 3) and m["stale/version_gap_max"] == 2
    assert m["stale/upd_kl_k3"] == pytest.approx((math.exp(0.2) - 1.2 + math.exp(-0.2) - 0.8) / 2)
    r = rollout_metrics([10, 20, 30], [False, False, True])
    assert r == {"rollout/length_mean": 20, "rollout/length_max": 30, "rollout/truncated": pytest.approx(1 / 3)}


def test_truncation_metrics_by_hand():
    """s = mu - u = -log(kept mass): a top-p that kept half the mass raises the sampler's log-prob by log 2."""
    mu = torch.tensor([[-0.2, -1.0, 0.0]])
    u = torch.tensor([[-0.2 - math.log(2), -1.0 - math.log(4), -5.0]])  # the last token is masked out below
    mask = torch.tensor([[True, True, False]])
    m = truncation_metrics(mu, u, mask)
    assert m["sampling/kept_mass"] == pytest.approx((0.5 + 0.25) / 2)
    assert m["sampling/shift_mean"] == pytest.approx((math.log(2) + math.log(4)) / 2)
    assert m["sampling/kl_k3"] == pytest.approx(((0.5 - 1 + math.log(2)) + (0.25 - 1 + math.log(4))) / 2)
    assert truncation_metrics(mu, mu, mask) == {"sampling/kept_mass": 1.0, "sampling/shift_mean": 0.0,
                                                "sampling/kl_k3": 0.0}
