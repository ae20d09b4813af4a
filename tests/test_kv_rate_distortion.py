"""scripts/kv_rate_distortion.py, the measure behind docs/kv-compression.md's bound on bits an
element: its entropy count, its step search and its PCA coder, on tensors whose answers are known
(no model)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "kv_rate_distortion.py"


@pytest.fixture(scope="module")
def rd():
    spec = importlib.util.spec_from_file_location("kv_rate_distortion_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_entropy_counts_bits_of_each_lane_over_its_tokens(rd):
    t = 64
    flat = torch.zeros(2, 1, t, 3)  # one code everywhere: no information
    assert rd.entropy_bits(flat) == 0.0
    four = torch.arange(t).remainder(4).float()[None, None, :, None].expand(2, 1, t, 3)  # 4 codes, equal counts
    assert rd.entropy_bits(four) == pytest.approx(2.0)
    halves = torch.cat([torch.zeros(2, 1, t, 1), four[..., :1] * 7], dim=3)  # a lane of 0 bits beside one of 2
    assert rd.entropy_bits(halves) == pytest.approx(1.0)


def _correlated(n_chunks: int, seed: int) -> list[torch.Tensor]:
    """Chunks `[L=2, Hkv=2, T=128, D=16]` whose lanes mix 4 strong and 12 weak directions."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.linalg.qr(torch.randn(16, 16, generator=torch.Generator().manual_seed(99)))[0]
    scale = torch.tensor([8.0] * 4 + [0.3] * 12)
    return [(torch.randn(2, 2, 128, 16, generator=g) * scale) @ mix.T + 1.5 for _ in range(n_chunks)]


def test_the_basis_finds_the_strong_directions_and_fewer_bits_cost_more_error(rd):
    cal, test = _correlated(6, 0), _correlated(3, 1)
    basis = rd.fit_basis(cal)
    top = basis.vecs[..., :4]  # [L, Hkv, D, 4]: the fitted strong directions
    mix = torch.linalg.qr(torch.randn(16, 16, generator=torch.Generator().manual_seed(99)))[0]
    captured = (top.transpose(-1, -2) @ mix[:, :4]).pow(2).sum(dim=(-1, -2))  # 4 = the true subspace exactly
    assert torch.allclose(captured, torch.full_like(captured, 4.0), atol=0.05)
    errors = []
    for bits in (1.0, 2.0, 4.0):
        step = rd.step_for(cal, basis, bits=bits)
        coded = [rd.ecsq(x, basis, step) for x in test]
        got = sum(b for _, b in coded) / len(coded)
        assert abs(got - bits) < 0.25, (bits, got)  # tuned on other chunks, near the rate asked
        errors.append(sum(rd.relative_error(r, x) for (r, _), x in zip(coded, test, strict=True)) / len(test))
    assert errors[0] > errors[1] > errors[2] > 0
    # high-rate theory: each bit more divides the squared error by about 4, so 2 bits by about 16
    assert math.log2(errors[1] / errors[2]) / 2 > 1.2, errors


def test_a_step_can_be_found_for_an_error_as_well(rd):
    cal = _correlated(4, 2)
    basis = rd.fit_basis(cal)
    step = rd.step_for(cal, basis, error=0.01)
    err = sum(rd.relative_error(rd.ecsq(x, basis, step)[0], x) for x in cal) / len(cal)
    assert err == pytest.approx(0.01, rel=0.15)


def test_calibration_questions_may_not_be_reported_on(rd, tmp_path):
    with pytest.raises(SystemExit, match="overlaps"):
        rd.main([str(tmp_path / "x.json"), "--calib", "0:10", "--test", "5:20"])
    with pytest.raises(SystemExit, match="overlaps"):
        rd.main([str(tmp_path / "x.json"), "--calib", "3:10", "--test", "20:30", "--kl", "5"])
