"""A request inside a simulated engine (vLLM's `Request`, without tokens unless given)."""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

import numpy as np
import numpy.typing as npt

from controlplane.types import PriorityClass

Ids = npt.NDArray[np.int64]
NO_BLOCKS: Ids = np.zeros(0, dtype=np.int64)


class Status(IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3
    REJECTED = 4


class EngineRequest:
    """Mutable per-request engine state. Times are simulation seconds."""

    __slots__ = (
        "arrival_s",
        "block_buf",
        "cached_tokens",
        "finish_s",
        "first_scheduled_s",
        "first_token_s",
        "known_hashes",
        "known_view",
        "max_output",
        "num_blocks",
        "num_cached_blocks",
        "num_computed",
        "num_known",
        "num_output",
        "preemptions",
        "priority",
        "prompt_tokens",
        "queue_key",
        "request_id",
        "status",
        "tag",
        "token_ids",
        "uid",
        "unique_base",
    )

    def __init__(
        self,
        request_id: str,
        uid: int,
        prompt_tokens: int,
        max_output: int,
        known_hashes: Sequence[int] | Ids,
        arrival_s: float,
        priority: int = 0,
        token_ids: list[int] | None = None,
        tag: object = None,
    ) -> None:
        self.request_id = request_id
        self.uid = uid
        self.prompt_tokens = prompt_tokens
        self.max_output = max(1, max_output)
        # hash ids of the blocks whose content the trace knows (usually the prompt's full blocks)
        self.known_hashes: Ids = np.asarray(known_hashes, dtype=np.int64)
        self.num_known = len(self.known_hashes)
        self.known_view = self.known_hashes.data  # a Python int per index, for block_hash
        # hash ids of blocks nobody else can have (generated text, unknown prompt content) are
        # unique_base + (block index - len(known_hashes)); the engine assigns the base
        self.unique_base = -1
        self.arrival_s = arrival_s
        # vLLM priority: lower value is served first
        self.priority = priority
        self.token_ids = token_ids
        # opaque handle for whoever submitted the request (the fleet keeps its record here)
        self.tag = tag
        self.status = Status.WAITING
        self.num_computed = 0
        self.num_output = 0
        # the KV blocks held, in order: block_buf[:num_blocks]; block_buf has room to grow (a
        # decode appends one block every block_size tokens without copying the others)
        self.block_buf: Ids = NO_BLOCKS
        self.num_blocks = 0
        self.num_cached_blocks = 0
        self.preemptions = 0
        # prompt tokens served from the prefix cache at first admission (usage.cached_tokens)
        self.cached_tokens = -1
        self.first_scheduled_s = -1.0
        self.first_token_s = -1.0
        self.finish_s = -1.0
        # FCFS / priority ordering key (priority, arrival, sequence)
        self.queue_key: tuple[int, float, int] = (priority, arrival_s, uid)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens (vLLM's `num_tokens`)."""
        return self.prompt_tokens + self.num_output

    @property
    def remaining_output(self) -> int:
        return self.max_output - self.num_output

    @property
    def blocks(self) -> Ids:
        """The KV blocks held, in order (a view)."""
        return self.block_buf[: self.num_blocks]

    def add_blocks(self, new: Ids) -> None:
        """Append `new` to the blocks held (the array is adopted when none are held)."""
        n, k = self.num_blocks, len(new)
        buf = self.block_buf
        if not n:
            # adopted as is: it is full, so the next append copies it into a buffer of ours
            self.block_buf = new
        elif n + k <= len(buf):
            buf[n : n + k] = new
        else:
            grown = np.empty(max(2 * n, n + k, 16), dtype=np.int64)
            grown[:n] = buf[:n]
            grown[n : n + k] = new
            self.block_buf = grown
        self.num_blocks = n + k

    def add_block(self, block: int) -> None:
        """Append one block (a decode crossing a block boundary)."""
        n = self.num_blocks
        buf = self.block_buf
        if n >= len(buf):
            grown = np.empty(max(2 * n, 16), dtype=np.int64)
            grown[:n] = buf[:n]
            self.block_buf = buf = grown
        buf[n] = block
        self.num_blocks = n + 1

    def drop_blocks(self) -> None:
        """Hold no blocks (they were freed)."""
        self.block_buf = NO_BLOCKS
        self.num_blocks = 0
        self.num_cached_blocks = 0

    def block_hash(self, index: int) -> int:
        """Chained hash id of block `index`; blocks beyond the known content are unique."""
        known = self.num_known
        if index < known:
            return self.known_view[index]
        return self.unique_base + index - known

    def block_hashes(self, start: int, stop: int) -> Ids:
        known = self.known_hashes
        if stop <= len(known):
            return known[start:stop]
        base = self.unique_base - len(known)
        tail = np.arange(max(start, len(known)) + base, stop + base, dtype=np.int64)
        return tail if start >= len(known) else np.concatenate((known[start:], tail))

    def lookup_hashes(self, block_size: int) -> Ids:
        """Hash ids of every full block of the current token sequence (prompt + output)."""
        full = self.num_tokens // block_size
        if full <= len(self.known_hashes):
            return self.known_hashes
        return self.block_hashes(0, full)

    def __repr__(self) -> str:
        return (
            f"EngineRequest({self.request_id}, prompt={self.prompt_tokens}, "
            f"out={self.num_output}/{self.max_output}, computed={self.num_computed}, "
            f"status={self.status.name})"
        )


def priority_value(priority: PriorityClass) -> int:
    """vLLM priority for a class: interactive (0) is served before batch (1)."""
    return 0 if priority is PriorityClass.INTERACTIVE else 1
