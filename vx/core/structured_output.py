"""Structured output in the engine: each constrained request's grammar, compiled off the hot path with xgrammar.

The scheduler hands every request with `structured_outputs` to the `StructuredOutputManager`, which compiles its
grammar on compile threads (`CompilePool`; xgrammar releases the GIL while it compiles), so `schedule()` never
waits on a compile: it only admits requests whose grammar is ready. Each step, the manager fills one token bitmask
for all the constrained rows that sample; after sampling, each row's matcher accepts its token. xgrammar and the
Hugging Face tokenizer load lazily, in a compile thread, on the first constrained request.

Each request's next-token mask is filled on mask threads as soon as its previous token is accepted
(vx/core/grammar_masks.py); the step uses the masks that are ready and waits at most `mask_budget_s` for the others.

One request's grammar cannot hurt the others: a compile that fails, runs past `compile_timeout_s`, produces a
grammar over `max_grammar_memory_bytes` or whose masks take longer than `mask_budget_s` on a sample path fails its
own requests (a client error), and so does a grammar whose masks keep missing that budget while it runs; a matcher
that raises fails its request (an internal error); compiled grammars are kept for reuse within
`cache_memory_bytes`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from vx.config import ModelConfig, StructuredOutputsConfig
from vx.core.compile_pool import CompilePool, CompileQueueTimeoutError, CompileTimeoutError
from vx.core.grammar_masks import MAX_SLOW_MASKS, MaskFiller, MaskJob, time_fills
from vx.core.protocol import InputError
from vx.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)

# (kind, spec text): what is compiled, and the key compiled grammars are cached under.
GrammarKey = tuple[str, str]

# What a cached compile failure is counted as, besides its spec's length (its exception object, roughly).
_FAILURE_ENTRY_BYTES = 1024
# JSON is generated without free whitespace ({"a": 1, "b": [2, 3]}): a small model allowed any whitespace tends
# to emit spaces and newlines until max_tokens, which leaves the JSON unfinished.
_ANY_WHITESPACE = False
# Mask fills a compile times along one path through the grammar before a request may use it.
_SAMPLE_MASKS = 4
# xgrammar prefixes its messages with a time and a C++ source location ("[03:25:08] /project/cpp/x.cc:94: ").
_XGR_MESSAGE_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")


def grammar_key(params: StructuredOutputsParams) -> GrammarKey:
    """The (kind, spec) of a constraint; a JSON schema's spec is its compact JSON text (property order kept,
    since it is the order the output follows), and a choice's is the EBNF grammar of its alternatives."""
    kind = params.kind
    if kind == "json":
        try:
            schema = json.loads(params.json) if isinstance(params.json, str) else params.json
            return kind, json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
        except (TypeError, ValueError) as e:  # the front end checks this; a foreign client may not have
            raise GrammarError(f"structured_outputs.json is not a valid JSON schema: {e}") from None
    if kind == "choice":
        return kind, choice_grammar(params.choice or [])
    if kind == "json_object":
        return kind, ""
    spec = {"regex": params.regex, "structural_tag": params.structural_tag}.get(kind, params.grammar)
    return kind, spec or ""


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (JSON string escaping is valid xgrammar EBNF)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarError(ValueError):
    """The request's constraint cannot be served: it does not compile, or exceeds a compile limit (a client error)."""


@dataclass
class _CacheEntry:
    """A compile shared by the requests with the same constraint; `size` is counted once it is done."""

    future: concurrent.futures.Future
    size: int | None = None  # bytes: the compiled grammar's memory_size_bytes, or a failure's small cost


@dataclass
class _RequestGrammar:
    """One constrained request: its grammar's compile, then its matcher (set once the compile succeeded)."""

    kind: str
    future: concurrent.futures.Future
    stop_token_ids: list[int]
    matcher: Any = None  # xgr.GrammarMatcher
    mask: MaskJob | None = None  # the mask of its next position, filling or filled
    num_slow_masks: int = 0  # its masks that took longer than the budget


