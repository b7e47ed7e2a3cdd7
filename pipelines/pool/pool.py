"""``RolloutPool``: rollout and reward workers feeding one trainer, in-process or on Ray, synchronous or not.

    pool = RolloutPool(partial(FlowRolloutWorker.from_pretrained, "sd3", path, sampling), num_workers=4,
                       executor="ray", ray=RayOptions(num_gpus=1),
                       reward=partial(RewardWorker.build, "pickscore", device="cuda"), max_staleness=1)
    for step, batch in enumerate(pool.stream(make_requests, num_steps)):   # make_requests(step) -> requests
        train_on(batch)                                       # batch.sample_lags() -> importance correction
        pool.broadcast(make_update(transformer, version=step + 1))

How it works. A dispatcher thread owns every worker call: it hands queued requests to rollout workers (at most
``max_inflight`` queued on each; a request's timeout clock starts when it reaches the front of its worker's
queue, i.e. once every call queued before it there, weight loads included, has finished), sends each finished
rollout to a reward worker while the rollout worker already generates the next request (scoring overlaps
generation), and marks a request complete once it is scored. The trainer's thread only queues requests
(:meth:`submit`), waits for a step's results (:meth:`collect`) and publishes weights (:meth:`broadcast`).

Staleness (AReaL, arXiv 2505.24298, sec. 5.1). Each request is tagged with the ``step`` whose training consumes
it, i.e. the trainer's weight version at that time. It is dispatched only once the trainer's version ``v``
satisfies ``step - v <= max_staleness``; the worker applies every broadcast before the requests dispatched after
it, so the samples are generated with a version ``>= v`` and are at most ``max_staleness`` versions old when
collected at version ``step``. ``max_staleness = 0`` is synchronous on-policy RL; larger values let generation
run ahead of training. Every result carries its version and :class:`PoolBatch` reports the lag of every sample.

Partial rollouts (APRIL, arXiv 2509.18521). Over-provision a step's requests and ``collect(min_samples=...)``:
the call returns once that many samples are complete; the requests still queued or generating stay in the pool
and are delivered first at the next step, never discarded. A request is carried at most once: the next
``collect`` waits for it even when its ``min_samples`` are complete without it, so a sample lags at most
``max_staleness + 1`` versions (``max_staleness`` without partial rollouts).

Faults. A worker whose process dies, or whose request runs past ``request_timeout``, is dropped (killed if
hung) and replaced; its request goes back to the front of the queue for the other workers, unless it has now
lost ``max_worker_losses`` workers: a request that kills or hangs every worker fails alone with a
:class:`PoolError`. A request's result is delivered exactly once, whatever happened (a late answer of a hung
worker is ignored). A failing reward is retried ``reward_retries`` times, then :meth:`collect` raises
:class:`RewardError`: never a silent zero reward. A lost reward worker costs an attempt only to the scoring call
it was running; those queued behind it are re-queued as they were. A rollout worker that fails to load a
broadcast is taken out of service (not replaced: a new one would load the same update); its requests go to the
others. An answer of the wrong type fails only its request, with an error naming the worker and the request.
"""

from __future__ import annotations

import logging
import queue
import reprlib
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pipelines.pool.executors import Executor, InProcessExecutor, RayExecutor, RayOptions
from pipelines.pool.protocol import (
    PoolBatch,
    PoolError,
    RewardError,
    RolloutRequest,
    RolloutResult,
    WeightUpdate,
    WeightVersionError,
)
from rewards import RewardOutput

logger = logging.getLogger(__name__)

ExecutorKind = Literal["inprocess", "ray"]
_WAKE = object()  # an event that only asks the dispatcher to look again (new requests, new version)


@dataclass
class _Entry:
    """A submitted request and where it stands."""

    request: RolloutRequest
    step: int
    result: RolloutResult | None = None  # set when generated
    done: bool = False  # generated and, with reward workers, scored
    reward_attempts: int = 0
    workers_lost: int = 0  # rollout workers that died or hung while running this request
    carried: bool = False  # left unfinished by a partial collect: the next collect waits for it


