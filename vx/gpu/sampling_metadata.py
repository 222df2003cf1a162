"""Per-step sampling controls for a batch, as device tensors the `Sampler` reads.

The ModelRunner builds one `SamplingMetadata` per step from the `SamplingParams` of the rows that sample. Features
that no row uses are left `None`, so the sampler skips their kernels entirely (the common all-default batch pays
for a softmax and one exponential draw, nothing else).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from vx.gpu.logits_processor import LogitsProcessorChain, build_logits_processors
from vx.sampling_params import SamplingParams


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A fresh generator for one seeded request, on the device the sampler runs on; None for an unseeded one
    (it draws from the device's default generator).

    Seeds may be negative (SamplingParams allows any int64); they are folded into uint64 so that
    every valid seed maps to one distinct generator state.
    """
    if seed is None:
        return None
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


@dataclass
class SamplingMetadata:
    """Sampling controls for the B rows that sample this step; row i is row i of the logits.

    `temperature` is 0 for greedy rows. `top_k` (0 = off), `top_p` and `min_p` are None when no random row
    uses them. `generators` maps a row to its request's own generator (seeded requests only).
    `logits_processors` (penalties, logit bias, min tokens, bad words) is None when no row uses any of them.
    """

    temperature: torch.Tensor  # float32 [B]
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None = None  # int64 [B]
    top_p: torch.Tensor | None = None  # float32 [B]
    min_p: torch.Tensor | None = None  # float32 [B]
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    max_num_logprobs: int | None = None  # the largest `logprobs` asked for in the batch; None: no row asked
    logits_processors: LogitsProcessorChain | None = None  # applied to every row (greedy too) before temperature

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: dict[int, torch.Generator],
        device: torch.device | str,
        *,
        output_token_ids: Sequence[Sequence[int]] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        eos_token_ids: Sequence[Sequence[int]] | None = None,
        bad_words_token_ids: Sequence[Sequence[Sequence[int]] | None] | None = None,
    ) -> "SamplingMetadata":
        """Tensors for `params` (one per row) on `device`.

        The token lists (one per row; `output_token_ids` None means no token generated yet) feed the logits
        processors, which are built only when some row uses one.

        Every float column goes to the device in one `torch.tensor` call (one host-to-device copy). Greedy rows
        get neutral values (temperature 0, top_k 0, top_p 1, min_p 0), so a greedy row never switches a feature
        on: whether a feature runs depends only on the random rows.
        """
        greedy = [p.greedy for p in params]
        num_greedy = sum(greedy)
        all_greedy = num_greedy == len(params)
        all_random = num_greedy == 0

        temps = [0.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        use_top_k = use_top_p = use_min_p = False
        if not all_greedy:
            # Decide per feature whether any random row needs it; unused features stay None.
            use_top_k = any(p.top_k > 0 and not g for p, g in zip(params, greedy))
            use_top_p = any(p.top_p < 1.0 and not g for p, g in zip(params, greedy))
            use_min_p = any(p.min_p > 0.0 and not g for p, g in zip(params, greedy))

        float_cols = [temps]
        if use_top_p:
            float_cols.append([1.0 if g else float(p.top_p) for p, g in zip(params, greedy)])
        if use_min_p:
            float_cols.append([0.0 if g else float(p.min_p) for p, g in zip(params, greedy)])
        # [n_cols, B] contiguous, so each row view below is itself contiguous.
        floats = torch.tensor(float_cols, dtype=torch.float32, device=device)
        col = iter(floats)
        temperature = next(col)
        top_p = next(col) if use_top_p else None
        min_p = next(col) if use_min_p else None

        top_k = None
        if use_top_k:
            top_k = torch.tensor(
                [0 if g else p.top_k for p, g in zip(params, greedy)], dtype=torch.int64, device=device
            )

        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        outputs = output_token_ids if output_token_ids is not None else [()] * len(params)
        procs = build_logits_processors(params, outputs, prompt_token_ids, eos_token_ids, bad_words_token_ids)
        return cls(
            temperature=temperature,
            all_greedy=all_greedy,
            all_random=all_random,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            # A greedy row never draws, so its generator is left out (and its state left untouched).
            generators={i: g for i, g in generators.items() if not greedy[i]},
            max_num_logprobs=max(logprobs) if logprobs else None,
            logits_processors=procs,
        )
