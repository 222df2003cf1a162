"""Pooling for embedding requests: their final hidden states (after the model's last norm) -> one vector each.

Runs only in steps that hold a pooling request. "last" takes the hidden state of the prompt's last token, in the step
that computes it; "mean" adds each chunk's hidden states to a running float32 sum kept with the request's state, so
chunked prefill pools the same as one whole prompt, and divides by the prompt's length in its last chunk.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from vx.gpu.input_batch import CachedRequestState

logger = logging.getLogger(__name__)


def pool_step(states: list[CachedRequestState], rows: list[int], hidden: torch.Tensor, query_start_loc: np.ndarray,
              seq_lens: np.ndarray, failed: dict[str, str]) -> dict[str, list[float]] | None:
    """Pool batch rows `rows` (row i: `states[i]`, its tokens at `hidden[query_start_loc[i]:query_start_loc[i+1]]`):
    the embedding of each pooling request whose prompt this step finishes. A request whose pooling raises fails
    alone (added to `failed`)."""
    out: dict[str, list[float]] = {}
    for i in rows:
        state = states[i]
        if state.req_id in failed:
            continue
        try:
            vector = _pool_row(state, hidden[int(query_start_loc[i]):int(query_start_loc[i + 1])],
                               done=int(seq_lens[i]) >= state.num_tokens)
        except Exception as e:  # noqa: BLE001 - this request fails alone
            failed[state.req_id] = f"pooling failed: {type(e).__name__}: {e}"
            logger.warning("vx: request %r failed alone: pooling raised %s: %s", state.req_id, type(e).__name__, e)
            continue
        if vector is not None:
            out[state.req_id] = vector
    return out or None


def _pool_row(state: CachedRequestState, chunk: torch.Tensor, done: bool) -> list[float] | None:
    """Add one chunk of a request's hidden states [n, hidden]; its embedding once `done` (its prompt's end)."""
    params = state.pooling_params
    assert params is not None
    if params.pooling_type == "mean":
        chunk_sum = chunk.float().sum(dim=0)
        state.pooled_sum = chunk_sum if state.pooled_sum is None else state.pooled_sum + chunk_sum
        state.num_pooled_tokens += chunk.shape[0]
        if not done:
            return None
        if state.num_pooled_tokens != state.num_tokens:
            # The scheduler runs every prompt token of a mean-pooling request (no prefix-cache hit): a mean over
            # fewer would be a silently wrong embedding.
            raise RuntimeError(f"mean pooling saw {state.num_pooled_tokens} of {state.num_tokens} prompt tokens")
        vector = state.pooled_sum / state.num_pooled_tokens
    else:
        if not done:
            return None
        vector = chunk[-1].float()
    if params.dimensions is not None:
        vector = vector[:params.dimensions]  # Matryoshka: the leading dimensions, re-normalised below
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, p=2.0, dim=0)
    return vector.cpu().tolist()
