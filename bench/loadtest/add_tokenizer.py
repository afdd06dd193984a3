#!/usr/bin/env python3
"""Give a random-weights benchmark checkpoint a tokenizer, so it can serve text.

    python bench/loadtest/add_tokenizer.py /root/model

bench/gpu/make_random_model.py writes weights only (its benchmarks send token ids
with --skip-tokenizer-init); the load test sends text through the OpenAI API and
/generate. This writes a word-level tokenizer whose vocabulary has exactly the
model's ``vocab_size`` entries, so that every id a random model generates decodes
to a visible word (with a small real tokenizer most ids would decode to nothing and
chat streams would show no tokens), with the words, numbers and punctuation of the
load test's prompts as single tokens and ChatML/think tokens at Qwen3's ids when
the vocabulary is Qwen3-sized (151667/151668 for <think>/</think>, what
bench/gpu/sparse_config.yaml gives SADAS).
"""

from __future__ import annotations

import argparse
import json
import string
import sys
from pathlib import Path

# Qwen3's ids for its special tokens; used when the vocabulary is large enough.
QWEN3_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
             "<think>": 151667, "</think>": 151668}
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>\\n' -}}{%- endif -%}"
)


def prompt_words() -> list[str]:
    """Every word of the load test's generated prompts (loadtest/sparseload/prompts.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "loadtest"))
    from sparseload.prompts import vocabulary

    return vocabulary()


def build_vocab(vocab_size: int) -> dict[str, int]:
    specials = dict(QWEN3_IDS) if vocab_size > max(QWEN3_IDS.values()) else {
        tok: vocab_size - len(QWEN3_IDS) + i for i, tok in enumerate(QWEN3_IDS)}
    taken = set(specials.values())
    regular = ["<unk>", *prompt_words(), *string.ascii_letters, *string.punctuation,
               *(str(n) for n in range(10000))]
    vocab: dict[str, int] = dict(specials)
    ids = (i for i in range(vocab_size) if i not in taken)
    for tok in regular:  # a small vocabulary keeps what fits; the rest is <unk>
        if tok not in vocab:
            i = next(ids, None)
            if i is None:
                break
            vocab[tok] = i
    for i in ids:  # filler words for the rest: every id decodes to something visible
        vocab[f"w{i}"] = i
    return vocab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    a = ap.parse_args()
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model_dir = Path(a.model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    vocab_size = config["vocab_size"]
    vocab = build_vocab(vocab_size)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # words and runs of punctuation
    # Matched in raw text before splitting, keeping their vocabulary ids; not
    # "special", like Qwen3's think tokens, so detokenization keeps them.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>",
                                   model_max_length=config.get("max_position_embeddings", 1 << 20),
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(model_dir)
    think = [fast.convert_tokens_to_ids(t) for t in ("<think>", "</think>")]
    print(f"tokenizer with {len(fast)} tokens (model vocab {vocab_size}) in {model_dir}; <think>/</think> = {think}")


if __name__ == "__main__":
    main()
