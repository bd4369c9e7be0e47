"""ProcessGroupMRC: torch.distributed's ProcessGroup over an mrc Communicator.

Each call checks its arguments (before anything is sent), hands contiguous tensors to the
communicator as zero-copy numpy views, and issues the collective with async_op=True: the
communicator runs its collectives in issue order on its own worker thread, in mrc's C
executor. One completer thread per group waits for those in the same order, copies staged
outputs back, and completes the torch Future that Work.wait(), DDP's reducer and comm hooks
use. The caller only blocks in Work.wait().

A collective that has not finished within the group's timeout aborts the communicator (so
every pending and later call fails at once, here and, through the dropped connections, on
the peers) and fails its Work with an error that names the call and the timeout.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from mrc.torch._tensors import (
    Staged,
    TensorError,
    byte_view,
    check_tensor,
    flat_view,
    one_tensor,
    reduce_kind,
    reduce_op,
    same_shape,
)

BACKEND_NAME = "mrc"


class MrcBackendError(RuntimeError):
    """A collective of the mrc backend failed (timeout, a peer gone, the group aborted)."""


class Work(dist.Work):
    """One issued call: wait() blocks the caller until it completed; get_future() for DDP."""

    def __init__(self, what: str, outputs: list[torch.Tensor], default_timeout: float) -> None:
        super().__init__()
        self.what = what
        self._outputs = outputs
        self._future: Future[list[torch.Tensor]] = Future()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._default_timeout = default_timeout
        # A held recv (ProcessGroupMRC._hold): asked for, it is issued first
        self._release: Callable[[], None] | None = None

    def _demand(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    # completer thread side
    def _complete(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()
        # Future callbacks (DDP's reducer, comm hooks) run here, on the completer thread.
        if error is None:
            self._future.set_result(self._outputs)
        else:
            self._future.set_exception(error)

    # caller side
    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        secs = timeout.total_seconds() if timeout else 0.0
        if secs <= 0:
            secs = self._default_timeout
        self._demand()
        if not self._done.wait(secs):
            raise MrcBackendError(f"mrc backend: {self.what} did not complete within {secs:g} s")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        self._demand()
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:  # type: ignore[override]
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def get_future(self) -> Future[list[torch.Tensor]]:
        self._demand()
        return self._future

    def synchronize(self) -> None:
        self.wait()


@dataclass
class _Pending:
    work: Work
    handles: list[Any]  # the communicator's Work objects, in issue order
    staged: Staged
    deadline: float
    after: Callable[[], None] | None = None


class ProcessGroupMRC(dist.ProcessGroup):
    """The "mrc" backend of one torch process group (its ranks are the group's ranks)."""

    def __init__(self, comm: Any, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._comm = comm
        self._rank = rank
        self._size = size
        self._timeout = timeout.total_seconds()
        self._seq = itertools.count()
        self._lock = threading.Lock()  # issue order = communicator order = completion order
        self._pending: queue.Queue[_Pending | None] = queue.Queue()
        self._closed = False
        self._aborted: str | None = None
        self._zombies: list[_Pending] = []  # timed-out calls the executor never let go of
        self._held: list[tuple[Work, Staged, Sequence[Callable[[], Any]], Any]] = []
        self._completer = threading.Thread(
            target=self._complete_loop, name=f"mrc-torch-completer-r{rank}", daemon=True
        )
        self._completer.start()

    # --- what torch asks of a backend -----------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    # torch sets these on the group it built; on a Python group the C++ setters do not
    # reach the getters (ProcessGroup name not set), and DeviceMesh / FSDP read group_name
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return getattr(self, "_group_name", "")

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:  # type: ignore[override]
        return getattr(self, "_group_desc", "")

    @property
    def closed(self) -> bool:
        """True once shut down or aborted (its communicator is closed or closing)."""
        return self._closed

    @property
    def communicator(self) -> Any:
        """The mrc Communicator under this group (its .endpoint takes fault injection)."""
        return self._comm

    def __repr__(self) -> str:
        return f"ProcessGroupMRC(rank={self._rank}, size={self._size})"

    # --- issuing --------------------------------------------------------------------------

    def _issue(
        self,
        what: str,
        outputs: list[torch.Tensor],
        staged: Staged,
        calls: Sequence[Callable[[], Any]],
        after: Callable[[], None] | None = None,
        kind: str = "",
    ) -> Work:
        """Issue calls (each returns a communicator Work) and hand them to the completer.
        kind "send" / "recv": a p2p call (a recv is held, see below)."""
        seq = next(self._seq)
        desc = ", ".join(
            f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in outputs[:2]
        )
        more = f" +{len(outputs) - 2}" if len(outputs) > 2 else ""
        tensors = f" of tensor {desc}{more}" if outputs else ""
        work = Work(f"{what}{tensors} #{seq} on rank {self._rank}", outputs, self._timeout)
        with self._lock:
            if self._closed or self._aborted is not None:
                raise MrcBackendError(
                    f"mrc backend rank {self._rank}: {what}: the process group is "
                    f"{'shut down' if self._closed else 'aborted: ' + str(self._aborted)}"
                )
            if kind == "recv":
                # Held until the next call of this group or until asked for: a send issued
                # after it then goes first (the other direction: the order of each stream
                # is kept), so a batch [irecv, isend] around a ring does not wait on itself.
                self._held.append((work, staged, calls, after))
                work._release = self._release_held
                return work
            if kind == "send":
                self._submit(work, staged, calls, after)
                self._submit_held()
            else:
                self._submit_held()
                self._submit(work, staged, calls, after)
        return work

    def _release_held(self) -> None:
        with self._lock:
            self._submit_held()

    def _submit_held(self) -> None:
        """Issue the held recvs, in their order (self._lock held)."""
        held, self._held = self._held, []
        for i, (work, staged, calls, after) in enumerate(held):
            work._release = None
            try:
                self._submit(work, staged, calls, after)
            except BaseException as e:  # noqa: BLE001 - each held call's own error
                work._complete(e)
                for w, *_ in held[i + 1 :]:
                    w._release = None
                    w._complete(e)
                return

    def _submit(
        self,
        work: Work,
        staged: Staged,
        calls: Sequence[Callable[[], Any]],
        after: Callable[[], None] | None,
    ) -> None:
        """Issue calls to the communicator and hand them to the completer (self._lock held)."""
        deadline = time.monotonic() + self._timeout
        handles: list[Any] = []
        try:
            for c in calls:
                handles.append(c())
        except BaseException as e:
            if handles:
                # a coalesced call half issued: the issued part keeps its tensors
                # (the completer holds them) until the executor is done with them
                held = Work(work.what, [], self._timeout)
                self._pending.put(_Pending(held, handles, staged, deadline))
            raise _wrap(e, work.what) from e
        self._pending.put(_Pending(work, handles, staged, deadline, after))

    def _complete_loop(self) -> None:
        while True:
            p = self._pending.get()
            if p is None:
                return
            error: BaseException | None = None
            try:
                for h in p.handles:
                    left = p.deadline - time.monotonic()
                    if left <= 0 or not _wait_handle(h, left):
                        raise MrcBackendError(
                            f"mrc backend: {p.work.what} did not complete within the "
                            f"process group's timeout of {self._timeout:g} s; group aborted"
                        )
            except BaseException as e:  # noqa: BLE001 - handed to the waiter, never lost
                error = e if isinstance(e, MrcBackendError) else _wrap(e, p.work.what)
                self._abort_from_completer(str(error))
                self._hold_until_drained(p)
            if error is None:
                # The data is in: what is left is local (copies into the caller's tensors),
                # so its failure is this call's alone and the group goes on, as Gloo's.
                try:
                    p.staged.finish()
                    if p.after is not None:
                        with torch.no_grad():
                            p.after()
                except Exception as e:  # noqa: BLE001 - handed to the waiter, never lost
                    error = _wrap(e, p.work.what)
            p.work._complete(error)

    def _hold_until_drained(self, p: _Pending) -> None:
        """After an abort, keep p's tensors alive until the executor let go of them.

        The executor may still be writing into a buffer of a call that timed out; its
        handle completes once the abort drained it. One that never does keeps its tensors
        for the life of the group (a leak, never a write into freed memory).
        """
        for h in p.handles:
            try:
                done = _wait_handle(h, 5.0)
            except BaseException:  # noqa: BLE001 - failed is finished: it let go
                continue
            if not done:
                self._zombies.append(p)
                return

    def _abort_from_completer(self, why: str) -> None:
        if self._aborted is None:
            self._aborted = why
            try:
                self._comm.abort()
            except Exception:  # noqa: BLE001 - already failing; the first error is reported
                pass

    # --- collectives ----------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        op = reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM), self._rank, "allreduce")
        t = one_tensor(tensors, self._rank, "allreduce")
        return self._allreduce_many([t], op, "allreduce")

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        op = reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM), self._rank, "allreduce_coalesced")
        ts = [
            check_tensor(t, self._rank, f"allreduce_coalesced tensor {i}")
            for i, t in enumerate(tensors)
        ]
        return self._allreduce_many(ts, op, "allreduce_coalesced")

    def _allreduce_many(self, ts: list[torch.Tensor], op: str, what: str) -> Work:
        names = (
            [f"{what} tensor"] if len(ts) == 1 else [f"{what} tensor {i}" for i in range(len(ts))]
        )
        kinds = [reduce_kind(t, op, self._rank, nm) for t, nm in zip(ts, names, strict=True)]
        st = Staged()
        bufs = [st.output(t) for t in ts]
        calls = [
            self._call("all_reduce", b, dt, op=k_op)
            for b, (dt, k_op) in zip(bufs, kinds, strict=True)
        ]
        return self._issue(what, ts, st, calls)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        root = self._root(_opt(opts, "rootRank", 0), "broadcast")
        t = one_tensor(tensors, self._rank, "broadcast")
        st = Staged()
        b = st.output(t)
        return self._issue("broadcast", [t], st, [self._move("broadcast", b, root=root)])

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        root = self._root(_opt(opts, "rootRank", 0), "reduce")
        op = reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM), self._rank, "reduce")
        t = one_tensor(tensors, self._rank, "reduce")
        dt, op = reduce_kind(t, op, self._rank, "reduce tensor")
        st = Staged()
        b = st.output(t)
        return self._issue("reduce", [t], st, [self._call("reduce", b, dt, op=op, root=root)])

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> Work:
        t = one_tensor(input_tensors, self._rank, "allgather input")
        if len(output_tensors) != 1 or len(output_tensors[0]) != self._size:
            got = [len(o) for o in output_tensors]
            raise TensorError(
                f"mrc backend rank {self._rank}: allgather needs one output list of "
                f"{self._size} tensors (the group size), got lists of {got}"
            )
        outs = output_tensors[0]
        for i, o in enumerate(outs):
            check_tensor(o, self._rank, f"allgather output {i}")
            same_shape(o, t, self._rank, f"allgather output {i} vs input")
        st = Staged()
        src = st.input(t)
        gathered = torch.empty((self._size * t.numel(),), dtype=t.dtype)
        st.keep.append(gathered)
        chunks = gathered.view(self._size, -1)

        def scatter_out() -> None:
            for i, o in enumerate(outs):
                o.copy_(chunks[i].view(o.shape))

        call = self._move2("all_gather", src, gathered)
        return self._issue("allgather", outs, st, [call], after=scatter_out)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:
        t = check_tensor(input, self._rank, "all_gather_into_tensor input")
        o = check_tensor(output, self._rank, "all_gather_into_tensor output")
        self._check_multiple(o, t, "all_gather_into_tensor output", "input")
        st = Staged()
        src, dst = st.input(t), st.output(o)
        return self._issue("all_gather_into_tensor", [o], st, [self._move2("all_gather", src, dst)])

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work:
        if len(outputs) != len(inputs):
            raise TensorError(
                f"mrc backend rank {self._rank}: allgather_into_tensor_coalesced: "
                f"{len(outputs)} outputs for {len(inputs)} inputs"
            )
        st = Staged()
        calls = []
        for i, (o, t) in enumerate(zip(outputs, inputs, strict=True)):
            check_tensor(t, self._rank, f"allgather_into_tensor_coalesced input {i}")
            check_tensor(o, self._rank, f"allgather_into_tensor_coalesced output {i}")
            self._check_multiple(o, t, f"output {i}", f"input {i}")
            calls.append(self._move2("all_gather", st.input(t), st.output(o)))
        return self._issue("allgather_into_tensor_coalesced", list(outputs), st, calls)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> Work:
        op = reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM), self._rank, "reduce_scatter")
        o = one_tensor(output_tensors, self._rank, "reduce_scatter output")
        dt, op = reduce_kind(o, op, self._rank, "reduce_scatter output")
        if len(input_tensors) != 1 or len(input_tensors[0]) != self._size:
            got = [len(i) for i in input_tensors]
            raise TensorError(
                f"mrc backend rank {self._rank}: reduce_scatter needs one input list of "
                f"{self._size} tensors (the group size), got lists of {got}"
            )
        ins = input_tensors[0]
        for i, t in enumerate(ins):
            check_tensor(t, self._rank, f"reduce_scatter input {i}")
            same_shape(t, o, self._rank, f"reduce_scatter input {i} vs output")
        st = Staged()
        # the list is copied into one contiguous send buffer: mrc takes one buffer per call
        send = torch.cat([t.reshape(-1) for t in ins])
        st.keep.append(send)
        dst = st.output(o)
        return self._issue(
            "reduce_scatter", [o], st, [self._call2("reduce_scatter", send, dst, dt, op=op)]
        )

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Work:
        op = reduce_op(
            _opt(opts, "reduceOp", dist.ReduceOp.SUM), self._rank, "reduce_scatter_tensor"
        )
        t = check_tensor(input, self._rank, "reduce_scatter_tensor input")
        o = check_tensor(output, self._rank, "reduce_scatter_tensor output")
        self._check_multiple(t, o, "reduce_scatter_tensor input", "output")
        dt, op = reduce_kind(o, op, self._rank, "reduce_scatter_tensor output")
        st = Staged()
        src, dst = st.input(t), st.output(o)
        return self._issue(
            "reduce_scatter_tensor", [o], st, [self._call2("reduce_scatter", src, dst, dt, op=op)]
        )

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work:
        op = reduce_op(
            _opt(opts, "reduceOp", dist.ReduceOp.SUM), self._rank, "reduce_scatter_coalesced"
        )
        if len(outputs) != len(inputs):
            raise TensorError(
                f"mrc backend rank {self._rank}: reduce_scatter_tensor_coalesced: "
                f"{len(outputs)} outputs for {len(inputs)} inputs"
            )
        st = Staged()
        calls = []
        for i, (o, t) in enumerate(zip(outputs, inputs, strict=True)):
            check_tensor(t, self._rank, f"reduce_scatter_tensor_coalesced input {i}")
            check_tensor(o, self._rank, f"reduce_scatter_tensor_coalesced output {i}")
            self._check_multiple(t, o, f"input {i}", f"output {i}")
            dt, op_i = reduce_kind(o, op, self._rank, f"reduce_scatter_tensor_coalesced output {i}")
            calls.append(self._call2("reduce_scatter", st.input(t), st.output(o), dt, op=op_i))
        return self._issue("reduce_scatter_tensor_coalesced", list(outputs), st, calls)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> Work:
        t = check_tensor(input, self._rank, "all_to_all_single input")
        o = check_tensor(output, self._rank, "all_to_all_single output")
        if t.dtype != o.dtype:
            raise TensorError(
                f"mrc backend rank {self._rank}: all_to_all_single: input dtype {t.dtype} "
                f"and output dtype {o.dtype} differ"
            )
        send_counts = self._split_counts(t, input_split_sizes, "input")
        recv_counts = self._split_counts(o, output_split_sizes, "output")
        st = Staged()
        src, dst = st.input(t), st.output(o)
        w = t.element_size()
        call = self._a2a(src, dst, [c * w for c in send_counts], [c * w for c in recv_counts])
        return self._issue("all_to_all_single", [o], st, [call])

    all_to_all_single = alltoall_base

    def alltoall(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> Work:
        for name, ts in (("output", output_tensors), ("input", input_tensors)):
            if len(ts) != self._size:
                raise TensorError(
                    f"mrc backend rank {self._rank}: all_to_all needs {self._size} {name} "
                    f"tensors (the group size), got {len(ts)}"
                )
        ins = [
            check_tensor(t, self._rank, f"all_to_all input {i}")
            for i, t in enumerate(input_tensors)
        ]
        outs = [
            check_tensor(t, self._rank, f"all_to_all output {i}")
            for i, t in enumerate(output_tensors)
        ]
        st = Staged()
        # the lists go through one contiguous buffer each way (copies: mrc takes one buffer)
        send = torch.cat([byte_view_t(t) for t in ins])
        recv = torch.empty((sum(t.numel() * t.element_size() for t in outs),), dtype=torch.uint8)
        st.keep += [send, recv]
        rcounts = [t.numel() * t.element_size() for t in outs]

        def split_out() -> None:
            off = 0
            for t, n in zip(outs, rcounts, strict=True):
                t.copy_(recv[off : off + n].view(t.dtype).view(t.shape))
                off += n

        call = self._a2a(send, recv, [t.numel() * t.element_size() for t in ins], rcounts)
        return self._issue("all_to_all", outs, st, [call], after=split_out)

    def _root_list(
        self,
        root: int,
        lists: list[list[torch.Tensor]],
        like: torch.Tensor,
        kind: str,
        what: str,
        other: str,
    ) -> list[torch.Tensor]:
        """The root's one list of size tensors of gather/scatter, each checked against
        this rank's own tensor; empty on the other ranks."""
        if self._rank != root:
            return []
        if len(lists) != 1 or len(lists[0]) != self._size:
            raise TensorError(
                f"mrc backend rank {self._rank}: {kind} root needs one {what} list of "
                f"{self._size} tensors, got lists of {[len(x) for x in lists]}"
            )
        for i, x in enumerate(lists[0]):
            check_tensor(x, self._rank, f"{kind} {what} {i}")
            same_shape(x, like, self._rank, f"{kind} {what} {i} vs {other}")
        return lists[0]

    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> Work:
        """An all_to_all in which every rank sends its tensor to the root and nothing else."""
        root = self._root(_opt(opts, "rootRank", 0), "gather")
        t = one_tensor(input_tensors, self._rank, "gather input")
        nb = t.numel() * t.element_size()
        outs = self._root_list(root, output_tensors, t, "gather", "output", "input")
        st = Staged()
        send = byte_view_t(t)
        recv = torch.empty((nb * self._size if outs else 0,), dtype=torch.uint8)
        st.keep += [send, recv]
        sc = [nb if d == root else 0 for d in range(self._size)]
        rc = [nb if outs else 0] * self._size

        def split_out() -> None:
            for i, o in enumerate(outs):
                o.copy_(recv[i * nb : (i + 1) * nb].view(o.dtype).view(o.shape))

        return self._issue("gather", outs, st, [self._a2a(send, recv, sc, rc)], after=split_out)

    def scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> Work:
        """An all_to_all in which only the root sends: tensor i to rank i."""
        root = self._root(_opt(opts, "rootRank", 0), "scatter")
        o = one_tensor(output_tensors, self._rank, "scatter output")
        nb = o.numel() * o.element_size()
        ins = self._root_list(root, input_tensors, o, "scatter", "input", "output")
        st = Staged()
        send = (
            torch.cat([byte_view_t(t) for t in ins]) if ins else torch.empty(0, dtype=torch.uint8)
        )
        dst = st.output(o)
        st.keep.append(send)
        sc = [nb if ins else 0] * self._size
        rc = [nb if s == root else 0 for s in range(self._size)]
        return self._issue("scatter", [o], st, [self._a2a(send, dst, sc, rc)])

    def barrier(self, opts: Any = None) -> Work:
        return self._issue("barrier", [], Staged(), [lambda: self._comm.barrier(async_op=True)])

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> Work:  # noqa: N803
        t = one_tensor(tensors, self._rank, "send")
        peer = self._peer(dstRank, "send", "destination")
        st = Staged()
        b = st.input(t)
        call = lambda: self._comm.send(byte_view(b), peer, tag=tag, async_op=True)  # noqa: E731
        return self._issue(f"send to {peer}", [t], st, [call], kind="send")

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> Work:  # noqa: N803
        t = one_tensor(tensors, self._rank, "recv")
        peer = self._peer(srcRank, "recv", "source")
        st = Staged()
        b = st.output(t)
        call = lambda: self._comm.recv(byte_view(b), peer, tag=tag, async_op=True)  # noqa: E731
        return self._issue(f"recv from {peer}", [t], st, [call], kind="recv")

    # --- life cycle -----------------------------------------------------------------------

    def abort(self) -> None:
        """Fail every pending and later call at once (from any thread), then release."""
        with self._lock:
            if self._aborted is None:
                self._aborted = "abort() was called"
            held, self._held = self._held, []
        for work, *_ in held:
            work._release = None
            work._complete(MrcBackendError(f"mrc backend: {work.what}: the group was aborted"))
        try:
            self._comm.abort()
        finally:
            self._stop()

    def shutdown(self) -> None:
        """Let issued work finish, then close the communicator (destroy_process_group)."""
        with self._lock:
            if self._closed:
                return
            self._submit_held()  # issued work finishes, held recvs included
            self._closed = True
        self._stop()

    def _stop(self) -> None:
        self._closed = True
        self._pending.put(None)
        if threading.current_thread() is not self._completer:
            self._completer.join(self._timeout + 5)
        self._comm.close()

    # --- helpers --------------------------------------------------------------------------

    def _root(self, root: int, what: str) -> int:
        if not 0 <= root < self._size:
            raise TensorError(
                f"mrc backend rank {self._rank}: {what}: root rank {root} is not in the group "
                f"(ranks 0..{self._size - 1})"
            )
        return root

    def _peer(self, peer: int, what: str, role: str) -> int:
        if not 0 <= peer < self._size or peer == self._rank:
            raise TensorError(
                f"mrc backend rank {self._rank}: {what}: {role} rank {peer} is "
                + ("this rank" if peer == self._rank else f"not in the group (0..{self._size - 1})")
            )
        return peer

    def _check_multiple(self, big: torch.Tensor, small: torch.Tensor, bn: str, sn: str) -> None:
        if big.dtype != small.dtype:
            raise TensorError(
                f"mrc backend rank {self._rank}: {bn} dtype {big.dtype} differs from {sn} "
                f"dtype {small.dtype}"
            )
        if big.numel() != self._size * small.numel():
            raise TensorError(
                f"mrc backend rank {self._rank}: {bn} has {big.numel()} elements, must be "
                f"group size {self._size} x {sn}'s {small.numel()} = "
                f"{self._size * small.numel()}"
            )

    def _split_counts(self, t: torch.Tensor, splits: list[int], name: str) -> list[int]:
        """Element counts per rank of an all_to_all_single buffer (splits are in rows)."""
        rows = t.shape[0] if t.dim() > 0 else 1
        per_row = t.numel() // rows if rows else 0
        if not splits:
            if rows % self._size:
                raise TensorError(
                    f"mrc backend rank {self._rank}: all_to_all_single {name} has {rows} rows, "
                    f"not divisible by the group size {self._size}; pass split sizes"
                )
            return [rows // self._size * per_row] * self._size
        if len(splits) != self._size or any(s < 0 for s in splits) or sum(splits) != rows:
            raise TensorError(
                f"mrc backend rank {self._rank}: all_to_all_single {name} split sizes {splits} "
                f"must be {self._size} non-negative row counts summing to {rows}"
            )
        return [s * per_row for s in splits]

    # The communicator calls. Buffers are numpy views of the tensors' own memory.
    def _call(self, name: str, b: torch.Tensor, dtype: str, **kw: Any) -> Callable[[], Any]:
        fn = getattr(self._comm, name)
        return lambda: fn(flat_view(b), **_dtype_kw(b, dtype), **kw, async_op=True)

    def _call2(
        self, name: str, a: torch.Tensor, b: torch.Tensor, dtype: str, **kw: Any
    ) -> Callable[[], Any]:
        fn = getattr(self._comm, name)
        return lambda: fn(flat_view(a), flat_view(b), **_dtype_kw(a, dtype), **kw, async_op=True)

    def _move(self, name: str, b: torch.Tensor, **kw: Any) -> Callable[[], Any]:
        fn = getattr(self._comm, name)
        return lambda: fn(byte_view(b), **kw, async_op=True)

    def _move2(self, name: str, a: torch.Tensor, b: torch.Tensor) -> Callable[[], Any]:
        fn = getattr(self._comm, name)
        return lambda: fn(byte_view(a), byte_view(b), async_op=True)

    def _a2a(
        self, a: torch.Tensor, b: torch.Tensor, sc: list[int], rc: list[int]
    ) -> Callable[[], Any]:
        return lambda: self._comm.all_to_all(
            byte_view(a), byte_view(b), send_counts=sc, recv_counts=rc, async_op=True
        )


def byte_view_t(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor of t's bytes (a copy only where t is not contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _dtype_kw(b: torch.Tensor, dtype: str) -> dict[str, str]:
    # numpy has no bfloat16, and bool reduces as uint8: say the dtype the bits are
    if b.dtype == torch.bfloat16:
        return {"dtype": "bfloat16"}
    return {}


def _opt(opts: Any, name: str, default: Any) -> Any:
    return default if opts is None else getattr(opts, name, default)


def _wait_handle(h: Any, timeout: float) -> bool:
    """Wait for a communicator Work; False if still running after timeout, its error raised."""
    try:
        h.wait(timeout)
    except TimeoutError:  # mrc.TimeoutError is one too; a wait that timed out, or the op did
        if not h.done():
            return False
        raise
    return bool(h.done())


def _wrap(e: BaseException, what: str) -> MrcBackendError:
    err = MrcBackendError(f"mrc backend: {what} failed: {type(e).__name__}: {e}")
    err.__cause__ = e
    return err
