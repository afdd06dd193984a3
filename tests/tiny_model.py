"""Build a tiny random Qwen3 model + tokenizer, fully offline.

    from tests.tiny_model import make_tiny_qwen3
    model_dir = make_tiny_qwen3("/tmp/tiny-qwen3", seed=0)

or from the command line::

    python tests/tiny_model.py OUT_DIR [--seed 0] [--num-layers 2]

The result is a normal Hugging Face model directory (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` with a
chat template, ``generation_config.json``) that SGLang can serve on CPU.

* Architecture: ``Qwen3ForCausalLM`` (hidden 64, 2 layers, 4 query heads /
  2 KV heads (GQA), head_dim 32, max_position_embeddings 4096 by default).
* Weights: random, drawn with ``torch.manual_seed(seed)``; saved in float32
  (``config.dtype == "float32"``).  NOTE: SGLang's ``--dtype auto`` turns a
  float32 checkpoint into float16, so serve it with ``--dtype float32``
  (``tests/server.py`` does) or ``--dtype bfloat16``.
* Weight scale: linear weights are N(0, weight_gain**2 / fan_in) with
  ``weight_gain`` 2.0, embeddings N(0, 1), and the q/k-norm gains
  (``qk_norm_gain``) default to 3.0 -- far above HF's init (std 0.02) -- so
  attention is sharp and greedy continuations depend on which context tokens
  are attended to: dropping/altering context changes the output.
* Tokenizer: BPE (Metaspace pre-tokenizer, printable-ASCII alphabet plus
  newline) trained with the ``tokenizers`` library on a generated corpus (no
  download); every token decodes to clean text, other characters become
  ``<unk>``.  Special tokens: ``<|endoftext|>`` (pad), ``<|im_start|>``,
  ``<|im_end|>`` (eos), ``<unk>``; added (non-special, like Qwen3) tokens
  ``<think>``, ``</think>``.
  Chat template: Qwen/ChatML style (``enable_thinking=False`` adds an empty
  think block).  ``config.vocab_size == len(tokenizer)`` (512 by default).
* Deterministic: the same arguments produce identical files (across the
  sglang 0.5.17 / 0.5.23 venvs too; only ``transformers_version`` in
  config.json differs).  SGLang's greedy output on CPU matches HF
  ``generate()`` token for token.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path
from typing import Union

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK_TOKENS = ["<think>", "</think>"]

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

_COMMON_WORDS = (
    "the a an of to and in is it that for on with as was by at be this from "
    "or are not have has had but they you we he she his her their one two "
    "three four five six seven eight nine ten number word token model cache "
    "attention query key value sparse dense full policy request answer "
    "question hello world user assistant system think thought reason because "
    "what which when where who how why yes no true false count list story "
    "red green blue cat dog bird fish tree river city name date time day"
).split()
_SYLLABLES = (
    "ka ki ku ke ko sa si su se so ta ti tu te to na ni nu ne no ra ri ru re ro "
    "ma mi mu me mo la li lu le lo pa pi pu pe po ba bi bu be bo da di du de do "
    "zor vel qua nix tal mor fen gar lum pex"
).split()


def _corpus(seed: int, num_lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    words = list(_COMMON_WORDS)
    for _ in range(600):
        words.append("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))))
    lines = []
    for i in range(num_lines):
        n = rng.randint(4, 16)
        sent = [rng.choice(words) for _ in range(n)]
        if rng.random() < 0.3:
            sent.insert(rng.randrange(len(sent)), str(rng.randint(0, 9999)))
        if rng.random() < 0.5:
            sent[0] = sent[0].capitalize()
        lines.append(" ".join(sent) + rng.choice([".", ",", "?", "!", ":", ";"]))
        if i % 50 == 0:
            lines.append("<think> " + " ".join(sent[:4]) + " </think>")
    return lines


def _train_tokenizer(seed: int, vocab_size: int):
    import string

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    # Metaspace BPE over printable ASCII (+ "\n"): every token decodes to clean
    # text (unlike byte-level BPE, whose random outputs are mostly invalid
    # UTF-8 fragments).  Characters outside the alphabet encode as <unk>.
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="never")
    alphabet = sorted(set(string.printable) - set(" \t\r\x0b\x0c") | {"\u2581"})
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS + ["<unk>"],
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    # Like Qwen3: <think>/</think> are added tokens but not "special", so they
    # survive skip_special_tokens in detokenization.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return tok


def make_tiny_qwen3(
    out_dir: Union[str, os.PathLike],
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 32,
    tokenizer_vocab_size: int = 512,
    max_position_embeddings: int = 4096,
    weight_gain: float = 2.0,
    qk_norm_gain: float = 3.0,
    tie_word_embeddings: bool = False,
    overwrite: bool = False,
) -> Path:
    """Create the model directory ``out_dir`` and return its path.

    If ``out_dir`` already holds a model made with the same arguments (see
    ``tiny_model_args.json``) it is reused unless ``overwrite``.
    """
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    args = dict(
        seed=seed,
        num_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        tokenizer_vocab_size=tokenizer_vocab_size,
        max_position_embeddings=max_position_embeddings,
        weight_gain=weight_gain,
        qk_norm_gain=qk_norm_gain,
        tie_word_embeddings=tie_word_embeddings,
        version=2,
    )
    stamp = out / "tiny_model_args.json"
    if not overwrite and stamp.exists() and json.loads(stamp.read_text()) == args:
        return out
    out.mkdir(parents=True, exist_ok=True)

    # --- tokenizer --------------------------------------------------------
    raw_tok = _train_tokenizer(seed, tokenizer_vocab_size)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw_tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    vocab_size = len(tokenizer)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS + THINK_TOKENS}
    assert all(i is not None and i < vocab_size for i in ids.values()), ids

    # --- model ------------------------------------------------------------
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=num_layers,
        attention_bias=False,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("q_norm.weight") or name.endswith("k_norm.weight"):
                # Sharper attention: larger q/k after the per-head RMSNorm.
                p.copy_(qk_norm_gain * (1.0 + 0.1 * torch.randn(p.shape, generator=gen)))
            elif "norm" in name:
                p.fill_(1.0)
            elif p.dim() >= 2:
                std = weight_gain / (p.shape[-1] ** 0.5)
                if name.endswith("embed_tokens.weight"):
                    std = 1.0
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            else:
                p.zero_()
    model.config.dtype = torch.float32
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # Deterministic generation config: only eos/pad/bos, no sampling defaults.
    (out / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": ids["<|endoftext|>"],
                "eos_token_id": ids["<|im_end|>"],
                "pad_token_id": ids["<|endoftext|>"],
            },
            indent=2,
        )
        + "\n"
    )
    stamp.write_text(json.dumps(args, indent=2, sort_keys=True) + "\n")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--overwrite", action="store_true")
    a = ap.parse_args()
    print(make_tiny_qwen3(a.out_dir, seed=a.seed, num_layers=a.num_layers, overwrite=a.overwrite))


if __name__ == "__main__":
    main()
