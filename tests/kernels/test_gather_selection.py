"""kernels/gather_selection.py (per-slot selections -> the batch rows of a_pos /
a_len, rows without a selection untouched) against the torch ops it replaced."""

import torch

from sgl_sparse.kernels.gather_selection import gather_selection


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _run(fn, *args, **kw):
    """Run a kernel launcher on DEVICE (the GPU where there is one, else the Triton
    interpreter on CPU): tensor arguments copied there, and copied back in place
    afterwards (the launchers write their outputs in place); outputs back on CPU."""
    if DEVICE == "cpu":
        return fn(*args, **kw)
    pairs = []

    def there(x):
        if isinstance(x, torch.Tensor):
            pairs.append((x, x.to(DEVICE)))
            return pairs[-1][1]
        return x

    out = fn(*[there(x) for x in args], **{k: there(v) for k, v in kw.items()})
    for x, y in pairs:
        x.copy_(y.cpu())

    def back(o):
        return tuple(back(v) for v in o) if isinstance(o, tuple) else o.cpu() if isinstance(o, torch.Tensor) else o

    return back(out)


def test_gather_selection():
    gen = torch.Generator().manual_seed(0)
    s, hkv, w, bs, cap = 5, 3, 40, 6, 48
    pos = torch.randint(0, 1000, (s, hkv, w), generator=gen, dtype=torch.int32)
    length = torch.randint(0, w + 1, (s, hkv), generator=gen, dtype=torch.int32)
    length[2, 1] = w
    length[4, 0] = 0
    src = torch.tensor([2, -1, 4, 0, -1, 1], dtype=torch.int32)
    a_pos = torch.full((bs, hkv, cap), -7, dtype=torch.int32)
    a_len = torch.full((bs, hkv), -7, dtype=torch.int32)
    _run(gather_selection, src, pos, length, a_pos, a_len, block=16)
    for b in range(bs):
        if src[b] < 0:
            assert (a_pos[b] == -7).all() and (a_len[b] == -7).all()
            continue
        assert torch.equal(a_len[b], length[src[b]])
        for h in range(hkv):
            n = int(length[src[b], h])
            assert torch.equal(a_pos[b, h, :n], pos[src[b], h, :n]) and (a_pos[b, h, n:] == -7).all()
