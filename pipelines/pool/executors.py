"""Where pool members run: threads of the trainer process, or Ray actors. One small interface for both.

An executor hosts ``n`` members, each built by calling a picklable factory where the member lives, and runs
method calls on a member one at a time, in submission order (a weight load queued before a request is applied
before it). Every call returns a :class:`concurrent.futures.Future`, so the pool waits on threads and actors
alike. Ray is imported only when a :class:`RayExecutor` is built.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pipelines.threads import ThreadsPolicy, set_cpu_threads

logger = logging.getLogger(__name__)


class Executor:
    """Hosts pool members; see the module docstring."""

    #: short name for logs
    kind: str = ""

    def start(self, index: int) -> Future:
        """(Re)build member ``index`` from the factory; the future resolves when it is ready."""
        raise NotImplementedError

    def call(self, index: int, method: str, *args: Any) -> Future:
        """``member.method(*args)`` on member ``index``, after every call submitted to it before."""
        raise NotImplementedError

    def broadcast(self, indices: list[int], method: str, arg: Any) -> dict[int, Future]:
        """``call(i, method, arg)`` for every ``i``, moving ``arg`` once where the executor can share it."""
        return {i: self.call(i, method, arg) for i in indices}

    def kill(self, index: int) -> None:
        """Stop member ``index`` (hung or unwanted); its pending futures fail or are abandoned."""
        raise NotImplementedError

    def is_death(self, error: BaseException) -> bool:
        """Whether ``error`` means the member is gone (process died), not that the call itself failed."""
        return False

    def cause(self, error: BaseException) -> BaseException:
        """The exception the member's code raised (unwraps the executor's own wrapper)."""
        return error

    def shutdown(self) -> None:
        """Release every member."""
        raise NotImplementedError


_BUILD_LOCK = threading.Lock()


class _MemberThread:
    """One member's thread: runs the calls submitted to it one at a time, in order, until :meth:`stop`.

    A daemon thread, not a ``ThreadPoolExecutor``'s: ``concurrent.futures`` joins its threads at interpreter
    exit, so a hung call that was abandoned (its member killed and replaced) would keep the process from exiting.
    A daemon thread is dropped at exit instead.
    """

    def __init__(self, name: str) -> None:
        self.calls: queue.SimpleQueue[tuple[Future, Callable[[], Any]] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        """``fn()`` after every call submitted before; the future resolves with its result or exception."""
        future: Future = Future()
        self.calls.put((future, fn))
        return future

    def stop(self) -> None:
        """Cancel the calls still queued; the thread ends once the call it runs (if any) returns."""
        while True:
            try:
                item = self.calls.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        self.calls.put(None)

    def _serve(self) -> None:
        while (item := self.calls.get()) is not None:
            self._run(*item)
            # an idle thread must not keep the last call's arguments and result (weights, trajectories) alive
            del item

    @staticmethod
    def _run(future: Future, fn: Callable[[], Any]) -> None:
        if not future.set_running_or_notify_cancel():  # cancelled while queued
            return
        try:
            result = fn()
        except BaseException as err:  # as in ThreadPoolExecutor: every failure reaches the caller's future
            future.set_exception(err)
        else:
            future.set_result(result)


class InProcessExecutor(Executor):
    """Members in this process, one daemon thread each (single GPU, no Ray).

    The rollout thread runs while the trainer's thread trains (torch releases the GIL in its kernels), which is
    what lets the asynchronous mode overlap generation with training even without Ray. A hung thread cannot be
    killed in Python: :meth:`kill` abandons it (it exits when its call returns, and never holds up the
    interpreter's exit) and a restarted member is built in a new thread.

    Args:
        factory: builds one member (called in the member's thread, so CUDA state is created there).
        num_members: members to host.
        drain_s: at :meth:`shutdown`, how long to wait for the calls live members are running (queued calls are
            cancelled). A generation left running after its pool closed would go on using the GPU and the
            process-wide RNG behind the caller's back.
    """

    kind = "in-process"

    def __init__(self, factory: Callable[[], Any], num_members: int, drain_s: float = 60.0) -> None:
        self.factory = factory
        self.drain_s = drain_s
        self.threads: list[_MemberThread | None] = [None] * num_members
        self.members: list[Any] = [None] * num_members
        self.pending: list[set[Future]] = [
            set() for _ in range(num_members)
        ]  # calls not finished, per member

    def start(self, index: int) -> Future:
        thread = _MemberThread(f"pool-member-{index}")
        self.threads[index] = thread

        def build() -> None:
            # Loading a diffusers/transformers model creates modules under accelerate's init_empty_weights, which
            # patches torch.nn.Module process-wide: two members built at once in their threads get each other's
            # meta tensors ("Cannot copy out of meta tensor"). Builds in one process take turns.
            with _BUILD_LOCK:
                self.members[index] = self.factory()

        return thread.submit(build)

    def call(self, index: int, method: str, *args: Any) -> Future:
        thread = self.threads[index]
        if thread is None:
            raise RuntimeError(f"member {index} is not running")
        # resolved in the member thread, after build() (same FIFO thread), so the member exists by then
        future = thread.submit(lambda: getattr(self.members[index], method)(*args))
        pending = self.pending[index]
        pending.add(future)
        future.add_done_callback(pending.discard)
        return future

    def kill(self, index: int) -> None:
        thread = self.threads[index]
        if thread is not None:
            thread.stop()
        self.threads[index] = None
        self.members[index] = None
        self.pending[index] = set()

    def shutdown(self) -> None:
        # a killed (hung) member is not waited for (its calls were forgotten); a live member's running call is
        live = [set(p) for p, t in zip(self.pending, self.threads, strict=True) if t is not None]
        for index in range(len(self.threads)):
            self.kill(index)  # cancels the queued calls
        wait([f for calls in live for f in calls if not f.cancelled()], timeout=self.drain_s)


@dataclass
class RayOptions:
    """How the pool uses Ray.

    Attributes:
        address: cluster to join (``"auto"``, ``"ray://host:10001"``, ``"host:6379"``), used when Ray is not yet
            initialised in this process; ``None`` is Ray's default (a cluster started on this machine by
            ``ray start``, else a new local one, which is shut down with the pool).
        num_cpus: CPUs reserved per actor.
        num_gpus: GPUs per actor: 1 = one actor per GPU; a fraction (0.5, 0.25) packs several rollout actors on
            one GPU (each must then fit in its share of memory); 0 for CPU actors.
        resources: extra custom resources per actor (e.g. ``{"rollout_node": 1}`` to pin actors to tagged nodes).
        runtime_env: Ray runtime environment for the actors (``{"env_vars": {...}}``). The OpenMP wait policy of
            this process (``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT``, ``pipelines/threads.py``) is added to its
            ``env_vars`` unless they set it.
        threads: torch CPU threads of each actor (``None``: torch's default; Ray itself sets ``OMP_NUM_THREADS``
            to the actor's ``num_cpus``).
        threads_policy: ``"adaptive"``: an actor's waiting OpenMP threads spin only briefly while other processes
            keep its cores busy (``pipelines.threads.set_cpu_threads``); ``"fixed"``: the waits stay as they start.
    """

    address: str | None = None
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] | None = None
    runtime_env: dict[str, Any] | None = None
    threads: int | None = None
    threads_policy: ThreadsPolicy = "adaptive"

    def actor_runtime_env(self) -> dict[str, Any]:
        """``runtime_env`` with this process's OpenMP wait policy among its ``env_vars`` (theirs win)."""
        env = dict(self.runtime_env or {})
        inherited = {
            key: os.environ[key] for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if key in os.environ
        }
        env["env_vars"] = {**inherited, **env.get("env_vars", {})}
        return env


def import_ray() -> Any:
    """``import ray`` with an install hint.

    Raises:
        ImportError: Ray is not installed.
    """
    try:
        import ray
    except ImportError as err:
        raise ImportError(
            "the Ray executor needs Ray: pip install 'mmrl[ray]' (or use executor='inprocess')"
        ) from err
    return ray


#: float dtypes numpy lacks, sent as the integer bits of their size (bfloat16 as int16, float8 as uint8)
_BITS_OF = {1: torch.uint8, 2: torch.int16}
_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)


def _tensor_to_numpy(t: torch.Tensor) -> tuple[np.ndarray, str, str]:
    """A tensor as a numpy array (a float dtype numpy lacks, bfloat16 or float8, as its integer bits), with its
    dtype and device."""
    dtype = str(t.dtype).removeprefix("torch.")
    data = t.detach().contiguous().cpu()
    if t.dtype.is_floating_point and t.dtype not in _NUMPY_FLOATS:
        data = data.view(_BITS_OF[t.dtype.itemsize])
    return data.numpy(), dtype, str(t.device)


def _tensor_from_numpy(packed: tuple[np.ndarray, str, str]) -> torch.Tensor:
    array, dtype, device = packed
    # the object store hands out read-only buffers: copy (a memcpy) rather than share them with writers
    t = torch.from_numpy(np.array(array, copy=True))
    if str(t.dtype).removeprefix("torch.") != dtype:  # the integer bits of a float numpy lacks
        t = t.view(getattr(torch, dtype))
    return t if device == "cpu" or not torch.cuda.is_available() else t.to(_receiving_device(device))


def _receiving_device(sent_from: str) -> str:
    """Where a tensor sent from ``sent_from`` lands: the same kind of device, this process's current one
    (``"cuda:1"`` -> ``"cuda"``). The sender's index names its own GPU: a trainer rank on ``cuda:1`` sends to
    an actor that sees its one GPU as ``cuda:0``, and an actor's ``cuda:0`` is not that trainer rank's GPU."""
    return sent_from.partition(":")[0]


def register_tensor_serializer(ray: Any) -> None:
    """Send torch tensors through Ray as numpy arrays: Ray moves those out of band (no pickling of the bytes),
    where a tensor's own pickling copies its storage through ``torch.save`` (measured: 16.7 ms vs 5.2 ms for a
    7 MB trajectory even in band). Needed in every process that sends or receives tensors."""
    ray.util.register_serializer(torch.Tensor, serializer=_tensor_to_numpy, deserializer=_tensor_from_numpy)


class _Host:
    """The body of a Ray actor: builds its member from the factory and forwards calls to it."""

    def __init__(
        self,
        factory: Callable[[], Any],
        threads: int | None = None,
        threads_policy: ThreadsPolicy = "adaptive",
    ) -> None:
        import ray

        register_tensor_serializer(ray)
        set_cpu_threads(threads, threads_policy)
        self.member = factory()

    def ready(self) -> bool:
        return True

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.member, method)(*args)


