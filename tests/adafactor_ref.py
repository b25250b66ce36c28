"""Adafactor's first update re-computed from the paper's equations (Shazeer & Stern 2018, Alg. 4 with relative
step sizes, beta1 = 0), written apart from torch's code (sums, not means; float64) but with torch's epsilons (eps1 =
fp32 eps, clamped as eps1^2 on V; the paper's eps1 is 1e-30): tests/test_train.py and the DeepSpeed worker
tests/workers/embedding_lr.py compare the recipe's optimizer against it. Only the first step: there the second
moment's decay (beta2_hat = 0) and the 1/sqrt(t) cap do not act yet, so those are torch's, untested here."""
import torch

EPS1, EPS2, D = torch.finfo(torch.float32).eps, 1e-3, 1.0  # torch's defaults (eps=(None, 1e-3), d=1)


def adafactor_first_update(theta: torch.Tensor, grad: torch.Tensor, lr: float) -> torch.Tensor:
    """theta_1 - theta_0 at t = 1: beta2_hat = 1 - 1^tau = 0, so the second moment is this step's G^2, factored
    for a matrix into row sums R and column sums C (V = R C^T / sum R); U = G / sqrt(V), clipped to RMS <= d;
    the step is rho_1 = min(lr, 1/sqrt(1)) times max(eps2, RMS(theta_0))."""
    theta, g = theta.double(), grad.double()
    g2 = g * g
    if g.dim() == 2:
        rows, cols = g2.sum(dim=1, keepdim=True), g2.sum(dim=0, keepdim=True)
        v = rows @ cols / rows.sum().clamp(min=EPS1)
    else:
        v = g2
    u = g / v.clamp(min=EPS1 * EPS1).sqrt()
    u = u / max(1.0, (u.pow(2).mean().sqrt() / D).item())
    alpha = max(EPS2, theta.pow(2).mean().sqrt().item()) * min(lr, 1.0)
    return (-alpha * u).float()
