"""Structured output in the runner: mask, in the whole batch at once, the tokens each row's grammar forbids."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: np.ndarray, bitmask_req_ids: Sequence[str],
                          row_req_ids: Sequence[str]) -> None:
    """Set to -inf, in place, every logit whose token the grammar of its row forbids.

    Row i of `bitmask` (int32, bit t set = token t allowed) belongs to request `bitmask_req_ids[i]`; row j of
    `logits` [B, V] to `row_req_ids[j]`. xgrammar's kernel reads bitmask row j for logits row j, so the rows are
    scattered into a batch-wide bitmask first (rows without a grammar allow everything and are skipped anyway).
    """
    import xgrammar as xgr  # only engines that serve structured output pay for the import

    row_of = {req_id: j for j, req_id in enumerate(row_req_ids)}
    rows = [row_of[req_id] for req_id in bitmask_req_ids]
    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
    full[rows] = torch.from_numpy(bitmask)
    xgr.apply_token_bitmask_inplace(logits, full.to(logits.device, non_blocking=True), indices=rows,
                                    vocab_size=logits.shape[-1])