#: Ray executors alive in this process, and whether one of them started the local Ray cluster: that cluster is
#: shut down when the last of them closes (closing the one that started it first would kill the others' actors)
_ray_executors_alive = 0
_ray_started_here = False


class RayExecutor(Executor):
    """Members as Ray actors (one per GPU, fractional GPUs, or CPU actors).

    Actors are created with ``max_restarts=0``: a dead actor is replaced by the pool, which also re-sends the
    latest weights and re-queues the actor's request; Ray restarting it behind the pool's back would do neither.

    Args:
        factory: builds one member inside the actor (picklable: a ``functools.partial`` of a ``from_pretrained``).
        num_members: actors to host.
        options: resources and cluster address.
    """

    kind = "ray"

    def __init__(
        self, factory: Callable[[], Any], num_members: int, options: RayOptions | None = None
    ) -> None:
        global _ray_executors_alive, _ray_started_here
        self.ray = import_ray()
        self.options = options or RayOptions()
        if not self.ray.is_initialized():
            self.ray.init(address=self.options.address, include_dashboard=False)
            # a local cluster an executor started is stopped with the last executor; a cluster the caller
            # started or joined is left alone
            _ray_started_here = self.options.address is None
        _ray_executors_alive += 1
        self._closed = False
        register_tensor_serializer(self.ray)
        self.factory = factory
        self.actor_class = self.ray.remote(_Host).options(
            num_cpus=self.options.num_cpus,
            num_gpus=self.options.num_gpus,
            resources=self.options.resources,
            runtime_env=self.options.actor_runtime_env(),
            max_restarts=0,
            max_task_retries=0,
        )
        self.actors: list[Any] = [None] * num_members

    def start(self, index: int) -> Future:
        self.actors[index] = self.actor_class.remote(
            self.factory, self.options.threads, self.options.threads_policy
        )
        return self.actors[index].ready.remote().future()

    def call(self, index: int, method: str, *args: Any) -> Future:
        actor = self.actors[index]
        if actor is None:
            raise RuntimeError(f"member {index} is not running")
        return actor.call.remote(method, *args).future()

    def broadcast(self, indices: list[int], method: str, arg: Any) -> dict[int, Future]:
        # one copy in the object store, read by every actor (a LoRA is small, full weights are not)
        ref = self.ray.put(arg)
        return {i: self.call(i, method, ref) for i in indices}

    def kill(self, index: int) -> None:
        actor = self.actors[index]
        if actor is not None:
            self.ray.kill(actor, no_restart=True)
        self.actors[index] = None

    def is_death(self, error: BaseException) -> bool:
        return isinstance(error, self.ray.exceptions.RayActorError)

    def cause(self, error: BaseException) -> BaseException:
        if isinstance(error, self.ray.exceptions.RayTaskError) and error.cause is not None:
            return error.cause
        return error

    def shutdown(self) -> None:
        global _ray_executors_alive, _ray_started_here
        for index in range(len(self.actors)):
            self.kill(index)
        if self._closed:
            return
        self._closed = True
        _ray_executors_alive -= 1
        if _ray_executors_alive == 0 and _ray_started_here:
            self.ray.shutdown()
            _ray_started_here = False
