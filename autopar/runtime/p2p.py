"""Point-to-point transport between pipeline stages: tags, posted receives, sends in flight,
and the timeout that turns a dead peer into an error instead of a hang.

Every value that crosses a stage boundary is one tagged message: (edge, micro-batch, direction),
an edge being one stage input that another stage produces. A value whose producer and consumer
live on the same rank goes through the mailbox instead (no copy, no process group). With one
stage (SPMD) there are no edges and nothing here runs.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from autopar.runtime import failure


class P2P:
    """One rank's side of the stage-to-stage transfers of one step (``begin`` ... ``finish``)."""

    def __init__(self, specs, schedule, pp_rank: int, pp_group, device, timeout: float | None = None):
        self.schedule = schedule
        self.pp_rank = pp_rank
        self.pp_ranks = dist.get_process_group_ranks(pp_group) if pp_group is not None else [dist.get_rank()]
        self.device = device
        self.microbatches = schedule.microbatches if schedule is not None else 1
        # seconds a receive may wait before the step fails (a peer that died must not hang the rest):
        # compile's timeout=, or AUTOPAR_P2P_TIMEOUT where set
        env = os.environ.get("AUTOPAR_P2P_TIMEOUT")
        self.timeout = float(env) if env else float(timeout if timeout is not None else failure.DEFAULT_TIMEOUT_S)
        self.guard = True  # waits through autopar/runtime/failure.py (off: plain bounded Work.wait)
        self._edges = {}
        for spec in specs:
            for k, src in enumerate(spec.inputs):
                if src[0] == "stage":
                    self._edges[(spec.index, k)] = len(self._edges)
        # the tags of input gradients a consumer stage does not produce (no gradient for that input)
        self.no_grad = {self.tag(spec.index, k, mb, True) for spec in specs for k, src in enumerate(spec.inputs)
                        if src[0] == "stage" and not spec.example[k].requires_grad
                        for mb in range(self.microbatches)}
        self.begin()

    def rank_of(self, stage: int) -> int:
        return self.schedule.rank_of(stage) if self.schedule is not None else self.pp_rank

    def here(self, stage: int) -> bool:
        return self.rank_of(stage) == self.pp_rank

    def tag(self, stage: int, k: int, mb: int, backward: bool) -> int:
        return (self._edges[(stage, k)] * self.microbatches + mb) * 2 + int(backward)

    # ---------------------------------------------------------------- one step
    def begin(self) -> None:
        self.mailbox: dict[int, torch.Tensor] = {}
        self.posted: dict[int, tuple] = {}
        self.pending: list[tuple] = []
        self.waited = 0.0  # seconds blocked in receives since the last ``take_waited``

    def deliver(self, value: torch.Tensor, stage_to: int, tag: int) -> None:
        """Hand ``value`` to stage ``stage_to``: the mailbox if it lives here, else an isend."""
        if self.here(stage_to):
            self.mailbox[tag] = value
            return
        t = value.contiguous()
        self.pending.append((dist.isend(t, dst=self.pp_ranks[self.rank_of(stage_to)], tag=tag), t))

    def post(self, like, stage_from: int, tag: int) -> None:
        """Post a receive now (irecv), so the transfer runs while this rank computes."""
        if tag not in self.posted and not self.here(stage_from):
            buf = torch.empty(like.shape, dtype=like.dtype, device=self.device)
            work = dist.irecv(buf, src=self.pp_ranks[self.rank_of(stage_from)], tag=tag)
            # guarded: a helper thread waits for it from now on (autopar/runtime/failure.py), so
            # collecting it costs no thread hand-off when it has arrived
            w = failure.world() if self.guard and self.device.type == "cpu" else None  # (gloo; NCCL: its own)
            self.posted[tag] = (work, buf, w.watch([work], self.timeout) if w is not None else None)

    def collect(self, like, stage_from: int, tag: int) -> torch.Tensor:
        """The value stage ``stage_from`` delivered under ``tag`` (waiting for it, bounded)."""
        if self.here(stage_from):
            return self.mailbox.pop(tag)
        self.post(like, stage_from, tag)
        work, buf, watched = self.posted.pop(tag)
        t0 = time.perf_counter()
        # bounded, and woken by another rank's failure (a peer that failed or never sends must not
        # hang this rank): autopar/runtime/failure.py
        src = self.pp_ranks[self.rank_of(stage_from)]
        what = f"the transfer from stage {stage_from} (rank {src}, tag {tag})"
        if watched is not None:
            failure.world().wait_watched(watched, what, self.timeout)
        else:
            failure.wait(work, what, self.timeout, p2p=True, guard=False)
        self.waited += time.perf_counter() - t0
        return buf

    def release_sent(self) -> None:
        """Drop the buffers of sends that completed."""
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]

    def finish(self) -> None:
        """Wait for the sends still in flight (bounded: a peer that died cannot take them)."""
        w = failure.world() if self.guard and self.device.type == "cpu" else None
        if w is not None:  # all handed to the helper at once (one hand-off)
            if self.pending:
                w.wait_watched(w.watch([work for work, _ in self.pending], self.timeout), "the sends to other stages",
                               self.timeout)
        else:
            for work, _ in self.pending:
                failure.wait(work, "a send to another stage", self.timeout, guard=False)
        self.pending = []
        assert not self.posted, "a posted receive was never used"
        self.mailbox = {}

    def take_waited(self) -> float:
        w, self.waited = self.waited, 0.0
        return w
