"""The batched token sampler: one next token per row from the last-position logits.

First the logits processors (penalties, logit bias, min tokens, bad words), if any row uses one, edit a copy of the
logits of every row. Greedy rows then take the argmax. Random rows apply temperature, then top-k, then top-p, then
min-p, and draw. On CUDA the draw is the exponential race: argmax(probs / q), q ~ Exponential(1) i.i.d. per token,
picks token i with probability probs[i] / sum(probs), with no normalisation, cumulative sum or host sync. On CPU,
where one exponential per vocabulary entry costs far more than a cumulative sum, it is the inverse CDF of one
uniform number per row. Either way each seeded row draws from its own generator, so a seeded request samples the
same tokens whatever batch it is in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vx.gpu.sampling_metadata import SamplingMetadata
from vx.sampling_params import GREEDY_TEMPERATURE_EPS

# Smallest q we divide by: Exponential(1) can return exactly 0, and 0/0 would be NaN, which argmax would pick.
_Q_MIN = torch.finfo(torch.float32).tiny


@dataclass
class SamplerOutput:
    """What the sampler gives back for one step."""

    sampled_token_ids: torch.Tensor  # int64 [B]
    # When some row asked for `logprobs` (k = the most asked for): see `gather_logprobs`.
    logprobs: "LogprobsTensors | None" = None


@dataclass
class LogprobsTensors:
    """Per row: the chosen token then the top-k tokens, their raw logprobs, and the chosen token's rank."""

    token_ids: torch.Tensor  # int64 [B, k + 1]
    logprobs: torch.Tensor  # float32 [B, k + 1]
    ranks: torch.Tensor  # int64 [B]


