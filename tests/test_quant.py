"""Low-precision formats (flowrl.quant) against hand-computed numbers (ALGORITHMS §4.4 / §11 item 9), torch's own
float8_e4m3fn cast, and a second implementation written here: a brute-force nearest-value search over every
representable value, block by block in plain Python loops."""

import pytest
import torch

from flowrl.quant import (
    fake_quant_fp8,
    fake_quant_mxfp4,
    fake_quant_nvfp4,
    mxfp4_exponents,
    nvfp4_scales,
    round_e2m1,
    round_e4m3,
)

# ------------------------------------------------------------------ the second implementation
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # every E2M1 magnitude (0.5 is the only subnormal)


def e4m3_values() -> list[float]:
    """Every finite non-negative e4m3fn value from its bit fields (exponent bias 7, 3 mantissa bits; S.1111.111 is
    NaN)."""
    out = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue
            out.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return out


E4M3 = e4m3_values()


def nearest(value: float, grid: list[float]) -> float:
    """Nearest grid value to |value| (saturating), ties to the even code (grid index), sign kept."""
    a = min(abs(value), grid[-1])
    best = min(range(len(grid)), key=lambda i: (abs(grid[i] - a), i % 2))
    return -grid[best] if value < 0 or (value == 0 and str(value).startswith("-")) else grid[best]


def reference_nvfp4(x: torch.Tensor, block=16, two_level=True, floor=2**-6) -> torch.Tensor:
    flat = x.float().flatten().tolist()
    amax = torch.tensor(max(abs(v) for v in flat), dtype=torch.float32)
    s = amax / 2688.0 if two_level else torch.tensor(1.0)
    out = []
    for b in range(0, len(flat), block):
        chunk = flat[b : b + block]
        s_b = torch.tensor(max(abs(v) for v in chunk), dtype=torch.float32) / 6.0
        e = float((s_b / s).clamp(floor, 448.0)) if two_level else float(s_b.clamp(floor, 448.0))
        total = s * torch.tensor(nearest(e, E4M3), dtype=torch.float32)
        for v in chunk:
            q = float((torch.tensor(v, dtype=torch.float32) / total).clamp(-6, 6))
            out.append(nearest(q, list(E2M1_VALUES)) * float(total))
    return torch.tensor(out, dtype=torch.float32).reshape(x.shape)


def reference_mxfp4(x: torch.Tensor, block=32) -> torch.Tensor:
    import math

    flat = x.float().flatten().tolist()
    out = []
    for b in range(0, len(flat), block):
        chunk = flat[b : b + block]
        amax = max(abs(v) for v in chunk)
        if amax == 0:
            out += [0.0] * len(chunk)
            continue
        scale = 2.0 ** (math.floor(math.log2(amax)) - 2)
        out += [nearest(max(-6.0, min(6.0, v / scale)), list(E2M1_VALUES)) * scale for v in chunk]
    return torch.tensor(out, dtype=torch.float32).reshape(x.shape)


# ------------------------------------------------------------------ hand-computed numbers
def test_e2m1_tie_table():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 100.0, -0.25, -2.5, -5.0])
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.0, -2.0, -4.0]
    assert round_e2m1(x).tolist() == expected


def test_e2m1_matches_brute_force_on_a_fine_grid():
    x = torch.linspace(-7, 7, 2801)  # steps of 0.005: every tie and many in-between points
    assert round_e2m1(x).tolist() == [nearest(v, list(E2M1_VALUES)) for v in x.tolist()]


def test_e4m3_rounding_by_hand():
    assert round_e4m3(torch.tensor([4.48, 448.0, 500.0, 2.0**-9, 1.5 * 2.0**-9])).tolist() == [
        4.5,
        448.0,
        448.0,
        2**-9,
        2**-8,
    ]
    # the NVFP4 block-scale encode clips before rounding: a tiny scale becomes the 2^-6 floor
    codes, encoded, scale, _ = nvfp4_scales(torch.tensor([1e-9] + [0.0] * 15), two_level=False)
    assert encoded.flatten().tolist() == [2.0**-6]