class StructuredOutputManager:
    """Compiles grammars in the background and keeps one matcher per constrained request (engine process only).

    `add_request` starts a compile (or reuses a cached one); `update` turns finished compiles into matchers and
    reports the ones that failed; `is_ready` gates scheduling on the request's grammar and next mask;
    `check_masks` fails the requests whose masks keep missing the budget; `wait_for_masks` gives the quick ones
    the budget to finish; `grammar_bitmask` gathers the step's bitmask; `accept_token` advances a matcher and
    starts its next mask; `remove_request` forgets a request.
    """

    def __init__(self, model_config: ModelConfig, config: StructuredOutputsConfig | None = None) -> None:
        self.model_config = model_config
        self.config = config or StructuredOutputsConfig()
        # The bitmask covers the model's vocabulary (the logits' width), which may exceed the tokenizer's.
        self.vocab_size = model_config.vocab_size
        self._pool = CompilePool(lambda key: self._compile(key), self.config.compile_workers,
                                 self.config.compile_timeout_s, setup_fn=self._get_compiler)
        self._compiler: Any = None  # xgr.GrammarCompiler, built with the tokenizer on first use
        self._compiler_lock = threading.Lock()
        # LRU of compiles (done or not) by constraint; the done ones' sizes add up to `cache_bytes`.
        self._cache: collections.OrderedDict[GrammarKey, _CacheEntry] = collections.OrderedDict()
        self.cache_bytes = 0
        self._requests: dict[str, _RequestGrammar] = {}
        self._pending: set[str] = set()  # requests whose grammar is still compiling
        self._masks = MaskFiller(self.config.compile_workers, self.config.mask_budget_s)
        # int32 [ceil(vocab / 32)]: the tokens holding no control byte (< 0x20); see `_fill_row`.
        self._no_control_bytes: np.ndarray | None = None

    # ----------------------------------------------------------------------------------------------- requests
    @property
    def num_requests(self) -> int:
        """How many live requests have a grammar (compiled or not)."""
        return len(self._requests)

    @property
    def num_pending(self) -> int:
        """How many requests wait for their grammar to compile."""
        return len(self._pending)

    def add_request(self, request_id: str, params: StructuredOutputsParams, stop_token_ids: Sequence[int]) -> None:
        """Start compiling the request's grammar (cached by spec). `stop_token_ids` end the text once the
        grammar is complete: the request's eos ids and its stop token ids."""
        key = grammar_key(params)
        self._pool.expire()
        self._account()
        entry = self._cache.get(key)
        if entry is None:
            entry = self._cache[key] = _CacheEntry(self._pool.submit(key))
        else:
            self._cache.move_to_end(key)
        self._requests[request_id] = _RequestGrammar(key[0], entry.future, list(dict.fromkeys(stop_token_ids)))
        self._pending.add(request_id)

    def update(self) -> list[InputError]:
        """Give each request whose compile finished its matcher, and fail the compiles past their deadline.
        Returns an error for each request whose grammar failed; those requests are forgotten here and must be ended
        by the caller."""
        self._pool.expire()
        failed: list[InputError] = []
        for request_id in [r for r in self._pending if self._requests[r].future.done()]:
            self._pending.discard(request_id)
            state = self._requests[request_id]
            error = state.future.exception()
            if error is not None:
                del self._requests[request_id]
                failed.append(_compile_failure(request_id, state.kind, error))
                continue
            try:
                import xgrammar as xgr

                state.matcher = xgr.GrammarMatcher(state.future.result(),
                                                   override_stop_tokens=state.stop_token_ids or None)
                self._start_mask(state)
            except Exception as e:  # noqa: BLE001 - this request fails alone
                del self._requests[request_id]
                failed.append(InputError(message=f"structured output failed: could not start the grammar "
                                         f"matcher: {type(e).__name__}: {e}", request_id=request_id,
                                         internal=True))
        self._account()
        return failed

    def _account(self) -> None:
        """Count the compiles that finished into the cache's size, drop those that timed out (never cached: the
        next request tries again), and evict the least recently used done ones while over the budget."""
        budget = self.config.cache_memory_bytes
        for key, entry in list(self._cache.items()):
            if entry.size is not None or not entry.future.done():
                continue
            error = entry.future.exception() if not entry.future.cancelled() else None
            if entry.future.cancelled() or (error is not None and not isinstance(error, GrammarError)):
                del self._cache[key]  # a timeout or an internal failure says nothing lasting about the spec
                continue
            entry.size = (len(key[1]) + _FAILURE_ENTRY_BYTES if error is not None
                          else int(entry.future.result().memory_size_bytes))
            self.cache_bytes += entry.size
        if self.cache_bytes > budget:
            for key in [k for k, e in self._cache.items() if e.size is not None]:  # oldest first
                if self.cache_bytes <= budget:
                    break
                self.cache_bytes -= self._cache.pop(key).size

    def is_ready(self, request_id: str) -> bool:
        """False while the request's grammar is still compiling or the mask of its next position is still filling
        (unconstrained requests are always ready)."""
        if request_id in self._pending:
            return False
        state = self._requests.get(request_id)
        return state is None or state.mask is None or state.mask.done()

    def check_masks(self) -> list[InputError]:
        """Count each mask that has taken longer than the budget against its request (whose later masks then fill
        on the slow lane), and return an error for each request that reached `MAX_SLOW_MASKS` of them: the caller
        must end those, which are forgotten here."""
        now = time.monotonic()
        failed: list[InputError] = []
        for request_id, state in list(self._requests.items()):
            job = state.mask
            if job is None or job.counted_slow or not self._masks.is_slow(job, now):
                continue
            job.counted_slow = True
            state.num_slow_masks += 1
            if state.num_slow_masks >= MAX_SLOW_MASKS:
                self.remove_request(request_id)
                failed.append(InputError(
                    message=f"structured_outputs.{state.kind} is too costly to follow: {state.num_slow_masks} of its "
                    f"next-token masks took longer than the engine's budget of {self.config.mask_budget_s:g} s a "
                    "step (grammar_mask_budget_s)", request_id=request_id))
        return failed

    def wait_for_masks(self, request_ids: Sequence[str]) -> None:
        """Give the masks of these requests that are expected to be quick (none of theirs was slow yet) at most the
        budget to finish: the step leaves out a request whose mask is not ready."""
        jobs = []
        for request_id in request_ids:
            state = self._requests.get(request_id)
            if state is not None and state.mask is not None and not state.num_slow_masks:
                jobs.append(state.mask)
        self._masks.wait(jobs)

    def wait_for_compile(self, timeout: float) -> None:
        """Block until some pending compile finishes, or `timeout` seconds: for a step that had nothing else to
        run, so that the engine sleeps instead of spinning."""
        futures = {self._requests[r].future for r in self._pending}
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def remove_request(self, request_id: str) -> None:
        """Forget a finished or aborted request and its matcher (unknown ids are ignored); its mask, if still
        queued, is not filled."""
        state = self._requests.pop(request_id, None)
        self._pending.discard(request_id)
        if state is not None and state.mask is not None and state.mask.future is not None:
            state.mask.future.cancel()

    # ----------------------------------------------------------------------------------------------- per step
    def grammar_bitmask(self, request_ids: Sequence[str]) -> tuple[np.ndarray, list[InputError]]:
        """int32 [len(request_ids), ceil(vocab / 32)]: row i has bit t set when the grammar of request i allows
        token t next. Every request must be ready (`is_ready`). Also returns an error for each request whose
        matcher failed: its row allows every token, and the caller must end it."""
        rows = np.full((len(request_ids), (self.vocab_size + 31) // 32), -1, dtype=np.int32)
        errors: list[InputError] = []
        for i, request_id in enumerate(request_ids):
            future = self._requests[request_id].mask.future
            error = future.exception()
            if error is not None:
                errors.append(InputError(message=f"structured output failed: {type(error).__name__}: {error}",
                                         request_id=request_id, internal=True))
                continue
            rows[i] = future.result()
        return rows, errors

    def accept_token(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher by its sampled token; True when the grammar is complete and ended by a
        stop token, i.e. the request is done. Unconstrained requests return False."""
        state = self._requests.get(request_id)
        if state is None or state.matcher is None:
            return False
        if not state.matcher.accept_token(token_id):
            # The mask never lets such a token through, unless it hid every token (e.g. min_tokens banning the
            # stop token the grammar requires). The matcher keeps its state; the next mask continues from there.
            logger.warning("vx structured output: request %r sampled token %d, which its grammar does not allow",
                           request_id, token_id)
            self._start_mask(state)
            return False
        if state.matcher.is_terminated():
            return True
        self._start_mask(state)
        return False

    def shutdown(self) -> None:
        """Cancel queued compiles and masks (running ones finish in the background)."""
        self._pool.shutdown()
        self._masks.shutdown()

    # ------------------------------------------------------------------------------------------------- masks
    def _start_mask(self, state: _RequestGrammar) -> None:
        """Start filling the mask of the request's next position (on the slow lane once one of its masks was
        slow)."""
        matcher, json_text = state.matcher, state.kind in ("json", "json_object")
        state.mask = self._masks.start(lambda: self._fill_row(matcher, json_text), slow=state.num_slow_masks > 0)

    def _fill_row(self, matcher: Any, json_text: bool = False) -> np.ndarray:
        """The int32 bitmask row of the tokens `matcher` allows next (on a mask thread: xgrammar releases the GIL)."""
        import xgrammar as xgr

        buffer = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(buffer, 0)
        row = buffer[0].numpy()
        if json_text:
            # JSON forbids raw control characters, but xgrammar lets them into length-bounded strings
            # ({"maxLength": 5}). Compact JSON never needs one outside a string either, so mask them all.
            row &= self._no_control_bytes
        return row

    # ------------------------------------------------------------------------------------------------ compile
    def _compile(self, key: GrammarKey) -> "xgr.CompiledGrammar":
        """Runs in a compile thread. Raises `GrammarError` naming the constraint and the problem."""
        compiler = self._get_compiler()
        kind, spec = key
        try:
            if kind == "json":
                compiled = compiler.compile_json_schema(spec, any_whitespace=_ANY_WHITESPACE)
            elif kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=_ANY_WHITESPACE)
            elif kind == "regex":
                compiled = compiler.compile_regex(spec)
            elif kind == "structural_tag":
                compiled = compiler.compile_structural_tag(spec)
            else:
                compiled = compiler.compile_grammar(spec)  # "grammar" and "choice" (EBNF)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for any bad spec
            raise GrammarError(f"structured_outputs.{kind} is invalid: {_xgrammar_message(e)}") from None
        size, limit = compiled.memory_size_bytes, self.config.max_grammar_memory_bytes
        if size > limit:  # dropped here: never cached
            raise GrammarError(f"structured_outputs.{kind} compiles to a grammar of {size / 2**20:.1f} MiB, over the "
                               f"engine's limit of {limit / 2**20:.1f} MiB (max_grammar_memory_bytes)")
        import xgrammar as xgr

        # Small grammars can still be costly to follow (a regex of nested bounded repeats): time a few masks.
        budget = self.config.mask_budget_s
        cost = time_fills(xgr.GrammarMatcher(compiled), self._fill_row, _SAMPLE_MASKS, limit_s=budget)
        if cost > budget:
            raise GrammarError(f"structured_outputs.{kind} is too costly to follow: one of its next-token masks took "
                               f"{cost:.2f} s, over the engine's budget of {budget:g} s a step "
                               "(grammar_mask_budget_s)")
        return compiled

    def _get_compiler(self) -> Any:
        """The xgrammar compiler over the model's tokenizer, built once (by whichever compile thread comes first)."""
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import AutoTokenizer

                path = self.model_config.tokenizer
                try:
                    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
                except Exception as e:  # noqa: BLE001 - transformers raises many types here
                    raise RuntimeError(f"structured output needs the model's tokenizer, which could not be loaded "
                                       f"from {path!r}: {type(e).__name__}: {e}") from None
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.model_config.eos_token_ids or None)
                self._no_control_bytes = _pack_bits([not any(b < 0x20 for b in token)
                                                     for token in info.decoded_vocab], self.vocab_size)
                # Our own LRU (`_cache`) bounds what is kept, by bytes, and never keeps what timed out.
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.config.compile_workers,
                                                     cache_enabled=False)
            return self._compiler


