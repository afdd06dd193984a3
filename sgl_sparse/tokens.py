"""Control-token ids the policies react to, resolved once from the tokenizer."""

from __future__ import annotations

import logging
from typing import Optional

from sgl_sparse.config import SparseServerConfig

logger = logging.getLogger(__name__)


def _lookup(tokenizer, token: str) -> Optional[int]:
    # An added/special token maps to one id; anything the tokenizer would split
    # or map to <unk> cannot be recognised from a single generated id.
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        return None
    unk = getattr(tokenizer, "unk_token_id", None)
    return None if unk is not None and ids[0] == unk else int(ids[0])


def resolve_think_ids(
    cfg: SparseServerConfig, tokenizer_path: Optional[str], trust_remote_code: bool = False
) -> SparseServerConfig:
    """Fill think_start_id / think_end_id from the tokenizer unless given explicitly."""
    if cfg.think_start_id is not None and cfg.think_end_id is not None:
        return cfg
    if not tokenizer_path:
        logger.warning("sgl_sparse: no tokenizer path; policy 'sadas' is unavailable")
        return cfg
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)
    except Exception as e:  # a tokenizer we cannot load only disables SADAS
        logger.warning("sgl_sparse: cannot load tokenizer %r (%s); 'sadas' unavailable", tokenizer_path, e)
        return cfg
    start = cfg.think_start_id if cfg.think_start_id is not None else _lookup(tok, cfg.think_start_token)
    end = cfg.think_end_id if cfg.think_end_id is not None else _lookup(tok, cfg.think_end_token)
    if start is None or end is None:
        logger.warning(
            "sgl_sparse: tokenizer %r has no single-id %r/%r tokens; policy 'sadas' is "
            "unavailable (set think_start_id/think_end_id in --sparse-config)",
            tokenizer_path, cfg.think_start_token, cfg.think_end_token,
        )
        return cfg
    return cfg.model_copy(update={"think_start_id": start, "think_end_id": end})


def sentence_trigger_ids(cfg: SparseServerConfig, vocab_size: int):
    """SFI's trigger set as a bool table over the model's vocabulary.

    Built once per scheduler process from the tokenizer (`cfg.tokenizer_path`).
    Without a loadable tokenizer the table is empty: slow steps then come from
    the refresh budget and the first decode step only (logged).
    """
    import numpy as np

    from sgl_sparse.policies.sfi import sentence_trigger_table

    empty = np.zeros(max(vocab_size, 1), dtype=bool)
    if cfg.trigger_ids_path:
        return _trigger_ids_from_file(cfg.trigger_ids_path, vocab_size)
    if not cfg.tokenizer_path:
        logger.warning("sgl_sparse: no tokenizer path; 'sfi' sentence triggers are off")
        return empty
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(cfg.tokenizer_path, trust_remote_code=cfg.trust_remote_code)
        table = sentence_trigger_table(tok, cfg.trigger_suffixes, vocab_size)
    except Exception as e:  # SFI still runs on its refresh budget
        logger.warning("sgl_sparse: cannot build SFI's trigger set from %r (%s); sentence triggers off",
                       cfg.tokenizer_path, e)
        return empty
    logger.info("sgl_sparse: SFI trigger set: %d of %d ids end a sentence", int(table.sum()), len(table))
    return table


def _trigger_ids_from_file(path: str, vocab_size: int):
    import numpy as np

    try:
        lines = open(path).read().splitlines()
        ids = [int(x) for line in lines for x in line.split("#", 1)[0].split()]
    except (OSError, ValueError) as e:
        raise ValueError(f"--sparse-config trigger_ids_path: cannot read ids from {path!r}: {e}") from None
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"--sparse-config trigger_ids_path: ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    table = np.zeros(max(vocab_size, 1), dtype=bool)
    table[ids] = True
    logger.info("sgl_sparse: SFI trigger set: %d ids from %s", len(ids), path)
    return table
