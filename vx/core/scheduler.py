"""Continuous-batching scheduler: a token budget per step, chunked prefill, preemption by recompute."""

from __future__ import annotations

import itertools
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

from vx.cache import KVCacheManager
from vx.config import CacheConfig, SchedulerConfig
from vx.core.fair_share import TokenShares, seat_claims, token_shares
from vx.core.protocol import EngineCoreOutput, EngineCoreOutputs, InputError
from vx.core.request import Request, RequestStatus
from vx.core.request_queue import make_request_queue
from vx.step import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput, TokenLogprobs

if TYPE_CHECKING:
    from vx.core.structured_output import StructuredOutputManager


class Scheduler:
    """Decides each step which requests compute how many tokens, and applies the results.

    Running requests go first, in admission order; each gets the tokens it still lacks (prefill
    chunk or one decode token) while the token budget lasts. When the KV cache cannot grow a
    running request, one running request is preempted: the latest admitted ("fcfs"), or the one with
    the largest (priority, arrival time) ("priority"). Its blocks are freed and it goes back to the
    waiting queue ahead of its peers, to resume later from whatever prefix is still cached.
    Waiting requests are admitted in queue order (arrival, or priority then arrival), only in steps
    in which the KV cache preempted nothing.

    Under "fcfs", clients share each step fairly (vx/core/fair_share.py): no request group (one request, or the n
    children of one) takes more than its fair part of the token budget while another wants tokens, and a full
    batch gives a seat back to a waiting client that holds fewer than its part. "priority" keeps strict priority.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 kv_cache_manager: KVCacheManager,
                 structured_output_manager: StructuredOutputManager | None = None, *, max_model_len: int) -> None:
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len  # the model's (ModelConfig.max_model_len)
        self.requests: dict[str, Request] = {}
        self.policy = scheduler_config.policy
        self.waiting = make_request_queue(self.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.num_steps = 0
        # Structured output (None: requests with `structured_outputs` are refused).
        self.structured_output_manager = structured_output_manager
        # Requests that failed alone (a grammar that does not compile, sampling that raised): ended, and reported
        # with the next outputs. `_failing` holds those found while planning a step; they end once it has run
        # (their blocks may be written, or shared by another request, in that step).
        self._errors: list[InputError] = []
        self._failing: list[InputError] = []

    # ---------------------------------------------------------------- intake
    def add_request(self, request: Request) -> None:
        """Queue a new request; a request id that is still live is refused."""
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already running; ids must be unique "
                             "among live requests.")
        structured_outputs = request.sampling_params.structured_outputs
        if structured_outputs is not None:
            if self.structured_output_manager is None:
                raise ValueError("structured_outputs is not supported by this scheduler (it has no "
                                 "StructuredOutputManager).")
            # The grammar compiles in the background; the request is admitted once it is ready.
            stop_ids = sorted(request.eos_token_ids) + list(request.sampling_params.stop_token_ids or [])
            self.structured_output_manager.add_request(request.request_id, structured_outputs, stop_ids)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[str]:
        """End requests from outside (abort); unknown or already-ended ids are ignored."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._free(req)
            done.append(rid)
        return done

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # -------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """Plan one step under `max_num_batched_tokens` and `max_num_seqs`: running requests first, then (in a step
        that preempted nothing) waiting ones; then the grammar bitmask of the constrained rows that sample."""
        grammars = self.structured_output_manager
        if grammars is not None and grammars.num_pending:
            for error in grammars.update():  # compiles that failed (or timed out) since the last step
                self._fail(error)
        if grammars is not None and grammars.num_requests:
            for error in grammars.check_masks():  # grammars whose masks keep missing the budget
                self._fail(error)
            # Each request's next mask has been filling since its last token (or its compile); the quick ones get
            # the budget to finish, the rest sit this step out.
            candidates = itertools.chain(self.running, itertools.islice(self.waiting, self.config.max_num_seqs))
            grammars.wait_for_masks([r.request_id for r in candidates
                                     if r.sampling_params.structured_outputs is not None])
        plan = _StepPlan(budget=self.config.max_num_batched_tokens)
        if self.policy == "fcfs":
            self._give_back_seats(plan)
            plan.shares = self._token_shares()
        self._schedule_running(plan)
        if not plan.out_of_kv:
            self._schedule_waiting(plan)
        if plan.shares is not None and plan.budget > 0:
            # What the shares left unused (a client that could not start, or needed less) goes to the requests
            # that got nothing yet, in order: shares never leave the budget idle while someone could use it.
            plan.shares = None
            self._schedule_running(plan, top_up=True)
            if not plan.out_of_kv:
                self._schedule_waiting(plan)
        return self._finish_plan(plan)

    def _grammar_ready(self, req: Request) -> bool:
        """Whether `req` may be scheduled to sample now: its grammar, if any, is compiled and the mask of its next
        position is filled (unconstrained requests always are)."""
        grammars = self.structured_output_manager
        return grammars is None or grammars.is_ready(req.request_id)

    def _startable(self, limit: int) -> list[Request]:
        """The first `limit` waiting requests that could start now (their grammar, if any, is ready)."""
        scan = itertools.islice(self.waiting, 4 * limit + 16)  # bounded: a queue of pending compiles is not walked
        return list(itertools.islice(filter(self._grammar_ready, scan), limit))

    def _first_of_each_client(self, limit: int) -> list[Request]:
        """The first waiting request that could start now of each client, for the first `limit` clients in queue
        order (a client behind another's long fan-out is found too)."""
        seen: dict[str, Request] = {}
        for req in self.waiting:
            if req.group not in seen and self._grammar_ready(req):
                seen[req.group] = req
                if len(seen) >= limit:
                    break
        return list(seen.values())

    def _give_back_seats(self, plan: _StepPlan) -> None:
        """In a full batch, preempt the newest requests of clients holding more than their fair part of the seats,
        one for each waiting client below its part, and move those waiting requests to the front of the queue."""
        seats = self.config.max_num_seqs
        if len(self.running) < seats or not self.waiting:
            return
        candidates = self._first_of_each_client(seats)
        claims = seat_claims([r.group for r in self.running], [r.group for r in candidates], seats)
        for victim in [self.running[i] for i, _ in claims]:
            self.running.remove(victim)
            self._preempt(victim)
            plan.preempted_req_ids.add(victim.request_id)
        for _, position in reversed(claims):  # ahead of the preempted ones, in their queue order
            self.waiting.remove(candidates[position])
            self.waiting.prepend(candidates[position])

    def _token_shares(self) -> TokenShares | None:
        """Each client's part of this step's budget, from what its running requests and the waiting requests that
        could take a free seat still need; None when a single client wants tokens."""
        demands: Counter[str] = Counter()
        for req in self.running:
            demands[req.group] += req.num_tokens - req.num_computed_tokens
        free_seats = self.config.max_num_seqs - len(self.running)
        if free_seats > 0 and self.waiting:
            for req in self._startable(free_seats):
                demands[req.group] += req.num_tokens - req.num_computed_tokens
        return token_shares(demands, self.config.max_num_batched_tokens)

    def _schedule_running(self, plan: _StepPlan, top_up: bool = False) -> None:
        """Give each running request the tokens it still lacks while the budget lasts; when the KV cache cannot
        grow one, preempt until it can (or until it is the one preempted). `top_up`: only the requests not planned
        yet in this step."""
        kv = self.kv_cache_manager
        i = 0
        while i < len(self.running) and plan.budget > 0:
            req = self.running[i]
            if top_up and req.request_id in plan.num_scheduled_tokens:
                i += 1
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, plan.budget, plan.share_left(req.group))
            if num_new <= 0 or (req.num_computed_tokens + num_new >= req.num_tokens
                                and not self._grammar_ready(req)):
                # Nothing to compute, its client used its share of this step, or it would sample without the mask
                # of its grammar, which is still filling.
                i += 1
                continue
            while True:
                new_blocks = kv.allocate_slots(req, num_new)
                if new_blocks is not None:
                    break
                victim, victim_index = self._pop_victim()
                self._preempt(victim)
                plan.preempted_req_ids.add(victim.request_id)
                plan.out_of_kv = True
                if victim is req:
                    break
                if victim.request_id in plan.num_scheduled_tokens:
                    # The priority policy, or a top-up pass, may evict a request already planned in this step:
                    # unplan it (its new blocks went back with the rest of its blocks).
                    plan.unplan(victim.request_id, victim.group)
                if victim_index < i:
                    i -= 1  # step back over its place in `running`
            if new_blocks is None:
                break
            new_token_ids = req.output_token_ids[req.num_output_tokens_sent:]
            req.num_output_tokens_sent = req.num_output_tokens
            plan.add(CachedRequestData(req_id=req.request_id, num_computed_tokens=req.num_computed_tokens,
                                       new_token_ids=new_token_ids, new_block_ids=kv.new_block_ids(new_blocks)),
                     num_new, req.group)
            i += 1

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        """Admit waiting requests in queue order while the budget, `max_num_seqs` and the KV cache allow; one
        whose grammar still compiles lets the requests behind it go first."""
        kv = self.kv_cache_manager
        skipped: list[Request] = []
        while self.waiting and plan.budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            # A chunk can be cut to its client's share; a whole prompt (no chunked prefill) cannot.
            limited = self.config.enable_chunked_prefill and plan.shares is not None
            if not self._grammar_ready(req) or (limited and plan.share_left(req.group) <= 0):
                skipped.append(self.waiting.pop())
                continue
            if _needs_every_prompt_position(req):
                computed_blocks, num_computed = [], 0  # every prompt position must run (logprobs, mean pooling)
            else:
                computed_blocks, num_computed = kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_computed
            if not self.config.enable_chunked_prefill and num_new > plan.budget:
                break
            num_new = min(num_new, plan.budget, plan.share_left(req.group) if limited else num_new)
            if kv.allocate_slots(req, num_new, num_computed, computed_blocks) is None:
                break
            self.waiting.pop()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_computed
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_computed
            self.running.append(req)
            req.num_output_tokens_sent = req.num_output_tokens
            plan.add(NewRequestData(
                req_id=req.request_id, prompt_token_ids=req.prompt_token_ids, sampling_params=req.sampling_params,
                block_ids=kv.block_table(req.request_id), num_computed_tokens=num_computed,
                output_token_ids=list(req.output_token_ids), eos_token_ids=tuple(sorted(req.eos_token_ids)),
                bad_words_token_ids=req.bad_words_token_ids, pooling_params=req.pooling_params), num_new, req.group)
            plan.preempted_req_ids.discard(req.request_id)  # resumed in the step that preempted it
        for req in reversed(skipped):
            self.waiting.prepend(req)

    def _finish_plan(self, plan: _StepPlan) -> SchedulerOutput:
        """Advance each planned request's computed tokens, and make the step's `SchedulerOutput` (with the grammar
        bitmask of the constrained requests that sample in it)."""
        sampling: set[str] = set()
        for req_id, n in plan.num_scheduled_tokens.items():
            req = self.requests[req_id]
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens:
                sampling.add(req_id)
        out = SchedulerOutput(
            scheduled_new_reqs=plan.new_reqs, scheduled_cached_reqs=plan.cached_reqs,
            num_scheduled_tokens=plan.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(plan.num_scheduled_tokens.values()),
            finished_req_ids=self.finished_req_ids, preempted_req_ids=plan.preempted_req_ids)
        self.finished_req_ids = set()
        grammars = self.structured_output_manager
        if grammars is not None and grammars.num_requests:
            # One bitmask for every constrained row that samples this step, in batch order.
            out.grammar_req_ids = [rid for rid in out.req_ids if rid in sampling
                                   and self.requests[rid].sampling_params.structured_outputs is not None]
            if out.grammar_req_ids:
                # A request whose matcher fails samples unmasked, and ends after the step without its token.
                out.grammar_bitmask, errors = grammars.grammar_bitmask(out.grammar_req_ids)
                self._failing.extend(errors)
        return out

    def _pop_victim(self) -> tuple[Request, int]:
        """Take the request to preempt out of `running` (the newest, or the least important one), with its index."""
        index = len(self.running) - 1
        if self.policy == "priority":
            index = max(range(len(self.running)),
                        key=lambda k: (self.running[k].priority, self.running[k].arrival_time, k))
        return self.running.pop(index), index

    def _preempt(self, req: Request) -> None:
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(req)

    # ---------------------------------------------------------------- update
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        """Append sampled tokens, stop finished requests, free their blocks, and report."""
        self.num_steps += 1
        outputs: list[EngineCoreOutput] = []
        finished: list[str] = []
        failing, self._failing = self._failing, []
        failing.extend(InputError(message=message, request_id=req_id, internal=True)
                       for req_id, message in runner_output.failed.items())
        for error in failing:
            self._fail(error)
        if runner_output.prompt_logprobs:
            self._collect_prompt_logprobs(runner_output.prompt_logprobs)
        if runner_output.pooled:
            self._finish_pooled(runner_output.pooled, outputs, finished)
        row_logprobs = runner_output.logprobs
        for row, (req_id, token) in enumerate(zip(runner_output.req_ids, runner_output.sampled_token_ids)):
            req = self.requests.get(req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while its step was in flight
            prompt_logprobs = None
            if req.prompt_logprobs is not None and not req.output_token_ids:
                prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None  # sent once, with the first token
            req.append_output_token_id(token)
            status = self._check_stop(req, token)
            if status is None and req.sampling_params.structured_outputs is not None:
                try:
                    if self.structured_output_manager.accept_token(req_id, token):
                        status = RequestStatus.FINISHED_STOPPED  # its grammar is complete and a stop token ended it
                except Exception as e:  # noqa: BLE001 - its matcher failed: that request fails alone
                    self._fail(InputError(message=f"structured output failed: {type(e).__name__}: {e}",
                                          request_id=req_id, internal=True))
                    continue
            if status is not None:
                self.running.remove(req)
                req.status = status
                self._free(req)
                finished.append(req_id)
            outputs.append(EngineCoreOutput(
                request_id=req_id, new_token_ids=[token], finish_reason=req.status.finish_reason,
                stop_reason=req.stop_reason, num_cached_tokens=max(req.num_cached_tokens, 0),
                new_logprobs=row_logprobs[row] if row_logprobs is not None else None,
                prompt_logprobs=prompt_logprobs))
        errors, self._errors = self._errors, []
        return EngineCoreOutputs(outputs=outputs, timestamp=time.monotonic(), finished_requests=finished,
                                 input_errors=errors)

    def _finish_pooled(self, pooled: dict[str, list[float]], outputs: list[EngineCoreOutput],
                       finished: list[str]) -> None:
        """End each pooling request whose prompt is done: it reports its embedding, generates nothing, and frees
        its blocks (their full blocks stay in the prefix cache)."""
        for req_id, embedding in pooled.items():
            req = self.requests.get(req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while its step was in flight
            self.running.remove(req)
            req.status = RequestStatus.FINISHED_STOPPED
            self._free(req)
            finished.append(req_id)
            outputs.append(EngineCoreOutput(request_id=req_id, new_token_ids=[], finish_reason=req.status.finish_reason,
                                            num_cached_tokens=max(req.num_cached_tokens, 0), pooled=embedding))

    def _collect_prompt_logprobs(self, chunks: dict[str, tuple[int, TokenLogprobs]]) -> None:
        """Gather each request's prompt logprobs, chunk by chunk, until its first token carries them out.

        A chunk starts at the prompt position it was computed from; positions collected before (the request was
        preempted and recomputed them) are not added twice.
        """
        for req_id, (start, chunk) in chunks.items():
            req = self.requests.get(req_id)
            if req is None or req.output_token_ids:
                continue
            if req.prompt_logprobs is None:
                req.prompt_logprobs = TokenLogprobs(token_ids=[], logprobs=[], ranks=[])
            have = len(req.prompt_logprobs)
            if start + len(chunk) > have:
                req.prompt_logprobs.extend(chunk.slice(have - start) if have > start else chunk)

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        n_out = req.num_output_tokens
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if n_out >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _free(self, req: Request) -> None:
        self.kv_cache_manager.free(req)
        self.finished_req_ids.add(req.request_id)
        del self.requests[req.request_id]
        if req.sampling_params.structured_outputs is not None and self.structured_output_manager is not None:
            self.structured_output_manager.remove_request(req.request_id)

    def _fail(self, error: InputError) -> None:
        """End the request `error` names (waiting or running; gone already: nothing to do) and free its blocks;
        its caller hears why with the next outputs."""
        if self.finish_requests([error.request_id], RequestStatus.FINISHED_ABORTED):
            self._errors.append(error)


def _needs_every_prompt_position(req: Request) -> bool:
    """True when no prompt token of `req` may come from the prefix cache: it wants every prompt position's
    logprobs, or mean-pools every prompt token's hidden state (while it has generated nothing yet)."""
    if req.output_token_ids:
        return False
    pooling = req.pooling_params
    return req.sampling_params.prompt_logprobs is not None or (pooling is not None and pooling.needs_all_tokens)


@dataclass
class _StepPlan:
    """A step's plan while the scheduler builds it: what each request gets, and the budget left."""

    budget: int
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)
    out_of_kv: bool = False  # the KV cache preempted a request: no waiting request starts in this step
    shares: TokenShares | None = None  # each client's part of the budget (None: no limit)

    def share_left(self, client: str) -> int:
        return self.budget if self.shares is None else self.shares.left(client)

    def add(self, request_data: CachedRequestData | NewRequestData, num_tokens: int, client: str) -> None:
        (self.new_reqs if isinstance(request_data, NewRequestData) else self.cached_reqs).append(request_data)
        self.num_scheduled_tokens[request_data.req_id] = num_tokens
        self.budget -= num_tokens
        if self.shares is not None:
            self.shares.spend(client, num_tokens)

    def unplan(self, req_id: str, client: str) -> None:
        """Take back a planned request's tokens (it was preempted later in the same step); `client` is its group."""
        self.cached_reqs = [r for r in self.cached_reqs if r.req_id != req_id]
        self.new_reqs = [r for r in self.new_reqs if r.req_id != req_id]
        num_tokens = self.num_scheduled_tokens.pop(req_id)
        self.budget += num_tokens
        if self.shares is not None:
            self.shares.spend(client, -num_tokens)
