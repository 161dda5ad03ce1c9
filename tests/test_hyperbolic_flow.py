"""hyperbolic_flow beyond the notebook's checks: gradients of the geometry, Poincaré-ball cross-check, the trainer's
determinism and device handling."""
import math

import pytest
import torch

from kimi_papers.architectures import hyperbolic_flow as H


def needs_cuda(fn):
    """Marked `gpu` (run by `pytest -m gpu`, see bench/gpu_check.sh) and skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(fn))


def _pts(n, d=5, s=0.8, k=0.6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return H.expmap0(torch.randn(n, d, generator=g, dtype=torch.float64) * s, k)


def test_distance_matches_poincare_ball_formula():
    """d_L equals the Poincaré-ball distance of the stereographic images (an independent formula)."""
    k = 0.6
    x, y = _pts(20, seed=1), _pts(20, seed=2)
    px, py = (p[:, 1:] / (1 + math.sqrt(k) * p[:, :1]) for p in (x, y))        # ball of radius 1/sqrt(k)
    num = 2 * k * ((px - py) ** 2).sum(-1)
    den = (1 - k * (px ** 2).sum(-1)) * (1 - k * (py ** 2).sum(-1))
    ref = torch.acosh(1 + num / den) / math.sqrt(k)
    torch.testing.assert_close(H.lorentz_dist(x, y, k), ref, rtol=1e-10, atol=1e-10)


def test_geometry_gradients():
    x0 = torch.randn(4, 5, dtype=torch.float64) * 0.5
    y0 = torch.randn(4, 5, dtype=torch.float64) * 0.5
    f = lambda a, b: H.lorentz_dist(H.expmap0(a, 0.8), H.expmap0(b, 0.8), 0.8)
    assert torch.autograd.gradcheck(f, (x0.requires_grad_(), y0.requires_grad_()))
    g = lambda a, b: H.geodesic(H.expmap0(a, 0.8), H.expmap0(b, 0.8), 0.3, 0.8)
    assert torch.autograd.gradcheck(g, (x0, y0))


def test_corridor_kernel_equals_loop_and_is_differentiable():
    xh, x0, anc = _pts(16, seed=3), _pts(16, seed=4), _pts(6, s=0.3, seed=5)
    t = torch.tensor(0.25, dtype=torch.float64)
    torch.testing.assert_close(H.corridor_dists(xh, x0, anc, t, 0.6), H.corridor_dists_loop(xh, x0, anc, 0.25, 0.6))
    a = xh.clone().requires_grad_()
    H.corridor_dists(a, x0, anc, t, 0.6).sum().backward()
    b = xh.clone().requires_grad_()
    H.corridor_dists_loop(b, x0, anc, 0.25, 0.6).sum().backward()
    torch.testing.assert_close(a.grad, b.grad)


def _task():
    text = torch.nn.functional.normalize(torch.randn(4, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64), dim=-1)
    return H.make_hierarchy_benchmark(text, torch.tensor([0, 0, 1, 1]), 3, 0.5, 0, n_test=5)


def test_hfm_training_is_seeded_and_uses_lift():
    task, cfg = _task(), H.FlowConfig(steps=6, blocks=1, width=16, path_loss=True, stopping="diameter")
    a, b = H.train_hfm(task, cfg, 1, warmup_steps=5), H.train_hfm(task, cfg, 1, warmup_steps=5)
    assert a.losses == b.losses and a.lift == b.lift
    assert a.lift.alpha_t <= 0.5 * a.lift.alpha_i
    out = a.predict(task.x_test)
    assert out.pred.shape == (20,) and out.path.shape == (11, 20, 9)
    assert (H.lorentz_inner(out.path, out.path) + 1 / a.geo.k).abs().max() < 1e-8
    plain = H.train_hfm(task, cfg, 1, centripetal=False)
    assert plain.lift == H.LiftParams(1.0, 1.0, 1.0)


def test_bad_inputs():
    with pytest.raises(ValueError, match="k:"):
        H.expmap0(torch.zeros(2, 3), -1.0)
    with pytest.raises(ValueError, match="t:"):
        H.geodesic(_pts(2), _pts(2, seed=1), 1.5, 0.6)
    with pytest.raises(ValueError, match="shots"):
        H.make_hierarchy_benchmark(torch.randn(4, 8), torch.tensor([0, 0, 1, 1]), 0, 0.5, 0)


@needs_cuda
def test_hfm_on_cuda():
    task = _task()
    cuda = H.FewShot(*(t.cuda() for t in (task.x_sup, task.y_sup, task.x_test, task.y_test, task.text, task.super_of)))
    m = H.train_hfm(cuda, H.FlowConfig(steps=3, blocks=1, width=16, path_loss=True, stopping="diameter"), 0, warmup_steps=3)
    out = m.predict(cuda.x_test)
    assert out.pred.device.type == "cuda"
    xh, x0, anc = (p.cuda() for p in (_pts(8), _pts(8, seed=1), _pts(3, seed=2)))
    t = torch.tensor(0.2, dtype=torch.float64, device="cuda")
    torch.testing.assert_close(H.corridor_dists_compiled(xh, x0, anc, t, 0.6), H.corridor_dists_loop(xh, x0, anc, 0.2, 0.6))