def test_e4m3_matches_torch_float8_cast_and_brute_force():
    g = torch.Generator().manual_seed(0)
    x = torch.cat(
        [torch.randn(4000, generator=g) * 10.0 ** torch.randint(-4, 3, (4000,), generator=g), torch.tensor(E4M3)]
    )
    x = x.clamp(-448, 448)
    torch_cast = x.to(torch.float8_e4m3fn).float()
    assert torch.equal(round_e4m3(x), torch_cast)
    few = x[:300].tolist()
    assert round_e4m3(torch.tensor(few)).tolist() == [nearest(v, E4M3) for v in few]


def test_nvfp4_worked_vector():
    x = torch.tensor([0, 0.1, -0.2, 0.3, 0.45, -0.6, 0.75, 1, -1.2, 1.5, 2, -2.5, 3, 3.3, -4.4, 6])
    codes, encoded, scale, _ = nvfp4_scales(torch.cat([x, 0.01 * x]))
    assert float(scale) == pytest.approx(0.00223214, abs=1e-8)
    assert encoded.flatten().tolist() == [448.0, 4.5]
    block1 = [0, 0, -0, 0.5, 0.5, -0.5, 1, 1, -1, 1.5, 2, -2, 3, 3, -4, 6]
    block2 = [0, 0, -0, 0.5, 0.5, -0.5, 0.5, 1, -1, 1.5, 2, -2, 3, 3, -4, 6]
    assert codes.tolist() == [block1, block2]
    total = (scale * encoded).flatten()
    assert float(total[0]) == pytest.approx(1.0, abs=1e-6) and float(total[1]) == pytest.approx(0.0100446, abs=1e-7)
    y = fake_quant_nvfp4(torch.cat([x, 0.01 * x]))
    torch.testing.assert_close(y[:16], torch.tensor(block1), rtol=0, atol=1e-6)
    torch.testing.assert_close(y[16:], torch.tensor(block2) * total[1], rtol=0, atol=0)


def test_mxfp4_scale_rule():
    block = torch.tensor([6.5, 1.0, -0.3] + [0.0] * 29)
    assert mxfp4_exponents(torch.tensor([6.5])).tolist() == [0]  # floor(log2 6.5) − 2 = 0
    assert fake_quant_mxfp4(block)[:3].tolist() == [6.0, 1.0, -0.5]  # 6.5 saturates to 6
    assert mxfp4_exponents(torch.tensor([6.5]), "rceil").tolist() == [1]  # ceil(log2(6.5 / 6)) = 1
    assert fake_quant_mxfp4(block, rounding="rceil")[:3].tolist() == [6.0, 1.0, -0.0]  # 6.5/2 → 3, 1/2 → .5, −.15 → −0
    assert mxfp4_exponents(torch.tensor([12.0]), "rceil").tolist() == [1]  # an exact power of two stays
    assert fake_quant_mxfp4(torch.zeros(32)).tolist() == [0.0] * 32


# ------------------------------------------------------------------ against the second implementation
@pytest.mark.parametrize("two_level", [True, False])
def test_nvfp4_matches_the_brute_force_implementation(two_level):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 48, generator=g) * torch.logspace(-3, 1, 48)  # blocks of very different magnitudes
    expected = reference_nvfp4(x, two_level=two_level)
    assert torch.equal(fake_quant_nvfp4(x, two_level=two_level), expected)


def test_nvfp4_axis_and_padding():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20, 3, generator=g)
    along0 = fake_quant_nvfp4(x, axis=0)  # blocks run down the columns; 20 = one block of 16 + one padded block of 4
    rows = torch.cat([x.t(), torch.zeros(3, 12)], dim=1)  # the same blocks laid out along the last axis
    assert torch.equal(along0, fake_quant_nvfp4(rows, amax=x.abs().max())[:, :20].t())


def test_mxfp4_matches_the_brute_force_implementation():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 96, generator=g) * torch.logspace(-4, 2, 96)
    assert torch.equal(fake_quant_mxfp4(x), reference_mxfp4(x))


def test_fp8_fake_quant_is_the_scaled_float8_cast():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 32, generator=g)
    scale = x.abs().max() / 448
    assert torch.equal(fake_quant_fp8(x), (x / scale).to(torch.float8_e4m3fn).float() * scale)
    assert fake_quant_fp8(torch.zeros(3)).tolist() == [0.0] * 3


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="rounding='nearest' must be 'floor'"):
        fake_quant_mxfp4(torch.ones(32), rounding="nearest")
    with pytest.raises(ValueError, match="block=0 must be >= 1"):
        fake_quant_nvfp4(torch.ones(16), block=0)
