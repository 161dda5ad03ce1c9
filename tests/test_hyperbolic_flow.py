"""hyperbolic_flow beyond the notebook's checks: gradients of the geometry, Poincaré-ball cross-check, the trainer's
determinism and device handling."""
import math

import pytest
import torch

from kimi_papers.architectures import hyperbolic_flow as H
from kimi_papers.architectures import hyperbolic_flow_experiment as X


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
    return X.make_hierarchy_benchmark(text, torch.tensor([0, 0, 1, 1]), 3, 0.5, 0, n_test=5)


def test_hfm_training_is_seeded_and_uses_lift():
    task, cfg = _task(), H.FlowConfig(steps=6, blocks=1, width=16, path_loss=True, stopping="diameter")
    a, b = X.train_hfm(task, cfg, 1, warmup_steps=5), X.train_hfm(task, cfg, 1, warmup_steps=5)
    assert a.losses == b.losses and a.lift == b.lift
    assert a.lift.alpha_t <= 0.5 * a.lift.alpha_i
    out = a.predict(task.x_test)
    assert out.pred.shape == (20,) and out.path.shape == (11, 20, 9)
    assert (H.lorentz_inner(out.path, out.path) + 1 / a.geo.k).abs().max() < 1e-8
    plain = X.train_hfm(task, cfg, 1, centripetal=False)
    assert plain.lift == H.LiftParams(1.0, 1.0, 1.0)


def test_bad_inputs():
    with pytest.raises(ValueError, match="k:"):
        H.expmap0(torch.zeros(2, 3), -1.0)
    with pytest.raises(ValueError, match="t:"):
        H.geodesic(_pts(2), _pts(2, seed=1), 1.5, 0.6)
    with pytest.raises(ValueError, match="shots"):
        X.make_hierarchy_benchmark(torch.randn(4, 8), torch.tensor([0, 0, 1, 1]), 0, 0.5, 0)


@needs_cuda
def test_hfm_on_cuda():
    task = _task()
    cuda = X.FewShot(*(t.cuda() for t in (task.x_sup, task.y_sup, task.x_test, task.y_test, task.text, task.super_of)))
    m = X.train_hfm(cuda, H.FlowConfig(steps=3, blocks=1, width=16, path_loss=True, stopping="diameter"), 0, warmup_steps=3)
    out = m.predict(cuda.x_test)
    assert out.pred.device.type == "cuda"
    xh, x0, anc = (p.cuda() for p in (_pts(8), _pts(8, seed=1), _pts(3, seed=2)))
    t = torch.tensor(0.2, dtype=torch.float64, device="cuda")
    torch.testing.assert_close(H.corridor_dists_compiled(xh, x0, anc, t, 0.6), H.corridor_dists_loop(xh, x0, anc, 0.2, 0.6))


