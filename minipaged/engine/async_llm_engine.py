"""The engine behind a server: one background thread steps the engine while requests arrive (lesson 13).

``LLMEngine.step()`` is blocking work (the model runs in it), so it cannot run on the event loop
that answers HTTP clients. ``AsyncLLMEngine`` gives the engine a thread of its own and talks to it
through a command queue:

    client coroutine --add/abort--> command queue --> engine thread: apply commands, step()
    client coroutine <--RequestOutput-- asyncio.Queue <-- engine thread (call_soon_threadsafe)

The rule: only the engine thread changes the ``LLMEngine`` (``add_request``, ``abort_request``,
``step``). Other threads (the server's prompt workers, ``entrypoints/prompts.py``) may call only
what reads settings fixed when the engine was built: ``encode``, ``validate_request``,
``max_model_len``, ``limits`` and the tokenizer. NOTE: so no lock is needed: nothing
those calls read is ever written after start-up. A new method called from another thread must
keep to this, or go through the command queue.

A request added while a step runs joins the batch at the next step (continuous batching); each
step's outputs are pushed to the clients' queues as soon as the step ends, which is what makes
streaming possible.
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field

from minipaged.engine.llm_engine import LLMEngine
from minipaged.outputs import RequestOutput
from minipaged.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine thread stopped (a step raised, or the engine was shut down)."""


class QueueFullError(RuntimeError):
    """Refused for now: ``max_waiting_requests`` requests already wait for their prompt to run."""


@dataclass
class PromptRequest:
    """One prompt to queue: text, token ids, or both (token ids win, as in ``add_request``)."""

    prompt: str | None
    sampling_params: SamplingParams
    prompt_token_ids: list[int] | None = None


