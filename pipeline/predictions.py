"""Publishing a worker's predictions (``serve.predictions``) beside its train loop.

The train loop hands over the predictions of each step (``PredictionSender.put``); a task
of the sender's own encodes them (``streams.predictions.encode_scored``) and writes them
through the worker's producer to ``predictions.<job>``, a step's worth at a time: the
messages of a step are handed to the producer together, as record batches (one per
partition: ``DurableProducer.send_keyed``), then their acknowledgements are awaited. A step
waits only for room in a bounded queue, never for the broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from edgestream.streams.predictions import Scored, encode_scored

log = logging.getLogger(__name__)

#: Steps' worth of predictions that may wait for the producer before a step waits for room.
DEPTH = 64

#: ``send(topic, messages)``: hands ``(key, value)`` messages, in order, to the producer (each
#: to its key's partition); returns the acknowledgements to await (``DurableProducer.send_keyed``).
Send = Callable[[str, list[tuple[bytes, bytes]]], Awaitable[list[Awaitable[Any]]]]


class PredictionSender:
    """Publishes the predictions the train loop hands it, in order, from a task of its own.

    Invariant: ``published[device]`` counts ``device``'s predictions the broker
    acknowledged (continued from ``published`` given at start: a checkpoint's counts);
    once ``flush`` returns, every prediction handed to ``put`` before it is among them. A
    failed write is raised by the next ``put`` or ``flush`` (the worker stops and restarts
    from its last checkpoint, whose records it trains, and predicts, again).
    """

    def __init__(self, send: Send, *, topic: str, job: str, worker: str, clock: Callable[[], float] = time.time,
                 depth: int = DEPTH, on_published: Callable[[str, int], None] | None = None,
                 published: dict[str, int] | None = None) -> None:
        self.send = send
        self.topic = topic
        self.job = job
        self.worker = worker
        self.clock = clock
        self.depth = depth
        self.on_published = on_published
        self.published: dict[str, int] = dict(published or {})
        self.batches = 0
        self._queue: asyncio.Queue[list[Scored]] | None = None
        self._task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None

    @property
    def total(self) -> int:
        return sum(self.published.values())

    async def put(self, scored: list[Scored]) -> None:
        """Queue one step's predictions (waits only while ``depth`` steps' worth are queued)."""
        self._raise()
        if not any(s.size for s in scored):
            return
        if self._queue is None:
            self._queue = asyncio.Queue(maxsize=self.depth)
            self._task = asyncio.get_running_loop().create_task(self._run())
        await self._queue.put(scored)

    async def flush(self) -> None:
        """Wait until everything queued is acknowledged; raise if a write failed."""
        if self._queue is not None:
            await self._queue.join()
        self._raise()

    async def close(self) -> None:
        """Stop the task (what is still queued is not published: ``flush`` first)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"{self.worker}: publishing predictions to {self.topic} failed: "
                               f"{self._error}") from self._error

    async def _run(self) -> None:
        assert self._queue is not None
        while True:
            scored = await self._queue.get()
            try:
                if self._error is None:
                    await self._publish(scored)
            except Exception as exc:  # raised to the train loop at its next put or flush
                log.error("%s: publishing predictions failed: %s", self.worker, exc)
                self._error = exc
            finally:
                self._queue.task_done()

    async def _publish(self, scored: list[Scored]) -> None:
        published_at = self.clock()  # one instant for the step's messages: when they go out
        messages = []
        for part in scored:
            messages += encode_scored(part, job=self.job, worker=self.worker, published_at=published_at)
        await asyncio.gather(*await self.send(self.topic, messages))
        self.batches += 1
        for part in scored:
            if part.size:
                self.published[part.device] = self.published.get(part.device, 0) + part.size
                if self.on_published is not None:
                    self.on_published(part.device, part.size)