def test_clipping_warns_and_domain_is_accurate():
    """MAX_NORM clipping is never silent; inside ACCURATE_RADIUS the exp/log round trip keeps its digits, beyond it not."""
    import warnings
    with pytest.warns(H.LorentzDomainWarning, match="MAX_NORM"):
        H.expmap0(torch.tensor([[20.0, 0.0]], dtype=torch.float64), 1.0)
    o = H.expmap0(torch.zeros(1, 2, dtype=torch.float64), 1.0)
    with pytest.warns(H.LorentzDomainWarning, match="clipped"):
        H.expmap(o, torch.tensor([[0.0, 16.0, 0.0]], dtype=torch.float64), 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", H.LorentzDomainWarning)
        H.expmap0(torch.tensor([[14.0, 0.0]], dtype=torch.float64), 1.0)     # just inside the cap: no warning

    def roundtrip(r, dtype):
        g = torch.Generator().manual_seed(0)
        u = lambda: torch.nn.functional.normalize(torch.randn(64, 8, generator=g, dtype=torch.float64), dim=-1) * r
        vx, vy = u(), u()
        x, y = H.expmap0(vx.to(dtype), 1.0), H.expmap0(vy.to(dtype), 1.0)
        back = H.expmap(x, H.logmap(x, y, 1.0), 1.0)
        return float(((H.logmap0(back.double(), 1.0) - vy).norm(dim=-1) / r).max())
    assert roundtrip(H.ACCURATE_RADIUS[torch.float64], torch.float64) < 1e-5
    assert roundtrip(H.ACCURATE_RADIUS[torch.float32], torch.float32) < 1e-3
    assert roundtrip(7.0, torch.float64) > 1e-6 and roundtrip(4.0, torch.float32) > 1e-3
    with pytest.warns(H.LorentzDomainWarning, match="radius"):
        H.lift(torch.full((2, 3), 4.0, dtype=torch.float64), 1.0, 1.0)      # sqrt(3) * 4 ~ 6.9 > 6
    pts = H.expmap0(torch.tensor([[3.0, 4.0]], dtype=torch.float64), 0.25)
    assert float(H.radius(pts, 0.25)) == pytest.approx(2.5)


def test_run_task_trains_each_arm_at_its_own_lr():
    task, cfg = _task(), H.FlowConfig(steps=4, blocks=1, width=16)
    rows = X.run_task(task, cfg, 0, ablations=True, warmup_steps=3, lrs={"FMA": 1e-3, "HFM": 3e-3})
    lr = {r["arm"]: r.get("lr") for r in rows}
    assert lr["FMA"] == 1e-3 and lr["HFM"] == 3e-3 and lr["Euclid + path losses"] == cfg.lr
    assert lr["HFM fixed steps"] == 3e-3                                    # the HFM net, re-integrated
    assert all(r["max_radius"] <= H.ACCURATE_RADIUS[torch.float64] for r in rows if "max_radius" in r)
    with pytest.raises(ValueError, match="unknown arms"):
        X.run_task(task, cfg, 0, lrs={"GPT": 1e-3})


def test_tune_lrs_extends_at_the_edge(monkeypatch):
    """A pick at the grid's edge adds one ratio step that way (for every arm alike); an interior pick stops."""
    text = torch.nn.functional.normalize(torch.randn(4, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64), dim=-1)
    best = {"FMA": 1e-2, "HFM": 1e-3}                           # FMA improves up to 1e-2, HFM peaks inside the grid

    class _Fake:
        def __init__(self, arm, lr):
            self.arm, self.lr = arm, lr

        def predict(self, x, rule):
            n = len(x)
            acc = max(0.0, 1 - abs(math.log10(self.lr / best[self.arm])) / 3)
            return type("P", (), {"pred": torch.tensor([0] * round(acc * n) + [1] * (n - round(acc * n)))})()
    monkeypatch.setattr(X, "train_arm", lambda arm, task, cfg, seed, w=200: (_Fake(arm, cfg.lr), "dist"))
    monkeypatch.setattr(X, "make_hierarchy_benchmark", lambda *a, **k: type("T", (), {
        "x_test": torch.zeros(100, 8), "y_test": torch.zeros(100, dtype=torch.long)})())
    table, lrs = X.tune_lrs(text, torch.tensor([0, 0, 1, 1]), H.FlowConfig(), [1e-4, 10 ** -3.5, 1e-3], 100, [4], 0.5,
                            arms=("FMA", "HFM"), max_extend=2)
    assert lrs["HFM"] == pytest.approx(1e-3) and len(table[table.arm == "HFM"]) == 4      # one step up, then interior
    assert lrs["FMA"] == pytest.approx(1e-2, rel=1e-3) and len(table[table.arm == "FMA"]) == 5      # two steps up (the cap)
    with pytest.raises(ValueError, match="grid"):
        X.tune_lrs(text, torch.tensor([0, 0, 1, 1]), H.FlowConfig(), [1e-3], 100, [4], 0.5)


def test_moved_harness_names_resolve_with_a_warning():
    """Names that moved to hyperbolic_flow_experiment in the module split still import from hyperbolic_flow (deprecated)."""
    with pytest.warns(DeprecationWarning, match="hyperbolic_flow_experiment"):
        assert H.train_hfm is X.train_hfm and H.run_experiment is X.run_experiment
    with pytest.raises(AttributeError, match="no_such_name"):
        H.no_such_name