@dataclass
class _Members:
    """One kind of pool member (rollout or reward workers) and their states."""

    name: str
    executor: Executor
    size: int
    ready: set[int] = field(default_factory=set)
    starting: set[int] = field(default_factory=set)
    #: member -> why it is out of service for good (not replaced), for the "no worker is left" error
    retired: dict[int, str] = field(default_factory=dict)
    #: member -> its calls in flight (weight loads, runs, scores) by token, in the order the member executes
    #: them: the first one is executing, the others wait behind it
    queued: dict[int, dict[int, _Call]] = field(default_factory=dict)

    def free(self, limit: int) -> list[int]:
        """Ready members with fewer than ``limit`` run/score calls in flight, least loaded first."""
        load = {
            m: sum(c.kind in ("run", "score") for c in self.queued.get(m, {}).values()) for m in self.ready
        }
        return sorted((m for m in self.ready if load[m] < limit), key=lambda m: (load[m], m))

    def executing(self, m: int) -> _Call | None:
        """The call member ``m`` runs now: the oldest of its calls not known to have finished."""
        return next(iter(self.queued.get(m, {}).values()), None)


@dataclass
class _Call:
    """A call in flight on a member, keyed by a token in the dispatcher."""

    kind: Literal["start", "load", "run", "score"]
    members: _Members
    member: int
    entry: _Entry | None = None
    deadline: float | None = None