@dataclass
class _Sink:
    """Where one client's outputs go: an asyncio.Queue owned by the client's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the client's loop is closed: nobody is listening any more
            pass


@dataclass
class _Add:
    request_ids: list[str]
    prompts: list[PromptRequest]
    sink: _Sink
    accepted: asyncio.Future
    arrival_time: float = field(default_factory=time.monotonic)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: object  # called in the engine thread, with the engine; must not raise




_STOP = object()


class AsyncLLMEngine:
    """Run an ``LLMEngine`` in a background thread and stream its outputs to coroutines.

    Args:
        engine: the engine to drive; from now on only this object's thread may touch it.
        max_waiting_requests: the most requests that may wait in the scheduler's waiting queue;
            a call that would queue more raises ``QueueFullError``. None: no bound.

    Use it as ``async for request_id, output in async_engine.generate(prompts)`` or call
    ``add_requests`` / ``abort`` directly. ``start()`` launches the thread, ``shutdown()`` ends it.
    """

    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # why the engine thread died, if it did
        self._closed = False  # set once the thread stops taking commands
        self.num_requests_finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self.metrics: dict = {}  # republished by the engine thread after every step
        self.paused = False  # (set only by the engine thread: ``pause()``, ``resume()``)
        self._steps_allowed = 0  # steps to run while paused (``step_once()``)
        self._publish_metrics()

    # -- life cycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="minipaged-engine",
                                            daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the thread after its current step; unfinished requests end with an error."""
        if self._thread is not None:
            self._commands.put(_STOP)
            self._thread.join(timeout)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` if the engine thread is not serving."""
        if self.error is not None:
            raise EngineDeadError(f"the engine loop stopped: {self.error!r}")
        if not self.is_running or self._closed:
            raise EngineDeadError("the engine loop is not running")

    # -- the client side (coroutines, any event loop) --------------------------------------------
    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    async def add_requests(self, request_ids: list[str], prompts: list[PromptRequest],
                           outputs: asyncio.Queue) -> None:
        """Queue several prompts at once: all are accepted, or none (the first error is raised).

        Every ``RequestOutput`` of these requests is put on ``outputs`` as ``(request_id,
        output)``; if the engine dies, ``(request_id, EngineDeadError)`` is put instead.
        Raises ``ValueError`` for a bad request, ``QueueFullError`` if the waiting queue has no
        room for them, and ``EngineDeadError`` if the engine is down.
        """
        self.check_health()
        loop = asyncio.get_running_loop()
        accepted = loop.create_future()
        self._commands.put(_Add(list(request_ids), list(prompts), _Sink(loop, outputs), accepted))
        if self._closed and not accepted.done():
            # NOTE: the thread ended between the check above and the put: nobody will answer.
            accepted.set_exception(EngineDeadError("the engine loop is not running"))
        try:
            await accepted
        except asyncio.CancelledError:
            # The client went away while we waited: the requests may already be queued.
            for request_id in request_ids:
                self.abort(request_id)
            raise

    def abort(self, request_id: str) -> None:
        """Ask the engine thread to abort a request; its blocks are freed before the next step.

        Safe to call from any thread, for any id, any number of times."""
        self._commands.put(_Abort(request_id))

    def call_in_engine_thread(self, fn) -> None:
        """Run ``fn(engine)`` in the engine thread before its next step (the way another thread
        reads or changes the engine, e.g. adds an observer); ``fn`` must not raise."""
        self._commands.put(_Call(fn))

    def pause(self) -> None:
        """Stop stepping after the current step (requests still queue); ``resume()`` goes on."""
        self.call_in_engine_thread(lambda engine: self._set_paused(True))

    def resume(self) -> None:
        self.call_in_engine_thread(lambda engine: self._set_paused(False))

    def step_once(self) -> None:
        """While paused: run one step (if there is work), then stay paused."""
        self.call_in_engine_thread(lambda engine: self._allow_step())

    def _set_paused(self, paused: bool) -> None:
        self.paused, self._steps_allowed = paused, 0

    def _allow_step(self) -> None:
        self._steps_allowed += self.paused

    async def stream_outputs(self, request_ids: list[str], outputs: asyncio.Queue):
        """Yield ``(request_id, RequestOutput)`` from ``outputs`` until every request finished.

        If the consumer stops early (a client disconnect cancels it), the requests still
        running are aborted, so their blocks go back to the pool."""
        unfinished = set(request_ids)
        try:
            while unfinished:
                request_id, output = await outputs.get()
                if isinstance(output, BaseException):
                    raise output
                if output.finished:
                    unfinished.discard(request_id)
                yield request_id, output
        finally:
            for request_id in unfinished:
                self.abort(request_id)

    async def generate(self, prompts: list[PromptRequest], prefix: str = "req"):
        """Queue ``prompts`` and yield ``(request_id, RequestOutput)`` as the engine steps."""
        request_ids = [self.new_request_id(prefix) for _ in prompts]
        outputs: asyncio.Queue = asyncio.Queue()
        await self.add_requests(request_ids, prompts, outputs)
        async for item in self.stream_outputs(request_ids, outputs):
            yield item

    # -- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                # NOTE: with nothing to do the thread sleeps in get(); it never spins.
                idle = not self._may_step()
                commands = [self._commands.get()] if idle else []
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                outbox: list[tuple[_Sink, tuple]] = []
                for command in commands:
                    if command is _STOP:
                        self._fail_all(EngineDeadError("the server is shutting down"))
                        return
                    self._apply(command, outbox)
                if self._may_step():
                    self._steps_allowed = max(self._steps_allowed - 1, 0)
                    self._route(self.engine.step(), outbox)
                # NOTE: metrics first, so a client that saw its last output reads fresh metrics.
                self._publish_metrics()
                for sink, item in outbox:
                    sink.put(item)
        except BaseException as e:  # a step failed: the engine state cannot be trusted
            self.error = e
            self._fail_all(EngineDeadError(f"the engine loop stopped: {e!r}"))
            self._publish_metrics()

    def _may_step(self) -> bool:
        return self.engine.has_unfinished_requests() and (not self.paused
                                                          or self._steps_allowed > 0)

    def _apply(self, command, outbox: list) -> None:
        if isinstance(command, _Call):
            command.fn(self.engine)
            return
        if isinstance(command, _Abort):
            output = self.engine.abort_request(command.request_id)
            sink = self._sinks.pop(command.request_id, None)
            if output is not None:
                self._count_finished(output)
                if sink is not None:
                    outbox.append((sink, (command.request_id, output)))
            return
        limit = self.max_waiting_requests
        # NOTE: decided here, in the engine thread, against the waiting queue as it is now (a
        # burst of adds is applied one by one), so the bound is exact. A request that leaves the
        # queue -- scheduled, or aborted by a client that gave up -- frees its place at once.
        if limit is not None and len(self.engine.scheduler.waiting) + len(command.prompts) > limit:
            self._resolve(command.accepted, QueueFullError(
                f"the server is busy: {len(self.engine.scheduler.waiting)} requests are waiting "
                f"(at most {limit}); retry later"))
            return
        added = []
        try:
            for request_id, p in zip(command.request_ids, command.prompts):
                self.engine.add_request(request_id, p.prompt, p.sampling_params,
                                        p.prompt_token_ids, command.arrival_time)
                added.append(request_id)
        except Exception as e:  # a bad request: refuse the whole call, keep serving the others
            for request_id in added:
                self.engine.abort_request(request_id)
            self._resolve(command.accepted, e)
            return
        for request_id in added:
            self._sinks[request_id] = command.sink
        self._resolve(command.accepted, None)

    def _route(self, outputs: list[RequestOutput], outbox: list) -> None:
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if output.finished:
                self._sinks.pop(output.request_id, None)
                self._count_finished(output)
            if sink is not None:
                outbox.append((sink, (output.request_id, output)))

    def _count_finished(self, output: RequestOutput) -> None:
        reasons = [c.finish_reason or "abort" for c in output.outputs] or ["abort"]
        reason = "abort" if "abort" in reasons else reasons[0]
        self.num_requests_finished[reason] = self.num_requests_finished.get(reason, 0) + 1

    def _fail_all(self, error: EngineDeadError) -> None:
        self._closed = True  # (before draining: see add_requests)
        for request_id, sink in self._sinks.items():
            sink.put((request_id, error))
        self._sinks.clear()
        while True:  # commands that arrived after the end: answer them instead of hanging
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                self._resolve(command.accepted, error)

    @staticmethod
    def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
        def settle():
            if not future.done():  # the waiting client may have been cancelled
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(error)

        try:
            future.get_loop().call_soon_threadsafe(settle)
        except RuntimeError:
            pass

    def _publish_metrics(self) -> None:
        """Plain numbers for /metrics, copied here so other threads never read engine state."""
        scheduler, stats = self.engine.scheduler, self.engine.stats
        pool = scheduler.pool_counts()
        self.metrics = {
            "num_requests_running": len(scheduler.running),
            "num_requests_waiting": len(scheduler.waiting),
            "num_requests_swapped": len(scheduler.swapped),
            "gpu_blocks_total": pool.num_gpu_blocks,
            "gpu_blocks_used": pool.num_gpu_blocks - pool.num_free_gpu_blocks,
            "cpu_blocks_total": pool.num_cpu_blocks,
            "cpu_blocks_used": pool.num_cpu_blocks - pool.num_free_cpu_blocks,
            "num_steps": stats.num_steps,
            "prompt_tokens": stats.num_prompt_tokens,
            "generation_tokens": stats.num_sampled_tokens,
            "preemptions_recompute": stats.num_preemptions_recompute,
            "preemptions_swap": stats.num_preemptions_swap,
            "spec_proposed_tokens": stats.num_spec_proposed_tokens,
            "spec_accepted_tokens": stats.num_spec_accepted_tokens,
            "spec_emitted_tokens": stats.num_spec_emitted_tokens,
            "spec_acceptance_rate": stats.spec_acceptance_rate,
            "spec_mean_accepted_length": stats.spec_mean_accepted_length,
            "requests_finished": dict(self.num_requests_finished),
        }


class TextStreamer:
    """What is new in one output since the last chunk: text, token ids and their logprobs.

    With stop strings, the last ``len(longest stop) - 1`` characters are held back until the
    output finishes: they may be the start of a stop string that the engine will cut off, and
    text already sent cannot be taken back.
    """

    def __init__(self, stop_strings: list[str]) -> None:
        self.holdback = max((len(s) for s in stop_strings), default=1) - 1
        self.text = ""
        self.num_tokens = 0

    def update(self, completion) -> tuple[str, list[int], list | None]:
        """Return (new text, new token ids, their logprobs or None) of a CompletionOutput."""
        text = completion.text
        if completion.finish_reason is None and self.holdback:
            text = text[:max(len(self.text), len(text) - self.holdback)]
        delta = text[len(self.text):]
        self.text += delta
        ids = completion.token_ids[self.num_tokens:]
        logprobs = (completion.logprobs[self.num_tokens:]
                    if completion.logprobs is not None else None)
        self.num_tokens = len(completion.token_ids)
        return delta, ids, logprobs
