"""Independent MQAR sanity check (CPU, ~1-2 min): a plain training loop on the same
model class as train_tiny.py (transformers Qwen3ForCausalLM, tiny config), Zoology's
layout: keys and values from disjoint vocab halves, ``K1 V1 .. Kn Vn`` then the keys
again in random order (each followed by its value), loss only on those values.

    python bench/quality/mqar_minimal.py --pairs 4 --lr 3e-3 --steps 1000   # acc ~1.0 by step ~900
    python bench/quality/mqar_minimal.py --pairs 8 --lr 1e-3 --steps 1500   # still ~0.39 at 1500

See README "Bug hunt after sweep run 1".
"""
import time, torch, torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM
torch.set_num_threads(1); torch.manual_seed(0)
import argparse
ap = argparse.ArgumentParser()
ap.add_argument("--nk", type=int, default=64); ap.add_argument("--pairs", type=int, default=8)
ap.add_argument("--steps", type=int, default=1500); ap.add_argument("--lr", type=float, default=1e-3)
ap.add_argument("--tie", type=int, default=1); ap.add_argument("--hidden", type=int, default=64)
ap.add_argument("--hd", type=int, default=16); ap.add_argument("--layers", type=int, default=2)
ap.add_argument("--bs", type=int, default=64); ap.add_argument("--theta", type=float, default=10000.)
ap.add_argument("--wd", type=float, default=0.1); ap.add_argument("--noqk", type=int, default=0); ap.add_argument("--qkinit", type=float, default=1.0)
a = ap.parse_args()
NK = a.nk; V = 2 * NK + 2  # keys 2..NK+1, values NK+2..2NK+1
cfg = Qwen3Config(vocab_size=V, hidden_size=a.hidden, intermediate_size=2*a.hidden, num_hidden_layers=a.layers,
    num_attention_heads=4, num_key_value_heads=2, head_dim=a.hd, max_position_embeddings=512,
    rope_theta=a.theta, tie_word_embeddings=bool(a.tie), use_sliding_window=False)
m = Qwen3ForCausalLM(cfg)
for L in m.model.layers:
    if a.noqk: L.self_attn.q_norm = torch.nn.Identity(); L.self_attn.k_norm = torch.nn.Identity()
    else:
        with torch.no_grad(): L.self_attn.q_norm.weight.fill_(a.qkinit); L.self_attn.k_norm.weight.fill_(a.qkinit)
def batch(B, n, g):
    keys = torch.stack([torch.randperm(NK, generator=g)[:n] for _ in range(B)]) + 2
    vals = torch.randint(0, NK, (B, n), generator=g) + NK + 2
    perm = torch.stack([torch.randperm(n, generator=g) for _ in range(B)])
    qk, qv = keys.gather(1, perm), vals.gather(1, perm)
    ctx = torch.stack([keys, vals], 2).reshape(B, 2 * n)
    q = torch.stack([qk, qv], 2).reshape(B, 2 * n)
    ids = torch.cat([ctx, q], 1)
    mask = torch.zeros_like(ids, dtype=torch.bool); mask[:, 2 * n + 1::2] = True
    return ids, mask
opt = torch.optim.AdamW(m.parameters(), lr=a.lr, weight_decay=a.wd, betas=(0.9, 0.98))
g = torch.Generator().manual_seed(1); t0 = time.time()
for step in range(1, a.steps + 1):
    ids, mask = batch(a.bs, a.pairs, g)
    logits = m(input_ids=ids).logits[:, :-1]
    sel = mask[:, 1:]
    loss = F.cross_entropy(logits[sel], ids[:, 1:][sel])
    opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0); opt.step()
    if step % 100 == 0:
        acc = (logits[sel].argmax(-1) == ids[:, 1:][sel]).float().mean().item()
        print(f"step {step} loss {loss.item():.3f} acc {acc:.3f} t {time.time()-t0:.0f}s", flush=True)