class RolloutPool:
    """Rollout workers (and optionally reward workers) behind one interface; see the module docstring.

    Args:
        worker: factory of one rollout worker (:class:`~pipelines.pool.workers.RolloutWorker`); picklable for
            Ray, e.g. ``functools.partial(FlowRolloutWorker.from_pretrained, family, path, sampling)``.
        num_workers: rollout workers (Ray: actors; in-process: threads, usually 1 on a single GPU).
        executor: ``"inprocess"`` (default, no Ray) or ``"ray"``.
        reward: factory of one reward worker (:class:`~pipelines.pool.workers.RewardWorker`); ``None``: results
            are delivered unscored (the trainer scores them).
        num_reward_workers: reward workers.
        max_staleness: most weight versions a delivered sample may lag behind the trainer (0 = synchronous).
        request_timeout: seconds a request (or a scoring call) may run on one worker before the worker is
            considered hung and killed (and replaced, with ``respawn``); ``None`` waits forever.
        reward_retries: retries of a failed scoring call before :class:`RewardError` is raised.
        max_worker_losses: rollout workers one request may lose (dying or exceeding ``request_timeout`` while
            running it) before :meth:`collect` raises a :class:`PoolError` for that request instead of
            re-queuing it. 3 (default) rides out a bad node or two; a request that kills every worker it
            reaches (out of memory on that input, a deadlock) costs at most 3 respawns. 1 fails at the first loss.
        respawn: replace a dead or hung worker with a new one (it reloads its model and gets the latest weights).
        max_inflight: requests queued on one worker at a time. 2 (default) hides the dispatch round trip: the next
            request is already there when the current one finishes. 1 gives the finest load balancing.
        ray: Ray resources and cluster address of the rollout actors (``executor="ray"``).
        reward_ray: resources of the reward actors (default: those of ``ray``). Every actor must fit on the
            cluster at once: an actor that cannot be placed waits for resources, and its work with it.

    Raises:
        ValueError: a bad count, staleness or timeout.
        ImportError: ``executor="ray"`` without Ray installed.
    """

    def __init__(
        self,
        worker: Callable[[], Any],
        num_workers: int = 1,
        *,
        executor: ExecutorKind = "inprocess",
        reward: Callable[[], Any] | None = None,
        num_reward_workers: int = 1,
        max_staleness: int = 0,
        request_timeout: float | None = None,
        reward_retries: int = 2,
        max_worker_losses: int = 3,
        respawn: bool = True,
        max_inflight: int = 2,
        ray: RayOptions | None = None,
        reward_ray: RayOptions | None = None,
    ) -> None:
        if num_workers < 1 or (reward is not None and num_reward_workers < 1):
            raise ValueError(
                f"need num_workers >= 1 and num_reward_workers >= 1, got {num_workers}, {num_reward_workers}"
            )
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 (0 = synchronous), got {max_staleness}")
        if request_timeout is not None and request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0 seconds or None, got {request_timeout}")
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        if reward_retries < 0:
            raise ValueError(f"reward_retries must be >= 0, got {reward_retries}")
        if max_worker_losses < 1:
            raise ValueError(f"max_worker_losses must be >= 1, got {max_worker_losses}")
        if executor not in ("inprocess", "ray"):
            raise ValueError(f"unknown executor {executor!r}. Available: ['inprocess', 'ray']")
        self.max_staleness = max_staleness
        self.request_timeout = request_timeout
        self.reward_retries = reward_retries
        self.max_worker_losses = max_worker_losses
        self.respawn = respawn
        self.max_inflight = max_inflight
        #: fault and retry counters (``worker_lost``, ``requeued``, ``respawned``, ``reward_retries``,
        #: ``retired``, ...)
        self.stats: Counter[str] = Counter()

        def make(factory: Callable[[], Any], n: int, options: RayOptions | None) -> Executor:
            if executor == "ray":
                return RayExecutor(factory, n, options)
            return InProcessExecutor(factory, n)

        self._rollout = _Members("rollout", make(worker, num_workers, ray), num_workers)
        self._reward = None
        if reward is not None:
            reward_executor = make(reward, num_reward_workers, reward_ray or ray)
            self._reward = _Members("reward", reward_executor, num_reward_workers)
        self._cond = threading.Condition()
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._calls: dict[int, _Call] = {}
        self._next_token = 0
        self._queue: deque[_Entry] = deque()  # waiting for a rollout worker
        self._to_score: deque[_Entry] = deque()  # generated, waiting for a reward worker
        self._steps: dict[int, list[_Entry]] = {}  # undelivered entries by consuming step, submission order
        self._ids: set[str] = set()
        self._errors: list[PoolError] = []
        self._version = 0
        self._planned: int | None = None  # next step whose requests submit_through makes
        self._last_update: WeightUpdate | None = None
        self._closed = False
        self._broken: PoolError | None = None  # the dispatcher died: nothing will progress any more
        with self._cond:
            for members in (self._rollout, self._reward):
                if members is not None:
                    for m in range(members.size):
                        self._start(members, m)
        self._thread = threading.Thread(target=self._loop, name="rollout-pool", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ trainer side

    @property
    def version(self) -> int:
        """The trainer's weight version: that of the latest :meth:`broadcast` (0 before any)."""
        return self._version

    @property
    def num_workers(self) -> int:
        """Rollout workers ready now (a replaced worker counts again once rebuilt)."""
        with self._cond:
            return len(self._rollout.ready)

    def submit(self, requests: Sequence[RolloutRequest], step: int | None = None) -> None:
        """Queue ``requests`` for the training step ``step`` (default: the current version, i.e. on-policy).

        Raises:
            ValueError: a request id was submitted before (ids must be unique: one result per id).
        """
        with self._cond:
            self._raise_if_closed()
            step = self._version if step is None else step
            ids = [r.request_id for r in requests]
            seen = self._ids.intersection(ids)
            if seen or len(set(ids)) != len(ids):
                raise ValueError(
                    f"request ids must be unique; already submitted or repeated: {sorted(seen)[:5]}"
                )
            self._ids.update(ids)
            for request in requests:
                entry = _Entry(request, step)
                self._steps.setdefault(step, []).append(entry)
                self._queue.append(entry)
        self._events.put(_WAKE)

    def collect(
        self, step: int | None = None, min_samples: int | None = None, timeout: float | None = None
    ) -> PoolBatch:
        """Wait for the requests of ``step`` (default: the current version) and hand them over.

        Args:
            step: the training step whose requests to deliver.
            min_samples: partial rollouts: return once this many samples of ``step`` are complete and every
                request carried into ``step`` from the step before is; the rest is carried into ``step + 1``.
                ``None``: wait for every request of ``step``.
            timeout: seconds to wait at most.

        Returns:
            The :class:`PoolBatch`, results in submission order, lags relative to :attr:`version`.

        Raises:
            ValueError: ``step`` is more than ``max_staleness`` ahead of the version (its requests cannot be
                dispatched before a broadcast).
            RewardError: scoring of a request failed after every retry.
            PoolError: a request failed on its worker, no rollout worker is left, or the pool broke down.
            TimeoutError: ``timeout`` passed first.
        """
        with self._cond:
            step = self._version if step is None else step
            if step - self._version > self.max_staleness:
                raise ValueError(
                    f"requests of step {step} are dispatched only at weight version >= {step - self.max_staleness}"
                    f" (max_staleness={self.max_staleness}); the version is {self._version}: broadcast first"
                )
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                self._raise_if_closed()
                if self._errors:
                    raise self._errors.pop(0)
                entries = self._steps.get(step, [])
                done = [e for e in entries if e.done]
                complete = len(done) == len(entries)
                # a request is carried at most once (lag <= max_staleness + 1): what the last step carried
                # is waited for even when min_samples are complete without it
                overdue = any(e.carried and not e.done for e in entries)
                if complete or (
                    min_samples is not None
                    and not overdue
                    and sum(e.result.num_samples for e in done) >= min_samples
                ):
                    break
                for members in (self._rollout, self._reward):
                    if members is not None and not members.ready and not members.starting:
                        why = "; ".join(
                            f"worker {m} {reason}" for m, reason in sorted(members.retired.items())
                        )
                        raise PoolError(f"no {members.name} worker is left: {why}")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"step {step}: {len(done)}/{len(entries)} requests done after {timeout}s"
                    )
                self._cond.wait(remaining)
            self._steps.pop(step, None)
            carried = [e for e in entries if not e.done]
            if carried:
                # APRIL: unfinished requests keep running (or waiting) and are delivered first next step
                for entry in carried:
                    entry.step = step + 1
                    entry.carried = True
                self._steps[step + 1] = carried + self._steps.get(step + 1, [])
                self.stats["carried"] += len(carried)
            return PoolBatch([e.result for e in done], version=self._version)

    def run(self, requests: Sequence[RolloutRequest], timeout: float | None = None) -> PoolBatch:
        """``submit`` then ``collect`` at the current version: one synchronous batch."""
        self.submit(requests)
        return self.collect(timeout=timeout)

    def submit_through(
        self,
        step: int,
        make_requests: Callable[[int], Sequence[RolloutRequest]],
        last_step: int | None = None,
    ) -> None:
        """Make sure the requests of every step up to ``step`` (at most ``last_step``) are queued: calls
        ``make_requests(s)`` and submits its requests for each step ``s`` not requested before, in order,
        starting from the version at the first call."""
        if self._planned is None:
            self._planned = self._version
        through = step if last_step is None else min(step, last_step)
        while self._planned <= through:
            self.submit(make_requests(self._planned), step=self._planned)
            self._planned += 1

    def submit_ahead(
        self,
        step: int,
        make_requests: Callable[[int], Sequence[RolloutRequest]],
        last_step: int | None = None,
    ) -> None:
        """The staleness window: queue the requests of the steps up to ``step + max_staleness`` (at most
        ``last_step``), so that workers generate them while step ``step`` trains. Called once per step, after
        the trainer has used step ``step``'s samples to update what ``make_requests`` reads."""
        self.submit_through(step + self.max_staleness, make_requests, last_step)

    def stream(
        self,
        make_requests: Callable[[int], Sequence[RolloutRequest]],
        num_steps: int,
        min_samples: int | None = None,
    ) -> Iterator[PoolBatch]:
        """Yield one :class:`PoolBatch` per step, keeping requests queued up to ``max_staleness`` steps ahead.

        ``make_requests(step)`` is called when step ``step`` enters the window (up to ``max_staleness`` steps
        early, with the trainer's statistics of that moment). The caller must :meth:`broadcast` the new weights
        between iterations: step ``k`` is collected at version ``k`` (starting from the current version).
        """
        first = self._version
        last = first + num_steps - 1
        for step in range(first, first + num_steps):
            self.submit_ahead(step, make_requests, last)
            yield self.collect(step, min_samples=min_samples)

    def broadcast(self, update: WeightUpdate) -> None:
        """Publish new weights: every rollout worker loads ``update`` before any request dispatched after this.

        Raises:
            ValueError: ``update.version`` is not above the current version.
        """
        with self._cond:
            self._raise_if_closed()
            if update.version <= self._version:
                raise ValueError(f"weight versions must increase: got {update.version} after {self._version}")
            self._version = update.version
            self._last_update = update
            ready = sorted(self._rollout.ready)
            for m, future in self._rollout.executor.broadcast(ready, "load_weights", update).items():
                self._watch(future, _Call("load", self._rollout, m))
        self._events.put(_WAKE)  # requests of later steps may now be admissible

    def pending(self, step: int | None = None) -> int:
        """Samples requested for ``step`` (default: the current version) and not yet delivered."""
        with self._cond:
            entries = self._steps.get(self._version if step is None else step, [])
            return sum(e.request.num_samples for e in entries)

    def worker_info(self, kind: Literal["rollout", "reward"] = "rollout") -> list[dict[str, Any]]:
        """``info()`` of every ready worker of ``kind`` (pid; version for rollout workers), in worker order.

        Waits behind the work already queued on each worker.
        """
        members = self._rollout if kind == "rollout" else self._reward
        if members is None:
            raise ValueError("this pool has no reward workers")
        with self._cond:
            futures = {m: members.executor.call(m, "info") for m in sorted(members.ready)}
        return [{"worker": m, **future.result()} for m, future in futures.items()]

    def close(self) -> None:
        """Stop the dispatcher and release every worker (Ray actors are killed)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._events.put(_WAKE)
        self._thread.join()
        # reward actors first: a Ray cluster the rollout executor started is shut down with it
        for members in (self._reward, self._rollout):
            if members is not None:
                members.executor.shutdown()

    def __enter__(self) -> RolloutPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _raise_if_closed(self) -> None:
        if self._broken is not None:
            raise self._broken
        if self._closed:
            raise PoolError("the pool is closed")

    # ------------------------------------------------------------------ dispatcher (holds self._cond)

    def _watch(self, future: Future, call: _Call) -> int:
        token = self._next_token
        self._next_token += 1
        self._calls[token] = call
        if call.kind != "start":  # a member is only called once built: its calls queue behind each other
            call.members.queued.setdefault(call.member, {})[token] = call
        # the callback runs in whatever thread completes the future: it only posts an event
        future.add_done_callback(lambda f: self._events.put((token, f)))
        return token

    def _send_work(
        self, members: _Members, m: int, kind: Literal["run", "score"], arg: Any, entry: _Entry
    ) -> None:
        """Queue a run/score call on member ``m``; its timeout clock starts once every call queued before it
        on ``m`` (weight loads included) has finished (:meth:`_start_clock`)."""
        self._watch(members.executor.call(m, kind, arg), _Call(kind, members, m, entry))
        self._start_clock(members, m)

    def _start_clock(self, members: _Members, m: int) -> None:
        """Start the ``request_timeout`` clock of the run/score call member ``m`` executes now, if not yet:
        a load slower than ``request_timeout`` must not count against the request queued behind it."""
        call = members.executing(m)
        if (
            self.request_timeout is not None
            and call is not None
            and call.kind != "load"
            and call.deadline is None
        ):
            call.deadline = time.monotonic() + self.request_timeout

    def _start(self, members: _Members, m: int) -> None:
        members.starting.add(m)
        self._watch(members.executor.start(m), _Call("start", members, m))

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    deadlines = [c.deadline for c in self._calls.values() if c.deadline is not None]
                wait = None if not deadlines else max(0.0, min(deadlines) - time.monotonic())
                try:
                    events = [self._events.get(timeout=wait)]
                except queue.Empty:
                    events = []
                while True:  # drain: handle everything that is ready in one locked pass
                    try:
                        events.append(self._events.get_nowait())
                    except queue.Empty:
                        break
                with self._cond:
                    if self._closed:
                        return
                    for event in events:
                        if event is not _WAKE:
                            self._on_done(*event)
                    self._check_deadlines()
                    self._dispatch()
                    self._cond.notify_all()
        except Exception as err:  # a dispatcher bug must reach the trainer, not hang collect() forever
            logger.exception("rollout pool dispatcher failed")
            with self._cond:
                self._broken = PoolError(f"rollout pool dispatcher failed: {err!r}")
                self._cond.notify_all()

    def _dispatch(self) -> None:
        while free := self._rollout.free(self.max_inflight):
            entry = self._next_admissible()
            if entry is None:
                break
            # the version the trainer holds now: the worker has loaded it, since loads precede this call
            self._send_work(
                self._rollout, free[0], "run", replace(entry.request, weight_version=self._version), entry
            )
        while self._reward is not None and self._to_score and (free := self._reward.free(self.max_inflight)):
            entry = self._to_score.popleft()
            self._send_work(self._reward, free[0], "score", entry.result.reward_inputs, entry)

    def _next_admissible(self) -> _Entry | None:
        for i, entry in enumerate(self._queue):
            if entry.step - self._version <= self.max_staleness:
                del self._queue[i]
                return entry
        return None

    def _on_done(self, token: int, future: Future) -> None:
        call = self._calls.pop(token, None)
        if call is None:
            return  # the call was abandoned (its worker was lost): its outcome no longer counts
        members, m = call.members, call.member
        error = future.exception()
        executing = members.executing(m)  # before this call leaves the queue: what ran when the member died
        if call.kind != "start":
            del members.queued[m][token]
            self._start_clock(members, m)  # the next queued call starts executing now
        if error is not None and members.executor.is_death(error):
            self._lose(members, m, f"died ({type(error).__name__})", [call], executing)
            return
        cause = None if error is None else members.executor.cause(error)
        if call.kind == "start":
            members.starting.discard(m)
            if cause is not None:
                members.retired[m] = f"could not be built: {cause!r}"
                self._errors.append(PoolError(f"could not build {members.name} worker {m}: {cause!r}"))
                return
            members.ready.add(m)
            if members is self._rollout and self._last_update is not None:
                # a new (or replacement) worker starts from the latest weights
                self._watch(
                    members.executor.call(m, "load_weights", self._last_update), _Call("load", members, m)
                )
        elif call.kind == "load":
            if cause is not None:
                # it keeps its old weights and would refuse every request from now on; a replacement would load
                # the same update: out of service, its requests go to the other workers
                reason = f"failed to load weights: {cause!r}"
                self._errors.append(PoolError(f"rollout worker {m} {reason}; it is out of service"))
                self._lose(members, m, reason, [], None, replace=False)
        elif call.kind == "run":
            rid = call.entry.request.request_id
            if cause is None:
                result = future.result()
                if isinstance(result, RolloutResult) and result.request_id == rid:
                    result.worker = m
                    self._on_generated(call.entry, result)
                else:
                    # a worker bug fails its request only: the pool and the other requests go on
                    self._fail(
                        call.entry,
                        PoolError(
                            f"rollout worker {m} answered request {rid!r} with {_describe(result)}, "
                            "not its RolloutResult"
                        ),
                    )
            elif isinstance(cause, WeightVersionError):
                # the worker missed a broadcast: give it the latest weights and let any worker retry
                logger.warning("rollout worker %d: %s; re-sending weights and re-queuing", m, cause)
                self.stats["version_refusals"] += 1
                self._watch(
                    members.executor.call(m, "load_weights", self._last_update), _Call("load", members, m)
                )
                self._queue.appendleft(call.entry)
            else:
                self._fail(call.entry, PoolError(f"request {rid!r} failed on rollout worker {m}: {cause!r}"))
        else:
            if cause is not None:
                self._retry_score(call.entry, cause)
            elif isinstance(output := future.result(), RewardOutput):
                self._on_scored(call.entry, output)
            else:
                rid = call.entry.request.request_id
                self._fail(
                    call.entry,
                    RewardError(
                        f"reward worker {m} answered request {rid!r} with {_describe(output)}, "
                        "not a RewardOutput"
                    ),
                )

    def _on_generated(self, entry: _Entry, result: RolloutResult) -> None:
        entry.result = result
        if self._reward is None:
            entry.done = True
        elif result.reward_inputs is None:
            self._fail(
                entry,
                RewardError(
                    f"request {result.request_id!r}: the rollout worker gives no reward inputs to score"
                ),
            )
        else:
            self._to_score.append(entry)

    def _on_scored(self, entry: _Entry, output: RewardOutput) -> None:
        result = entry.result
        if len(output.scores) != result.num_samples:
            self._fail(
                entry,
                RewardError(
                    f"request {result.request_id!r}: the reward returned "
                    f"{len(output.scores)} scores for {result.num_samples} samples"
                ),
            )
            return
        result.reward = output
        result.reward_inputs = None  # the images/texts also live in result.output
        entry.done = True

    def _retry_score(self, entry: _Entry, cause: BaseException) -> None:
        entry.reward_attempts += 1
        rid = entry.request.request_id
        if entry.reward_attempts > self.reward_retries:
            self._fail(
                entry,
                RewardError(
                    f"scoring request {rid!r} failed {entry.reward_attempts} times; last error: {cause!r}"
                ),
            )
            return
        self.stats["reward_retries"] += 1
        logger.warning(
            "reward of request %r failed (%r); retry %d/%d",
            rid,
            cause,
            entry.reward_attempts,
            self.reward_retries,
        )
        self._to_score.appendleft(entry)

    def _fail(self, entry: _Entry, error: PoolError) -> None:
        """Surface ``error`` at the next ``collect`` and stop waiting for ``entry``."""
        self._errors.append(error)
        entries = self._steps.get(entry.step, [])
        if entry in entries:
            entries.remove(entry)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        expired = {}
        for call in self._calls.values():
            if call.kind in ("run", "score") and call.deadline is not None and now > call.deadline:
                expired[(id(call.members), call.member)] = call
        for call in expired.values():
            rid = call.entry.request.request_id
            self._lose(
                call.members,
                call.member,
                f"exceeded request_timeout={self.request_timeout}s on request {rid!r}",
                [],
                call,
            )

    def _lose(
        self,
        members: _Members,
        m: int,
        reason: str,
        calls: list[_Call],
        executing: _Call | None,
        replace: bool = True,
    ) -> None:
        """Drop worker ``m`` (dead, hung, or unable to load weights): abandon its calls, re-queue its work,
        replace it (if ``replace`` and ``respawn``).

        Only ``executing``, the call ``m`` was running, is charged: a scoring attempt, or a lost worker for its
        request, which fails once it has lost ``max_worker_losses`` workers (the request itself kills or hangs
        them). The calls queued behind it never ran, so they go back to the queue as they were.
        """
        for token, call in list(self._calls.items()):
            if call.members is members and call.member == m:
                del self._calls[token]
                calls.append(call)
        requeued, failed = [], []
        for call in reversed(calls):  # pushed to the front in reverse: the queue keeps their order
            if call.kind == "score" and call is executing:
                self._retry_score(call.entry, PoolError(f"reward worker {m} {reason}"))
                continue
            if call.kind == "run" and call is executing:
                call.entry.workers_lost += 1
                if call.entry.workers_lost >= self.max_worker_losses:
                    rid = call.entry.request.request_id
                    failed.append(rid)
                    self._fail(
                        call.entry,
                        PoolError(
                            f"request {rid!r} lost {call.entry.workers_lost} rollout workers "
                            f"(max_worker_losses={self.max_worker_losses}); the last one, worker {m}, {reason}"
                        ),
                    )
                    continue
            if call.kind in ("run", "score"):
                (self._queue if call.kind == "run" else self._to_score).appendleft(call.entry)
                requeued.append(call.entry.request.request_id)
        members.ready.discard(m)
        members.queued.pop(m, None)
        members.starting.discard(m)
        members.executor.kill(m)
        self.stats["worker_lost"] += 1
        self.stats["requeued"] += len(requeued)
        if any(call.kind == "start" for call in calls):
            # it died while being built: rebuilding would most likely die again (out of memory, bad driver)
            replace = False
            reason = f"{reason} while starting"
            self._errors.append(PoolError(f"{members.name} worker {m} {reason}"))
        logger.warning(
            "%s worker %d %s; re-queued %s%s%s",
            members.name,
            m,
            reason,
            requeued or "nothing",
            f"; failed {failed} (max_worker_losses reached)" if failed else "",
            "; starting a replacement" if replace and self.respawn else "; not replaced",
        )
        if replace and self.respawn:
            self.stats["respawned"] += 1
            self._start(members, m)
        else:
            self.stats["retired"] += 1
            members.retired[m] = reason if not replace else f"{reason} (respawn is off)"


def _describe(answer: Any) -> str:
    """What a worker answered, for an error: its type and a short repr (a request id for a result)."""
    if isinstance(answer, RolloutResult):
        return f"the RolloutResult of request {answer.request_id!r}"
    return f"a {type(answer).__name__} {reprlib.repr(answer)}"
