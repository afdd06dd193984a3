"""bench/quality on CPU: the task generator's guarantees, a --smoke training run whose
checkpoint transformers loads, sane fidelity numbers, and (server marker) eval.py
through a real sgl_sparse server, cross-checked against transformers' greedy output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
QUALITY = ROOT / "bench" / "quality"
sys.path.insert(0, str(QUALITY))

import tasks  # noqa: E402

pytestmark = pytest.mark.timeout(600)


# ------------------------------------------------------------------ tasks
@pytest.mark.parametrize("length", [128, 300, 1000, 4096])
@pytest.mark.parametrize("variant", ["plain", "think", "think-long"])
def test_examples_have_exact_length_and_one_recoverable_fact(length, variant):
    for seed in range(3):
        ex = tasks.make_example(length, 0.5, variant, seed)
        assert len(ex.prompt) == length
        key = ex.prompt[ex.fact_pos]
        assert key in tasks.KEY_IDS
        # The queried key occurs exactly twice: in its fact and in the final question.
        where = [i for i, t in enumerate(ex.prompt) if t == key]
        assert where[0] == ex.fact_pos and len(where) == 2 and where[1] > length - 12
        # The fact reads "the code of KEY V ." and V is the answer (a pure induction copy).
        assert ex.prompt[ex.fact_pos - 3: ex.fact_pos] == tasks.ids("the code of")
        assert ex.prompt[ex.fact_pos + 1: ex.fact_pos + 1 + tasks.VALUE_LEN] == ex.answer
        assert ex.prompt[ex.fact_pos + 1 + tasks.VALUE_LEN] == tasks.ID["."]
        assert tasks.answer_correct(ex, ex.completion)
        assert len(ex.loss_mask) == len(ex.prompt) + len(ex.completion)
        if variant in tasks.THINK_VARIANTS:
            assert ex.prompt[-1] == tasks.ID[tasks.THINK]
            body = ex.completion[: ex.completion.index(tasks.ID[tasks.END_THINK])]
            assert not set(ex.answer) & set(body) and key not in body
        assert ex == tasks.make_example(length, 0.5, variant, seed)  # deterministic per seed


def test_think_long_is_a_long_sentence_structured_answer():
    """think-long: tens of decode tokens before the value, sentence ends inside the
    think block (SFI's triggers), the fact only before it; its own question word, so
    the prompt says which block to write; every token of the block (with the
    question's tail and `</think>`) determined by the two before it (learnable)."""
    ex, short = tasks.make_example(2048, 0.5, "think-long", 4), tasks.make_example(2048, 0.5, "think", 4)
    end = ex.completion.index(tasks.ID[tasks.END_THINK])
    assert end == len(tasks.THINK_LONG_BODY.split()) >= 40
    assert ex.completion[end + 1:] == tasks.answer_prefix(ex.prompt[ex.fact_pos]) + ex.answer + [tasks.ID[tasks.EOS]]
    assert sum(t in tasks.TRIGGER_IDS for t in ex.completion[:end]) >= 4
    assert tasks.ids("the code of") not in [ex.completion[i:i + 3] for i in range(end)]
    assert ex.prompt[-9:] == tasks.ids("question : recall the code of") + [ex.prompt[ex.fact_pos]] + tasks.ids("? <think>")
    assert short.prompt[-10:-6] == tasks.ids("question : what is")
    seq = ex.prompt[-3:] + ex.completion[:end + 5]
    nxt = {}
    for i in range(2, len(seq)):
        assert nxt.setdefault(tuple(seq[i - 2:i]), seq[i]) == seq[i], tasks.decode(seq[i - 2:i + 1])
    with pytest.raises(ValueError):
        tasks.make_example(256, 0.5, "think-longer", 0)


def test_depth_is_controlled_and_filler_is_sentences():
    for depth in (0.0, 0.1, 0.5, 0.9, 1.0):
        ex = tasks.make_example(8192, depth, "plain", 7)
        assert abs(ex.depth - depth) < 0.05, (depth, ex.depth)
    ex = tasks.make_example(2048, 0.5, "plain", 7)
    ends = sum(t in tasks.TRIGGER_IDS for t in ex.prompt)
    assert ends > 2048 / 15  # sentences end every few tokens: SFI's triggers fire
    assert tasks.ID["\n"] in ex.prompt


def test_examples_are_deterministic_per_seed():
    a = tasks.make_example(1024, 0.3, "think", 5, inline_questions=3)
    b = tasks.make_example(1024, 0.3, "think", 5, inline_questions=3)
    c = tasks.make_example(1024, 0.3, "think", 6, inline_questions=3)
    assert (a.prompt, a.completion, a.loss_mask) == (b.prompt, b.completion, b.loss_mask)
    assert a.prompt != c.prompt
    # inline questions are supervised only on their answers
    assert 0 < sum(a.loss_mask[: len(a.prompt)]) < len(a.prompt) / 5


def test_answer_correct_is_exact_match():
    ex = tasks.make_example(256, 0.5, "think", 1)
    end = tasks.ID[tasks.END_THINK]
    prefix = tasks.answer_prefix(ex.prompt[ex.fact_pos])  # "the code of KEY"
    assert not tasks.answer_correct(ex, ex.answer)  # no </think>: no answer
    assert tasks.answer_correct(ex, [end] + prefix + ex.answer + [tasks.ID[tasks.EOS]])
    assert not tasks.answer_correct(ex, [end] + ex.answer + [tasks.ID[tasks.EOS]])  # key not restated
    wrong = next(v for v in tasks.VALUE_IDS if v != ex.answer[0])
    assert not tasks.answer_correct(ex, [end] + prefix + [wrong])
    plain = tasks.make_example(256, 0.5, "plain", 1)
    prefix = tasks.answer_prefix(plain.prompt[plain.fact_pos])
    assert tasks.answer_correct(plain, prefix + plain.answer)
    assert tasks.answer_correct(plain, plain.completion)
    assert not tasks.answer_correct(plain, plain.answer)  # the key must be restated first
    other = next(v for v in tasks.VALUE_IDS if v != plain.answer[0])
    assert not tasks.answer_correct(plain, prefix + [other, tasks.ID[tasks.EOS]])
    long = tasks.make_example(256, 0.5, "think-long", 1)
    prefix = tasks.answer_prefix(long.prompt[long.fact_pos])
    assert tasks.answer_correct(long, long.completion)
    assert tasks.answer_correct(long, tasks.ids("i found it .") + [end] + prefix + long.answer)  # any think text
    assert not tasks.answer_correct(long, prefix + long.answer)  # no </think>: no answer
    wrong = next(v for v in tasks.VALUE_IDS if v != long.answer[0])
    bad = list(long.completion)
    bad[-2] = wrong  # the value before <eos>
    assert not tasks.answer_correct(long, bad)
    assert not tasks.answer_correct(long, long.completion[:-3])  # cut before the value


@pytest.mark.parametrize("length", [96, 256, 2048])
def test_training_sequences_are_mqar_in_the_eval_format(length):
    for seed in range(4):
        toks, mask = tasks.make_training_sequence(length, seed, facts_every=(8, 32), think=0.5)
        assert len(toks) == len(mask) == length
        assert (toks, mask) == tasks.make_training_sequence(length, seed, facts_every=(8, 32), think=0.5)
        assert toks[-1] == tasks.ID[tasks.EOS] and mask[-1]
        # every supervised value token is the value of an earlier fact of the same key
        facts = {}
        for i in range(3, length - 1):
            if toks[i - 3:i] == tasks.ids("the code of") and toks[i] in tasks.KEY_IDS:
                if toks[i + 1] in tasks.VALUE_IDS and not mask[i + 1]:
                    facts.setdefault(toks[i], toks[i + 1])
                elif mask[i + 1]:
                    assert facts[toks[i]] == toks[i + 1], (seed, i)
        n_supervised_values = sum(m and t in tasks.VALUE_IDS for t, m in zip(toks, mask))
        assert n_supervised_values >= 2  # many queries per sequence
        assert sum(t in tasks.TRIGGER_IDS for t in toks) > length / 20  # still sentences


@pytest.mark.parametrize("length", [96, 256, 2048])
def test_training_sequences_supervise_think_long(length):
    """think_long > 0 mixes think-long questions in (from the plain share), each a
    supervised recall after the whole supervised think block; think_long = 0 leaves the
    sequences exactly as before (same draws)."""
    body, n_long = tasks.ids(tasks.THINK_LONG_BODY), 0
    for seed in range(6):
        toks, mask = tasks.make_training_sequence(length, seed, facts_every=(8, 32), think=0.25, think_long=0.5)
        assert len(toks) == len(mask) == length
        assert (toks, mask) == tasks.make_training_sequence(length, seed, facts_every=(8, 32), think=0.25,
                                                            think_long=0.5)
        assert tasks.make_training_sequence(length, seed, facts_every=(8, 32), think=0.25) == \
            tasks.make_training_sequence(length, seed, facts_every=(8, 32), think=0.25, think_long=0.0)
        facts = {}
        for i in range(3, length - 1):
            if toks[i - 3:i] == tasks.ids("the code of") and toks[i] in tasks.KEY_IDS and \
                    toks[i + 1] in tasks.VALUE_IDS and not mask[i + 1]:
                facts.setdefault(toks[i], toks[i + 1])
        for i in range(length - 8):
            if toks[i:i + 4] == tasks.ids("question : recall the"):
                n_long += 1
                key, b0 = toks[i + 6], i + 9  # "question : recall the code of KEY ? <think>" then the block
                assert toks[b0 - 1] == tasks.ID[tasks.THINK] and toks[b0:b0 + len(body)] == body
                a0 = b0 + len(body) + 1  # after </think>: "the code of KEY V"
                assert toks[a0 - 1] == tasks.ID[tasks.END_THINK]
                assert toks[a0:a0 + 4] == tasks.answer_prefix(key) and toks[a0 + 4] == facts[key]
                assert all(mask[b0:a0 + 5]) and not any(mask[i:b0])  # completion supervised, question not
    if length >= 256:
        assert n_long >= 6  # several per sequence
    else:  # too short for one with a quarter of filler left: the final question falls back to think
        assert n_long == 0


@pytest.mark.parametrize("length", [64, 256, 1024])
def test_kv_sequences_are_pure_induction_copies(length):
    for seed in range(4):
        toks, mask = tasks.make_kv_sequence(length, seed, pairs=(4, 64))
        assert len(toks) == len(mask) == length
        assert (toks, mask) == tasks.make_kv_sequence(length, seed, pairs=(4, 64))
        first = {}
        sup = 0
        for i in range(length - 1):
            if toks[i] in tasks.KEY_IDS:
                if toks[i] not in first:
                    assert not mask[i + 1]  # a fact: its value is random, not supervised
                    first[toks[i]] = toks[i + 1]
                else:
                    assert mask[i + 1] and toks[i + 1] == first[toks[i]]  # a query: the fact's value
                    sup += 1
        assert sup == len(first) == sum(mask) >= 4


def test_failure_records_say_what_the_model_generated():
    import eval as quality_eval

    ex = tasks.make_example(256, 0.5, "think", 1)
    end, key = tasks.ID[tasks.END_THINK], ex.prompt[ex.fact_pos]
    # another fact's value (in the prompt), after a closed think block and the right key
    other = next(t for t in ex.prompt if t in tasks.VALUE_IDS and t != ex.answer[0])
    out = tasks.ids(tasks.THINK_BODY) + [end] + tasks.answer_prefix(key) + [other]
    rec = quality_eval.failure_record(ex, out)
    assert rec["emitted_end_think"] and rec["restated_key"]
    assert rec["value_given"] == tasks.VOCAB[other]
    assert rec["value_distance"] == len(ex.prompt) - max(i for i, t in enumerate(ex.prompt) if t == other)
    assert rec["output"] == tasks.decode(out) and rec["expected"] == tasks.decode(ex.completion)
    assert rec["prompt_tail"].endswith("? <think>") and len(rec["prompt_tail"].split()) == 30
    # no </think>, a wrong key, and a value that is nowhere in the prompt
    wrong_key = next(k for k in tasks.KEY_IDS if k != key)
    absent = next(v for v in tasks.VALUE_IDS if v not in ex.prompt)
    rec = quality_eval.failure_record(ex, tasks.answer_prefix(wrong_key) + [absent])
    assert not rec["emitted_end_think"] and not rec["restated_key"]
    assert rec["value_given"] == tasks.VOCAB[absent] and rec["value_distance"] is None
    assert quality_eval.failure_record(ex, tasks.ids("i look"))["value_given"] is None
    # round-robin over (variant, depth) cells: the think failures are not crowded out
    plain = [tasks.make_example(256, 0.5, "plain", s) for s in range(3)]
    think = [tasks.make_example(256, 0.5, "think", s) for s in range(3)]
    picked = quality_eval.pick_failures([(e, []) for e in plain + think], 2)
    assert [r["variant"] for r in picked] == ["plain", "think"]
    assert len(quality_eval.pick_failures([(e, []) for e in plain], 5)) == 3


def test_eval_reports_per_variant_retention_from_meta_info():
    """A row mixing variants gets each variant's retention, slow-step ratio and decode
    steps from the responses' meta_info["sgl_sparse"] (decode-step weighted), and the
    markdown labels its columns with the variants in the order asked."""
    import eval as quality_eval

    summary = lambda steps, ret, slow: {"meta_info": {"sgl_sparse": [  # noqa: E731
        {"policy": "sfi", "decode_steps": steps, "mean_retention": ret, "slow_step_ratio": slow}]}}
    assert quality_eval.request_summary({"meta_info": {}}) is None
    assert quality_eval.request_summary({"meta_info": {"sgl_sparse": []}}) is None
    got = quality_eval.request_summary(summary(53, 0.1, 0.094))
    st = quality_eval.variant_stats([got, quality_eval.request_summary(summary(47, 0.2, 0.106)), None])
    assert st["requests"] == 2 and st["decode_steps_mean"] == 50
    assert st["retention"] == pytest.approx((53 * 0.1 + 47 * 0.2) / 100)
    assert st["slow_ratio"] == pytest.approx((53 * 0.094 + 47 * 0.106) / 100)
    none = quality_eval.variant_stats([None])
    assert none["requests"] == 0 and none["retention"] is None
    exs = quality_eval.examples_for(256, [0.5], ["think-long", "plain"], 2, 0)
    assert [e.variant for e in exs] == ["think-long"] * 2 + ["plain"] * 2
    res = {"rows": [{"policy": "sfi", "length": 256, "accuracy": 0.75, "by_variant": {"think-long": 1.0, "plain": 0.5},
                     "retention": 0.15, "slow_ratio": 0.1, "by_variant_stats": {"think-long": st, "plain": none}}],
           "errors": [], "not_available": {},
           "settings": {"lengths": [256], "variants": ["think-long", "plain"], "n_per_cell": 2, "depths": [0.5]}}
    md = quality_eval.markdown(res)
    assert "Exact match (think-long / plain)" in md and "(1.00 / 0.50)" in md
    assert "| policy | length | think-long | plain |" in md
    assert f"| `sfi` | 256 | 1.00 · ret {st['retention']:.3f} · slow {st['slow_ratio']:.3f} · 50.0 steps | 0.50 · - |" in md


def test_run_gpu_eval_long_target():
    """run_gpu.sh trains think-long by default and eval-long evaluates it on the
    issue's policies, decode CUDA graphs on (no --disable-cuda-graph)."""
    sh = (QUALITY / "run_gpu.sh").read_text()
    train_flags = next(l for l in sh.splitlines() if l.startswith("TRAIN_FLAGS="))
    assert "--think-long 0.15" in train_flags and "--recipe kv-easy" in train_flags
    assert "eval-long) eval_long ;;" in sh
    body = sh[sh.index("eval_long() {"):]
    body = body[:body.index("\n}")]
    assert "--variants \"${LONG_VARIANTS:-think-long}\"" in body and "--disable-cuda-graph" not in body
    pols = next(l for l in sh.splitlines() if l.startswith("LONG_POLICIES="))
    for p in ("full", "sfi", "sfi:beta=1.0:prompt_evidence=every", "sfi:budget=256:recent=64:beta=1.0:prompt_evidence=every",
              "sfi:budget=512:recent=64:beta=1.0:prompt_evidence=every", "sadas", "streaming:window=64"):
        assert f",{p}," in "," + pols.split("-")[1].strip("}\"") + ",", p


# ----------------------------------------------------------- train + load
@pytest.fixture(scope="module")
def smoke_ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-recall")
    subprocess.run([sys.executable, str(QUALITY / "train_tiny.py"), "--smoke", "--out", str(out)],
                   check=True, timeout=240, cwd=ROOT)
    return out


def test_smoke_checkpoint_loads_in_transformers(smoke_ckpt):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log = (smoke_ckpt / "train_log.txt").read_text()
    assert "loss" in log and "final exact match" in log
    tok = AutoTokenizer.from_pretrained(smoke_ckpt)
    model = AutoModelForCausalLM.from_pretrained(smoke_ckpt)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    cfg = model.config
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    ex = tasks.make_example(128, 0.5, "think", 3)
    # The HF tokenizer and tasks.py agree on every id, text round trip included.
    assert tok(tasks.decode(ex.prompt), add_special_tokens=False)["input_ids"] == ex.prompt
    for t in (tasks.THINK, tasks.END_THINK, "\n", "."):
        assert tok.encode(t, add_special_tokens=False) == [tasks.ID[t]]
    assert tok.eos_token_id == tasks.ID[tasks.EOS] == model.generation_config.eos_token_id
    with torch.no_grad():
        logits = model(torch.tensor([ex.prompt])).logits
    assert logits.shape == (1, 128, cfg.vocab_size) and torch.isfinite(logits).all()


# --------------------------------------------------------------- fidelity
def test_chunked_causal_attention_matches_sdpa():
    import fidelity

    torch.manual_seed(0)
    q, k, v = torch.randn(8, 37, 16), torch.randn(2, 37, 16), torch.randn(2, 37, 16)
    ref = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                                           scale=0.25, enable_gqa=True)[0]
    for max_logits in (8 * 37 * 5, 1 << 20):  # chunks of 5 queries, and one chunk
        out = fidelity.causal_attention(q, k, v, 0.25, max_logits)
        assert torch.allclose(out.transpose(0, 1), ref, atol=1e-5), max_logits


def test_sfi_slow_steps_replay_the_server_schedule():
    import fidelity

    think = tasks.make_example(300, 0.5, "think", 1)
    p0, t = len(think.prompt), fidelity.decode_positions(think)[0]
    seq = think.prompt + think.completion
    # first decode step, then the steps consuming the think block's two "."
    assert [p - p0 for p in fidelity.sfi_slow_steps(think, t)] == [0, 6, 10]
    assert seq[p0 + 10] == tasks.ID["."] and seq[p0 + 11] == tasks.ID[tasks.END_THINK]
    plain = tasks.make_example(300, 0.5, "plain", 1)
    assert fidelity.sfi_slow_steps(plain, fidelity.decode_positions(plain)[0]) == [len(plain.prompt)]
    # with no sentence end, every (t_max + 1)-th step (here t_max = 4)
    assert fidelity.sfi_slow_steps(plain, len(plain.prompt) + 5, t_max=4) == [len(plain.prompt) + i for i in (0, 5)]


def test_fidelity_values_are_sane(smoke_ckpt):
    import fidelity

    model = fidelity.load_model(str(smoke_ckpt))
    ex = tasks.make_example(200, 0.25, "think", 777)
    # The recording forward (chunked attention, small chunks here) gives the model's sdpa logits.
    fidelity.record_qkv(model, ex.prompt, max_logits=4 * 200 * 16)
    with torch.no_grad():
        ref = model(torch.tensor([ex.prompt])).logits
        model.config._attn_implementation = "sgl_sparse_record"  # registered by record_qkv
        try:
            got = model(torch.tensor([ex.prompt]), use_cache=False).logits
        finally:
            model.config._attn_implementation = "sdpa"
    assert torch.allclose(got, ref, atol=1e-4)

    res = fidelity.evaluate(model, [200], budgets=[8, 32, 100_000], n_examples=2, sfi_recent=8, sfi_window=8)
    rows = {(r["variant"], r["policy"], r["budget"]): r for r in res["rows"]}
    assert not res["not_available"]  # sgl_sparse's Selector is importable here
    # sfi-later replays the think completion's later slow steps: think rows only
    assert {v for v, p, _ in rows if p == "sfi-later"} == {"think"}
    assert {v for v, p, _ in rows if p == "sfi-later-every"} == {"think"}
    for variant in ("plain", "think"):
        full = rows[(variant, "full", None)]
        assert full["rel_err_max"] == 0.0 and full["overlap"] == 1.0 and full["fact_kept"] == 1.0
        names = ("streaming", "quest", "sfi", "oracle") + (("sfi-later", "sfi-later-every") if variant == "think" else ())
        for name in names:
            big = rows[(variant, name, 100_000)]  # budget covers every token: dense
            assert big["rel_err_max"] < 1e-6 and big["overlap"] == 1.0 and big["retention"] == 1.0, name
            assert big["fact_kept"] == big["value_kept"] == 1.0, name
            small = rows[(variant, name, 8)]
            assert 0 < small["retention"] < 1 and 0 <= small["overlap"] <= 1 and 0 < small["mass"] < 1, name
            assert 0 <= small["fact_kept"] <= small["value_kept"] <= 1, name
        for b in (8, 32):
            assert rows[(variant, "oracle", b)]["overlap"] == 1.0
            # the exact top-k keeps the most attention mass of all sets of its size or smaller
            assert rows[(variant, "oracle", b)]["mass"] >= rows[(variant, "streaming", b)]["mass"] * 0.999 - 1e-6 or \
                rows[(variant, "streaming", b)]["retention"] > rows[(variant, "oracle", b)]["retention"]
        assert rows[(variant, "streaming", 8)]["rel_err"] > 0
        # the fact sits at depth 0.25 of 200 tokens: far out of sink 4 + the last 8
        assert rows[(variant, "streaming", 8)]["fact_kept"] == 0.0
    md = fidelity.markdown(res)
    assert "| 200 | think | sfi-later | 8 |" in md and "fact kept" in md


@pytest.fixture(scope="module")
def smoke_model(smoke_ckpt):
    import fidelity

    return fidelity.load_model(str(smoke_ckpt))


@pytest.fixture(scope="module")
def new_policy_rows(smoke_model):
    import fidelity

    res = fidelity.evaluate(smoke_model, [200], budgets=[8, 32, 100_000], n_examples=2,
                            policies=("full", "streaming", "sadas", "asyncspade", "lfps"))
    return res, {(r["variant"], r["policy"], r["budget"]): r for r in res["rows"]}


def test_fidelity_new_policies_are_dense_when_the_budget_covers(new_policy_rows):
    import math

    import fidelity

    res, rows = new_policy_rows
    assert not res["not_available"]
    for r in res["rows"]:  # every number finite, the extra columns present on every row
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
        assert set(fidelity.EXTRA_COLUMNS) <= set(r)
        if r["policy"] != "lfps":
            assert r["scored"] is None and r["bypassed"] is None
        if r["policy"] != "asyncspade":
            assert r["pred_overlap"] is None
    for variant in ("plain", "think"):
        for name in ("sadas", "asyncspade", "lfps"):
            big = rows[(variant, name, 100_000)]
            assert big["rel_err_max"] < 1e-6 and big["overlap"] == 1.0 and big["retention"] == 1.0, name
            assert big["fact_kept"] == 1.0, name
        assert rows[(variant, "asyncspade", 100_000)]["pred_overlap"] == 1.0
        assert rows[(variant, "lfps", 100_000)]["scored"] == 1.0
        for b in (8, 32):
            a, lf = rows[(variant, "asyncspade", b)], rows[(variant, "lfps", b)]
            assert 0 < a["retention"] < 1 and 0 <= a["pred_overlap"] <= 1
            assert 0 < lf["scored"] <= 1 and 0 <= lf["bypassed"] <= 1
    # sadas: the plain completion never leaves window mode (= streaming, window = budget);
    # the think answer comes after </think>: latched to full attention at every budget
    for b in (8, 32):
        plain, stream = rows[("plain", "sadas", b)], rows[("plain", "streaming", b)]
        assert plain["rel_err"] == stream["rel_err"] and plain["retention"] == stream["retention"] < 1
        think = rows[("think", "sadas", b)]
        assert think["rel_err_max"] == 0.0 and think["retention"] == 1.0
    md = fidelity.markdown(res)
    assert "| 200 | think | lfps | 8 |" in md and "scored" in md and "pred. overlap" in md


def _example_and_layer(model, variant="think", length=200):
    import fidelity

    ex = tasks.make_example(length, 0.25, variant, 777)
    layers = fidelity.record_qkv(model, ex.prompt + ex.completion)
    return ex, layers, fidelity.decode_positions(ex)[0]


def test_fidelity_asyncspade_predicts_with_the_servers_ring(smoke_model, monkeypatch):
    """The row's q̂_t is queryaware.asyncspade.predict_next_query's, on what the
    server's ring holds: the prompt's last W + 1 queries loaded at the prefill
    (ring_load), then each decode step's query pushed (ring_push_window)."""
    import fidelity
    from sgl_sparse.config import AsyncSpadePolicy
    from sgl_sparse.queryaware import asyncspade as aspd

    spec = AsyncSpadePolicy()
    ex, layers, t = _example_and_layer(smoke_model)
    P = len(ex.prompt)
    seen = []
    real = aspd.predict_next_query
    monkeypatch.setattr(aspd, "predict_next_query", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    for L in layers:
        seen.clear()
        sel = fidelity.asyncspade_factory()(ex)(L, t, 8)
        assert len(seen) == 1 and isinstance(sel, fidelity.Selection)
        # the server's sequence on the same queries
        w = spec.window + 1
        hq, _, d = L.q.shape
        ring, total = torch.zeros(1, w, hq, d), torch.zeros(1, dtype=torch.int64)
        win = torch.zeros(1, w, hq, d)
        win[0] = L.q[:, P - w: P].permute(1, 0, 2)
        aspd.ring_load(ring, total, torch.tensor([0]), win, torch.tensor([w]))
        for p in range(P, t):  # decode steps before t, each predicting the next query
            window, count = aspd.ring_push_window(ring, total, L.q[:, p][None], torch.tensor([0]))
            q_hat = real(window, count, spec.ridge)
        assert torch.equal(seen[0], q_hat)
        # the kept set: sink, the last `recent`, and Top-8 of q̂'s scores in between
        keep = sel.keep
        assert keep[:, :fidelity.SINK].all() and keep[:, t + 1 - spec.recent:].all()
        assert (keep.sum(-1) == fidelity.SINK + 8 + spec.recent).all()
        assert 0 <= sel.extra["pred_overlap"] <= 1
    # the first decode step has no prediction yet: dense, as the server serves it
    assert fidelity.asyncspade_factory()(ex)(layers[0], P, 8).all()


def test_fidelity_lfps_scored_fraction_is_queryaware_lfps(smoke_model):
    """The row's `scored` is queryaware.lfps.step's scored_frac on the same inputs:
    tables from the prompt's last s queries, then step + update_tables at every
    decode step up to t (the tables evolve as in serving)."""
    import fidelity
    from sgl_sparse.policies import query_aware
    from sgl_sparse.queryaware import lfps as lf

    ex, layers, t = _example_and_layer(smoke_model)
    P, knobs, budget = len(ex.prompt), fidelity.lfps_knobs(), 8
    pol = fidelity.lfps_factory()(ex)
    for L in layers:
        sel = pol(L, t, budget)
        perm = lambda x: x.permute(1, 0, 2)[None]
        st = lf.init_tables(perm(L.q[:, P - knobs.s: P]), perm(L.k[:, :P]), perm(L.v[:, :P]),
                            torch.tensor([P]), L.scaling, L.k.shape[1], knobs)
        for p in range(P, t + 1):
            n = torch.tensor([p + 1])
            assert not query_aware.covers(knobs.n_sink, budget, knobs.n_local + 1, p + 1)
            res = lf.step(st, L.q[:, p][None], perm(L.k[:, : p + 1]), n, torch.tensor([budget]), budget,
                          8192, L.scaling, knobs)
            lf.update_tables(st, res, n, knobs)
        frac = res.scored_frac.mean().item()
        assert 0 < sel.extra["scored"] <= 1
        assert sel.extra["scored"] == frac
        assert sel.extra["bypassed"] == res.bypass.float().mean().item()
        assert torch.equal(sel.bypass, res.bypass[0])


def test_fidelity_nan_never_passes():
    """A NaN anywhere in a step's metrics raises instead of entering a mean; a
    bypassed head's empty set (its softmax is NaN) does not leak into the output."""
    import fidelity

    torch.manual_seed(0)
    q, k, v = torch.randn(4, 40, 8), torch.randn(2, 40, 8), torch.randn(2, 40, 8)
    L = fidelity.LayerQKV(q, k, v, 0.35)
    keep = fidelity.streaming_policy(L, 39, 8)
    bypass = torch.tensor([True, False])
    sel = fidelity.Selection(keep & ~bypass[:, None], bypass=bypass, vbar=v.mean(1))
    m = fidelity.step_metrics(L, 39, sel, fact=[10, 11])
    assert all(torch.isfinite(torch.tensor(x)) for x in m.values()) and m["retention"] < 0.5
    v_nan = v.clone()
    v_nan[1, 20] = float("nan")  # outside the streaming set: dense output is NaN
    with pytest.raises(FloatingPointError, match="rel_err"):
        fidelity.step_metrics(fidelity.LayerQKV(q, k, v_nan, 0.35), 39, keep)
    with pytest.raises(FloatingPointError):
        fidelity.step_metrics(L, 39, fidelity.Selection(keep, extra={"scored": float("nan")}))


def test_eval_sparse_config_serves_the_longest_prompts_sparse():
    """run_gpu.sh's query-aware server: a store whose max_context is below the eval's
    longest sequence serves it dense (context_exceeds_store), and one with fewer slots
    than requests in flight serves the rest dense (no_store_slot)."""
    import eval as quality_eval

    from sgl_sparse.config import QUERY_AWARE, load_server_config

    cfg = load_server_config(str(QUALITY / "sparse_config_eval.yaml"))
    longest = max(int(x) for x in quality_eval.DEFAULT_LENGTHS.split(","))
    completion = max(len(tasks.make_example(256, 0.5, v, 0).completion) for v in tasks.VARIANTS)
    seq = longest + completion + 4  # eval.py asks for len(completion) + 4 new tokens
    assert completion + 4 <= 64  # eval.py --launch: --context-length max(lengths) + 64
    for name in QUERY_AWARE:
        store = getattr(cfg.query_aware, name)
        assert store.max_context >= seq and store.slots >= quality_eval.DEFAULT_CONCURRENCY, name
    assert "sparse_config_eval.yaml" in (QUALITY / "run_gpu.sh").read_text()


# ----------------------------------------------------------- server eval
@pytest.mark.server
def test_eval_through_sgl_sparse_server(smoke_ckpt):
    import eval as quality_eval
    from transformers import AutoModelForCausalLM

    from tests.server import running_server

    policies = ["full", "streaming:window=16", "sfi:budget=16:recent=8", "quest"]
    with running_server(smoke_ckpt, "sgl_sparse", extra_args=["--enable-metrics"]) as h:
        res = quality_eval.evaluate(h.url, policies, [160], [0.5], n=1, concurrency=4, log=lambda *_: None,
                                    dump_failures=1)
        ex = tasks.make_example(160, 0.5, "think", 2024)
        spec = quality_eval.PolicySpec.parse("full")
        served = quality_eval.generate(h.url, ex.prompt, spec, 12).json()["output_ids"]
    rows = {r["policy"]: r for r in res["rows"]}
    assert set(rows) == {"full", "streaming:window=16", "sfi:budget=16:recent=8", "quest"}
    assert not res["not_available"]
    assert rows["quest"]["decode_steps"] > 0  # its default budget covers 160 tokens: dense
    assert rows["full"]["retention"] == 1.0 and rows["full"]["slow_ratio"] == 0.0
    assert rows["full"]["decode_steps"] > 0
    # per variant, from the responses' meta_info summaries: full attends everything
    for v in ("plain", "think"):
        st = rows["full"]["by_variant_stats"][v]
        assert st["requests"] == 1 and st["retention"] == 1.0 and st["decode_steps_mean"] > 0
    assert 0 < rows["streaming:window=16"]["by_variant_stats"]["think"]["retention"] < 0.2
    assert 0 < rows["streaming:window=16"]["retention"] < 0.2
    assert 0 < rows["sfi:budget=16:recent=8"]["slow_ratio"] < 1
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in rows.values())
    for r in rows.values():  # --dump-failures 1: one record per row that missed any prompt
        assert len(r["failures"]) == (1 if r["accuracy"] < 1.0 else 0)
        assert all(f["variant"] in ("plain", "think") and f["expected"] for f in r["failures"])
    # What the server decodes under `full` is what transformers decodes greedily.
    model = AutoModelForCausalLM.from_pretrained(smoke_ckpt, dtype=torch.float32)
    ref = model.generate(torch.tensor([ex.prompt]), max_new_tokens=12, do_sample=False)[0, len(ex.prompt):]
    n = min(len(served), len(ref))
    assert n > 0 and served[:n] == ref[:n].tolist()
    md = quality_eval.markdown(res)
    assert "not available" not in md and "`streaming:window=16`" in md and "`quest`" in md
