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
@pytest.mark.parametrize("variant", ["plain", "think"])
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
        if variant == "think":
            assert ex.prompt[-1] == tasks.ID[tasks.THINK]
            assert not set(ex.answer) & set(ex.completion[: ex.completion.index(tasks.ID[tasks.END_THINK])])


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
def test_fidelity_values_are_sane(smoke_ckpt):
    import fidelity

    model = fidelity.load_model(str(smoke_ckpt))
    res = fidelity.evaluate(model, [200], budgets=[8, 32, 100_000], n_examples=2, sfi_recent=8, sfi_window=8)
    rows = {(r["policy"], r["budget"]): r for r in res["rows"]}
    assert not res["not_available"]  # sgl_sparse's Selector is importable here
    assert rows[("full", None)]["rel_err_max"] == 0.0 and rows[("full", None)]["overlap"] == 1.0
    for name in ("streaming", "quest", "sfi", "oracle"):
        big = rows[(name, 100_000)]  # budget covers every token: dense
        assert big["rel_err_max"] < 1e-6 and big["overlap"] == 1.0 and big["retention"] == 1.0, name
        small = rows[(name, 8)]
        assert 0 < small["retention"] < 1 and 0 <= small["overlap"] <= 1 and 0 < small["mass"] < 1, name
    for b in (8, 32):
        assert rows[("oracle", b)]["overlap"] == 1.0
        # the exact top-k keeps the most attention mass of all sets of its size or smaller
        assert rows[("oracle", b)]["mass"] >= rows[("streaming", b)]["mass"] * 0.999 - 1e-6 or \
            rows[("streaming", b)]["retention"] > rows[("oracle", b)]["retention"]
    assert rows[("streaming", 8)]["rel_err"] > 0


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
