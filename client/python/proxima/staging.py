"""The host staging buffer of an engine integration (proxima.vllm), as a torch tensor in the
memory of the client that moves it.

Over UCX that is the Link's Connection.staging: memory the connected client allocated
(Client.alloc_buffer), wrapped without a copy (torch.frombuffer); a new client (the daemon
restarted) brings a new buffer, and the tensor follows it. Over inline, or when the allocation
failed, it is a heap tensor of our own, registered with the link once (register_buffer). For
CUDA KV caches (pin=True) the staging memory is page-locked: the heap tensor is allocated pinned,
the UCX memory is registered with cudaHostRegister and unregistered before it is let go.

Not thread-safe: one owner at a time (the connector's worker thread). A tensor returned by
tensor(conn) stays valid until the next tensor() or release(). With no connection (the daemon
is down) there is nothing to stage: release() lets the last client's buffer go.
"""
import contextlib
import logging
import math
from typing import Optional, Sequence

import torch

from .engine import Connection, Link

logger = logging.getLogger("proxima")


class HostStaging:
    def __init__(self, link: Link, shape: Sequence[int], dtype: torch.dtype, pin: bool):
        self._link = link
        self._shape = tuple(shape)
        self._dtype = dtype
        self._pin = pin
        self.blocks = self._shape[0]  # blocks the buffer holds (its first dimension)
        self.nbytes = math.prod(self._shape) * torch.empty((), dtype=dtype).element_size()
        self._heap: Optional[torch.Tensor] = None  # made on first use
        self._ucx_buffer = None  # the proxima.Buffer of the connection last seen
        self._ucx: Optional[torch.Tensor] = None  # over it (None: pinning it failed)
        self._pin_failed = False  # a cudaHostRegister failure was logged
        self.kind: Optional[str] = None  # what the last tensor() returned: "ucx" or "heap"
        link.set_staging(self.nbytes)

    def tensor(self, conn: Connection) -> torch.Tensor:
        """The staging tensor for calls through `conn`: in its staging memory when it has
        some, else the heap tensor. A buffer of an earlier connection is unpinned and let go."""
        if conn.staging is not self._ucx_buffer:
            self.release()
            self._ucx_buffer = conn.staging
            if conn.staging is not None:
                self._ucx = self._wrap(conn.staging)
        self.kind = "ucx" if self._ucx is not None else "heap"
        return self._ucx if self._ucx is not None else self._heap_tensor()

    def release(self) -> None:
        """Lets the UCX buffer in use go (unpinned first); the heap tensor stays."""
        t, self._ucx, self._ucx_buffer = self._ucx, None, None
        if t is not None and self._pin:
            err = int(torch.cuda.cudart().cudaHostUnregister(t.data_ptr()))
            if err != 0:
                logger.warning("proxima: cudaHostUnregister of the staging buffer: error %d", err)

    def __del__(self):
        with contextlib.suppress(Exception):  # at interpreter exit torch may be gone
            self.release()

    def _wrap(self, buffer) -> Optional[torch.Tensor]:
        """`buffer` as a tensor of our shape and dtype (no copy), pinned when asked; None when
        pinning fails (logged once: the heap tensor, allocated pinned, is used instead)."""
        t = torch.frombuffer(buffer, dtype=torch.uint8).view(self._dtype).view(self._shape)
        if self._pin:
            err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), self.nbytes,
                                                           1))  # cudaHostRegisterPortable
            if err != 0:
                if not self._pin_failed:
                    self._pin_failed = True
                    logger.warning("proxima: cudaHostRegister of the UCX staging buffer failed "
                                   "(error %d); staging in pinned heap memory instead (logged "
                                   "once)", err)
                return None
        return t

    def _heap_tensor(self) -> torch.Tensor:
        if self._heap is None:
            self._heap = torch.empty(self._shape, dtype=self._dtype, device="cpu",
                                     pin_memory=self._pin)
            self._link.register_buffer(self._heap.data_ptr(), self.nbytes)
        return self._heap
