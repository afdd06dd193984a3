"""bench/quality/asyncspade_recall_probe.py's per-layer measurement on fresh random
Q/K: its ranks and Top-B memberships against plain float64 references (a planted
key that only the true query finds; the predicted query from the window's queries)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench" / "quality"))

import asyncspade_recall_probe as probe  # noqa: E402
import fidelity  # noqa: E402
from sgl_sparse.queryaware import asyncspade as aspd  # noqa: E402

# torch and this package's pure-torch math only: CI runs it under one SGLang version.
pytestmark = pytest.mark.sglang_independent


def _ref_rank(q: torch.Tensor, k: torch.Tensor, t: int, lo: int, hi: int, pos: int, scale: float) -> list[int]:
    """float64: rank of `pos` among keys [lo, hi) by max over the group of scale q.k."""
    hkv = k.shape[0]
    g = q.shape[0] // hkv
    s = torch.einsum("hgd,hnd->hgn", q.double().view(hkv, g, -1), k[:, :t].double()).amax(1) * scale
    cand = s[:, lo:hi]
    return [int((cand[h] > s[h, pos]).sum()) for h in range(hkv)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_probe_step_against_float64(seed):
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, T, window, recent = 4, 2, 16, 400, 4, 16
    q = torch.randn(hq, T, d, generator=g)
    k = torch.randn(hkv, T, d, generator=g)
    v = torch.randn(hkv, T, d, generator=g)
    t = T - 1
    key_p, val_p = 100, 101
    # the value's key is aligned with the true query of every head of its group only
    k[:, val_p] = 4.0 * q[:, t].view(hkv, hq // hkv, d).mean(1)
    L = fidelity.LayerQKV(q, k, v, d ** -0.5)
    out = probe.probe_step(L, t, [key_p, val_p], [8, 64], window, recent, 1e-2)
    lo, hi = probe.SINK, t + 1 - recent
    assert out["rank"]["true"] == _ref_rank(q[:, t], k, t, lo, hi, val_p, L.scaling) == [0, 0]
    win, cnt = fidelity.asyncspade_window(L, t, window)
    q_hat = aspd.predict_next_query(win.double(), cnt, 1e-2)[0]
    assert out["rank"]["pred"] == _ref_rank(q_hat, k, t, lo, hi, val_p, L.scaling)
    assert out["rank"]["last"] == _ref_rank(q[:, t - 1], k, t, lo, hi, val_p, L.scaling)
    for i in range(1, window + 2):
        assert out["rank"][f"q_t-{i}"] == _ref_rank(q[:, t - i], k, t, lo, hi, val_p, L.scaling)
    for b in (8, 64):
        row = out[str(b)]
        assert row["true"]["value"] == [True, True]
        assert row["pred"]["value"] == [r < b for r in out["rank"]["pred"]]
        best = [min(out["rank"][f"q_t-{i}"][h] for i in range(1, window + 1)) for h in range(hkv)]
        assert row["window_any"]["value"] == [r < b for r in best]
    # p_value: the true query's attention probability on the value, max over the group
    logits = torch.einsum("hgd,hnd->hgn", q[:, t].double().view(hkv, hq // hkv, d), k[:, : t + 1].double())
    ref = torch.softmax(logits * L.scaling, -1)[:, :, val_p].amax(1)
    torch.testing.assert_close(torch.tensor(out["p_value"], dtype=torch.float64), ref, rtol=1e-4, atol=1e-6)
