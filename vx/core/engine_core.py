"""The engine core: scheduler + KV cache manager + executor, stepped in a loop.

`EngineCore` is the in-process engine; `EngineCoreProc` (the background process served over ZMQ)
wraps it; `vx.core.engine_main` is that process's entry point.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

import msgspec
import zmq

from vx.cache import KVCacheManager
from vx.config import VxConfig
from vx.executor import Executor
from vx.executor.registry import executor_class as registered_executor_class
from vx.core.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    InputDecoder,
    InputError,
    UtilityOutput,
    UtilityRequest,
    encode_output,
)
from vx.core.heap_freezer import HeapFreezer
from vx.core.kv_cache_sizing import decide_kv_cache_size
from vx.core.request import Request, RequestStatus
from vx.core.scheduler import Scheduler
from vx.module_process import describe_exception
from vx.core.structured_output import StructuredOutputManager
from vx.outputs import EngineStats

logger = logging.getLogger(__name__)

# The longest a step that could run nothing waits for a grammar compile before the engine looks at its inputs again.
_GRAMMAR_WAIT_S = 0.05


class EngineCore:
    """Schedules requests and runs the model; `step()` = schedule -> execute -> update."""

    def __init__(self, config: VxConfig, executor_class: type[Executor] | None = None) -> None:
        """`executor_class` defaults to the one the config names (`distributed_executor_backend`)."""
        t0 = time.perf_counter()
        self.config = config
        self.executor = (executor_class or registered_executor_class(config))(config)
        try:
            # Every worker reports; the size is decided here, once, for all ranks, and sent down in one call.
            kv_size = decide_kv_cache_size(config, self.executor.kv_cache_reports())
            num_blocks = kv_size.num_blocks
            self.executor.initialize_kv_cache(kv_size)
        except BaseException:
            self.executor.shutdown()  # its worker processes must not outlive a failed start
            raise
        cc = config.cache_config
        self.kv_cache_manager = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching, kv_size.groups)
        # Costs nothing until a request asks for structured output (xgrammar loads lazily).
        self.structured_output_manager = StructuredOutputManager(config.model_config,
                                                                 config.structured_outputs_config)
        self.scheduler = Scheduler(config.scheduler_config, cc, self.kv_cache_manager,
                                   self.structured_output_manager, max_model_len=config.model_config.max_model_len)
        self.num_kv_blocks = num_blocks
        self.kv_cache_size = kv_size
        threads = config.device_config.cpu_threads
        logger.info("vx engine ready in %.2fs%s: %s", time.perf_counter() - t0,
                    f" ({threads} CPU threads)" if threads else "", kv_size.describe())

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; `ValueError` (nothing queued) for a duplicate live id or one that does not fit the model
        (a token id outside its vocabulary, top_k above it, a prompt too long): checked again, whoever sent it."""
        mc = self.config.model_config
        request.verify_for_model(mc.vocab_size, mc.max_model_len)
        self.scheduler.add_request(Request.from_engine_core_request(request))

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Stop requests and free their blocks; returns the ids that were live."""
        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        """Run one engine step; returns the new tokens and finished requests."""
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(timestamp=time.monotonic())
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if scheduler_output.total_num_scheduled_tokens == 0 and self.structured_output_manager.num_pending:
            # Nothing could run: what waits, waits for its grammar. Sleep until a compile ends instead of spinning
            # (briefly: new requests and aborts are only read between steps).
            self.structured_output_manager.wait_for_compile(timeout=_GRAMMAR_WAIT_S)
        return outputs

    def stats(self) -> EngineStats:
        """A snapshot of queues, KV blocks and counters."""
        kv = self.kv_cache_manager.stats()
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=kv.num_blocks_total,
            kv_blocks_in_use=kv.num_blocks_in_use,
            kv_blocks_cached=kv.num_blocks_cached,
            prefix_cache_queried_tokens=kv.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=kv.prefix_cache_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.scheduler.num_steps,
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        self.structured_output_manager.shutdown()
        self.executor.shutdown()


# ------------------------------------------------------------------------------------ background process

_STOP = object()  # ends the output thread once everything queued before it is sent
_FAIL = object()  # from the output thread: an output could not be encoded, so the engine must fail
# The engine's last message (its error) must leave even though the process exits right after.
OUTPUT_LINGER_MS = 5000


class EngineCoreProc:
    """An `EngineCore` served over ZMQ: the body of the background engine process.

    Three threads: the input thread receives and decodes messages into a queue; the main thread (`run`)
    applies them between steps, steps while requests exist and blocks on the queue when idle (no spinning);
    the output thread encodes and sends results, so that serialization overlaps with the next step.
    """

    def __init__(self, engine_core: EngineCore, input_socket: zmq.Socket, output_socket: zmq.Socket) -> None:
        self.engine_core = engine_core
        self.input_socket = input_socket
        self.output_socket = output_socket
        self.input_queue: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self._shutdown_requested = False
        self._heap = HeapFreezer()
        self._utilities: dict[str, Callable[..., Any]] = {
            "stats": engine_core.stats,
            "reset_prefix_cache": engine_core.reset_prefix_cache,
            "has_unfinished_requests": engine_core.has_unfinished_requests,
        }

    def run(self) -> int:
        """Serve until a SHUTDOWN message (returns 0) or an engine error (sent to the client; returns 1)."""
        threading.Thread(target=self._input_thread, name="vx-engine-input", daemon=True).start()
        out_thread = threading.Thread(target=self._output_thread, name="vx-engine-output")
        out_thread.start()
        code = 0
        self._heap.freeze()  # everything built so far lives as long as the engine
        try:
            self._busy_loop()
        except BaseException as e:  # noqa: BLE001 - any failure ends the engine; the client must hear why
            code = 1
            logger.error("vx engine failed: %s", describe_exception(e))
            self.output_queue.put(EngineCoreOutputs(timestamp=time.monotonic(), engine_error=describe_exception(e)))
        finally:
            self.output_queue.put(_STOP)
            out_thread.join()
            try:
                self.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - the process exits anyway
                logger.exception("vx engine shutdown failed")
        return code

    def _busy_loop(self) -> None:
        core = self.engine_core
        while not self._shutdown_requested:
            if not core.has_unfinished_requests():
                if self.input_queue.empty():
                    self._heap.freeze_if_grown()
                self._handle(self.input_queue.get())  # idle: sleep until a message comes
            while True:  # between steps, apply everything that arrived (adds, aborts, utility calls)
                try:
                    item = self.input_queue.get_nowait()
                except queue.Empty:
                    break
                self._handle(item)
            if self._shutdown_requested:
                return
            if core.has_unfinished_requests():
                outputs = core.step()
                if outputs.outputs or outputs.input_errors:
                    self.output_queue.put(outputs)

    def _handle(self, item: tuple[Any, Any]) -> None:
        request_type, payload = item
        if request_type == EngineCoreRequestType.ADD:
            try:
                self.engine_core.add_request(payload)
            except Exception as e:  # noqa: BLE001 - a refused request fails alone
                # A ValueError is the request's fault (a duplicate id, a value outside the model); else it is ours.
                self._send_input_error(f"{type(e).__name__}: {e}", payload.request_id,
                                       internal=not isinstance(e, ValueError))
        elif request_type == EngineCoreRequestType.ABORT:
            self.engine_core.abort_requests(payload)
        elif request_type == EngineCoreRequestType.UTILITY:
            self._call_utility(payload)
        elif request_type == EngineCoreRequestType.SHUTDOWN:
            self._shutdown_requested = True
        elif request_type is _FAIL:
            raise RuntimeError(f"could not encode an output message: {payload}") from payload
        else:  # a message the input thread could not decode
            self.output_queue.put(EngineCoreOutputs(timestamp=time.monotonic(), input_errors=[payload]))

    def _send_input_error(self, message: str, request_id: str | None, internal: bool = False) -> None:
        err = InputError(message=message, request_id=request_id, internal=internal)
        self.output_queue.put(EngineCoreOutputs(timestamp=time.monotonic(), input_errors=[err]))

    def _call_utility(self, req: UtilityRequest) -> None:
        fn = self._utilities.get(req.method)
        if fn is None:
            out = UtilityOutput(call_id=req.call_id, error=f"unknown utility method {req.method!r}; known: "
                                f"{', '.join(sorted(self._utilities))}")
        else:
            try:
                out = UtilityOutput(call_id=req.call_id, result=msgspec.to_builtins(fn(*req.args)))
            except Exception as e:  # noqa: BLE001 - a failed call fails alone
                out = UtilityOutput(call_id=req.call_id, error=f"{type(e).__name__}: {e}")
        self.output_queue.put(EngineCoreOutputs(timestamp=time.monotonic(), utility_output=out))

    def _input_thread(self) -> None:
        decoder = InputDecoder()
        sock = self.input_socket
        try:
            while True:
                try:
                    frames = sock.recv_multipart()
                except zmq.ContextTerminated:
                    return
                try:
                    item: tuple[EngineCoreRequestType | None, Any] = decoder.decode(frames)
                except ValueError as e:
                    logger.warning("vx engine: %s", e)
                    item = (None, InputError(message=str(e), request_id=decoder.request_id_of(frames)))
                self.input_queue.put(item)
                if item[0] == EngineCoreRequestType.SHUTDOWN:
                    return
        finally:
            sock.close(linger=0)

    def _output_thread(self) -> None:
        sock = self.output_socket
        try:
            while (item := self.output_queue.get()) is not _STOP:
                try:
                    frame = encode_output(item)
                except Exception as e:  # noqa: BLE001 - a bug; the main thread must fail the engine
                    self.input_queue.put((_FAIL, e))
                    continue
                sock.send(frame)
        finally:
            sock.close(linger=OUTPUT_LINGER_MS)
