#!/usr/bin/env python3
"""SFI's sentence-trigger ids for the Qwen2/Qwen3 vocabulary, without a model hub.

The GPU benchmark models have random weights and no tokenizer (the machine is
offline). Qwen2/Qwen3 share Qwen's byte-level BPE: the 151643 regular tokens of
`qwen.tiktoken` (shipped in the `dashscope` wheel on PyPI) with the same ids. This
writes the ids whose UTF-8 text ends with one of SFI's default trigger suffixes,
exactly as sgl_sparse.policies.sfi.sentence_trigger_table would from the HF
tokenizer, for `trigger_ids_path` in --sparse-config.

    pip download --no-deps dashscope && unzip -o dashscope-*.whl 'dashscope/resources/qwen.tiktoken'
    python bench/gpu/qwen3_trigger_ids.py dashscope/resources/qwen.tiktoken bench/gpu/qwen3_trigger_ids.txt
"""
import base64
import sys

from sgl_sparse.config import SparseServerConfig


def main(src: str, dst: str) -> None:
    suffixes = tuple(SparseServerConfig().trigger_suffixes)
    ids, total = [], 0
    for line in open(src, "rb"):
        if not line.strip():
            continue
        tok, rank = line.split()
        text = base64.b64decode(tok).decode("utf-8", errors="replace")
        total += 1
        if text.endswith(suffixes):
            ids.append(int(rank))
    with open(dst, "w") as f:
        f.write(f"# {len(ids)} of {total} Qwen BPE ids end with one of {suffixes!r}\n")
        f.write("\n".join(map(str, ids)) + "\n")
    print(f"{len(ids)} / {total} trigger ids -> {dst}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