def _compile_failure(request_id: str, kind: str, error: BaseException) -> InputError:
    """The error for a request whose compile failed: the request's fault unless the engine's."""
    if isinstance(error, GrammarError):
        return InputError(message=str(error), request_id=request_id)
    if isinstance(error, CompileTimeoutError):
        return InputError(message=f"structured_outputs.{kind} is too costly to compile: {error} (the engine's "
                          "grammar_compile_timeout_s)", request_id=request_id)
    if isinstance(error, CompileQueueTimeoutError):
        return InputError(message=f"structured output: {error}", request_id=request_id, overloaded=True)
    return InputError(message=f"structured output failed: {type(error).__name__}: {error}", request_id=request_id,
                      internal=True)


def _pack_bits(allowed: Sequence[bool], vocab_size: int) -> np.ndarray:
    """A bitmask row (int32 [ceil(vocab_size / 32)], bit t of word t // 32 = token t) from one flag per token;
    tokens past `allowed` stay allowed."""
    flags = np.ones((vocab_size + 31) // 32 * 32, dtype=np.uint32)
    flags[:min(len(allowed), vocab_size)] = np.asarray(allowed[:vocab_size], dtype=np.uint32)
    words = (flags.reshape(-1, 32) << np.arange(32, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)
    return words.view(np.int32)


def _xgrammar_message(e: BaseException) -> str:
    """xgrammar's error text without its timestamp and C++ source location."""
    return _XGR_MESSAGE_PREFIX.sub("", str(e)).strip() or type(e).__name__