class Sampler(nn.Module):
    """Samples one token per row of `logits` under `SamplingMetadata`; holds no state."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Token ids [B] for float logits [B, V]. Does not modify `logits`."""
        # Raw logprobs (vLLM's default): of the model's logits, before any processing.
        raw_logprobs = None if metadata.max_num_logprobs is None else logits.float().log_softmax(dim=-1)
        out = self._sample(logits, metadata)
        if raw_logprobs is not None:
            out.logprobs = gather_logprobs(raw_logprobs, out.sampled_token_ids, metadata.max_num_logprobs)
        return out

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if metadata.logits_processors is not None:
            # The processors write in place: on a copy, never the caller's tensor.
            logits = logits.float() if logits.dtype != torch.float32 else logits.clone()
            logits = metadata.logits_processors(logits)
        elif not metadata.all_greedy:
            logits = logits.float()  # bf16/fp16 logits would lose too much in softmax
        if metadata.all_greedy:
            # Fast path: nothing random in the batch, so one argmax is the whole step; unprocessed logits in their
            # own dtype (widening to float32 keeps their order, so the same tokens).
            return SamplerOutput(sampled_token_ids=greedy_token_ids(logits))

        greedy_ids = None if metadata.all_random else greedy_token_ids(logits)
        sampled = self._sample_random(logits, metadata)
        if greedy_ids is not None:
            # Greedy rows take the argmax of the (processed) logits, not of anything temperature-derived.
            sampled = torch.where(metadata.temperature < GREEDY_TEMPERATURE_EPS, greedy_ids, sampled)
        return SamplerOutput(sampled_token_ids=sampled)

    def _sample_random(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Token ids for every row as if all were random; greedy rows' results are discarded by the caller."""
        temp = md.temperature
        if not md.all_random:
            # Greedy rows have temperature 0; divide them by 1 instead so they stay finite (then get replaced).
            temp = torch.where(temp < GREEDY_TEMPERATURE_EPS, torch.ones_like(temp), temp)
        logits = logits / temp.unsqueeze(1)  # a new tensor: the in-place steps below never touch the caller's

        if md.top_k is not None or md.top_p is not None:
            logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        probs = logits.softmax(dim=-1)
        if md.min_p is not None:
            probs = apply_min_p(probs, md.min_p)
        if probs.device.type == "cpu":
            return inverse_cdf_sample(probs, md.generators)
        return exponential_race(probs, md.generators)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """For each row of `logprobs` [B, V]: the logprob and rank of `token_ids` [B], then the top-`k` tokens.

    The rank counts the tokens strictly more likely than the chosen one, plus one (ties share the better rank).
    """
    chosen = logprobs.gather(1, token_ids.view(-1, 1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    k = min(k, logprobs.shape[-1])
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)
        ids = torch.cat([token_ids.view(-1, 1), top_ids], dim=1)
        lps = torch.cat([chosen, top_lp], dim=1)
    else:
        ids, lps = token_ids.view(-1, 1), chosen
    return LogprobsTensors(token_ids=ids, logprobs=lps, ranks=ranks)


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Set to -inf every logit outside the row's top `k` (0 = off), then outside its top-`p` nucleus.

    One ascending sort serves both filters: top-k masks a prefix of sorted positions, top-p masks the sorted
    positions whose cumulative probability (from the bottom) stays within 1 - p. The result is scattered back to
    vocabulary order, so downstream draws (and hence seeded samples) never depend on whether other rows in the
    batch switched these filters on. Returns a new tensor; `logits` may be overwritten.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if k is not None:
        # Keep exactly the last k sorted positions (ties at the cut are broken by the sort, as with torch.topk).
        # k = 0 means off, and k >= V leaves a non-positive cut, which masks nothing.
        cut = torch.where(k > 0, vocab - k, torch.zeros_like(k))
        positions = torch.arange(vocab, device=logits.device)
        sorted_logits.masked_fill_(positions.unsqueeze(0) < cut.unsqueeze(1), float("-inf"))
    if p is not None:
        # Probabilities after top-k, i.e. renormalised over the kept tokens, as in vLLM.
        cum = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
        # A token goes when the tokens above it already hold >= p: cum (mass at or below it) <= 1 - p.
        drop = cum <= (1.0 - p).unsqueeze(1)
        drop[:, -1] = False  # the top token always stays, even if rounding says otherwise
        sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter_(dim=-1, index=order, src=sorted_logits)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero, in place, every prob below min_p times the row's largest prob; min_p = 0 keeps all.

    The probs are not renormalised: the exponential race is invariant to a row's scale.
    """
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return probs.masked_fill_(probs < threshold, 0.0)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row drawn in proportion to `probs` (non-negative, not necessarily normalised).

    Unseeded rows share one draw from the default generator; each seeded row then redraws its q from its own
    generator, so its sample depends only on its probs and its generator state, never on its batch. `probs` is
    overwritten.
    """
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    q.clamp_min_(_Q_MIN)
    return greedy_token_ids(probs.div_(q))


def greedy_token_ids(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of equal maxima, as `argmax`): through `max`, whose CPU kernel is vectorized
    where `argmax`'s is not (vocabulary-wide rows: 2.2x faster in float32, 4.5x in bf16, measured on 64 x 49,152)."""
    return logits.max(dim=-1).indices


def inverse_cdf_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row drawn in proportion to `probs` (non-negative, not necessarily normalised), by CDF.

    The CPU choice: one uniform number per row and a cumulative sum cost far less than an exponential draw per
    vocabulary entry (measured: 36 ms -> ~3 ms per step at 32 x 49152). Unseeded rows share one draw from the
    default generator; a seeded row draws its number from its own generator, so its sample depends only on its
    probs and its generator state. `probs` is overwritten.
    """
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device)
    for row, gen in generators.items():
        u[row] = torch.rand(1, generator=gen, dtype=torch.float64, device=probs.device)
    cum = probs.cumsum_(dim=-1)
    # right=True: the first token whose cumulative mass exceeds the target, so zero-mass tokens are never hit.
    target = (u * cum[:, -1:].double()).to(cum.dtype)
    return torch.searchsorted(cum, target, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(1)
