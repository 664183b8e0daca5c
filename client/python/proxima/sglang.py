"""An SGLang HiCache storage backend over proximad (the L3 tier of SGLang's hierarchical cache).

    python -m sglang.launch_server --enable-hierarchical-cache \
        --hicache-storage-backend dynamic \
        --hicache-storage-backend-extra-config '{"backend_name": "proxima",
            "module_path": "proxima.sglang", "class_name": "ProximaHiCacheStorage",
            "target": "unix:/run/proxima/proximad.sock", "namespace": "default"}'

One SGLang page is one Proxima block (pages under 64 tokens compress poorly: a warning says so
at registration). The zero-copy v1 interface (batch_exists, batch_get_v1,
batch_set_v1) moves pages between the host pool and proximad straight from the pool's memory:
each page is the scatter/gather list that the pool's get_page_buffer_meta() names (2 pieces per
page in the page_first layouts, 2 per layer in layer_first). The generic interface (get, set,
batch_get, batch_set, exists) takes flat page tensors. Keys are SGLang's page hashes scoped by
model and tensor/pipeline/context-parallel rank (proxima.keys). MHA pools only: an MLA pool's
page is not a K/V block and is refused with the reason when it is registered.

A dead daemon never stops the server: lookups find nothing, gets fail, sets are dropped, all
counted and logged once (proxima.engine.Link); get_stats() returns the counters.
"""
import contextlib
import logging
from typing import Any, List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import (HiCacheStorage, HiCacheStorageConfig,
                                                  HiCacheStorageExtraInfo)

from .engine import Link, LinkOptions, ProfileSpec, usable_rope_theta
from .keys import block_key, scope_bytes

logger = logging.getLogger("proxima")

# Pages shorter than this store as blocks the daemon's 4-bit levels compress well below their
# 64-token ratio (docs/python.md, "SGLang": k4v3 4.1x at 64 tokens, 3.4x at 16, 0.8x at 1).
GOOD_PAGE_TOKENS = 64


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class ProximaHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig = None, kwargs: Optional[dict] = None):
        c = storage_config
        extra = (c.extra_config if c is not None else None) or {}
        self.options = LinkOptions.from_config(extra)
        model = (c.model_name if c is not None else None) or extra.get("model", "")
        ranks = ((c.tp_rank, c.tp_size, c.pp_rank, c.pp_size, c.attn_cp_rank, c.attn_cp_size)
                 if c is not None else (0, 1, 0, 1, 0, 1))
        self.scope = scope_bytes("sglang", self.options.namespace, model, *ranks)
        self.fingerprint = "{} tp={}/{} pp={}/{} cp={}/{}".format(
            model, ranks[1], ranks[0], ranks[3], ranks[2], ranks[5], ranks[4])[:256]
        # The host pool does not know the model's config: its RoPE base comes from extra_config
        # ("rope_theta", for the daemon's k4v3 levels; absent: unknown).
        self.rope_theta = usable_rope_theta(extra.get("rope_theta"))
        self.link: Optional[Link] = None
        self.mem_pool_host = None

    # ---- setup

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        p = mem_pool_host
        for attr in ("layer_num", "head_num", "head_dim", "page_size", "dtype", "kv_buffer"):
            if not hasattr(p, attr):
                raise ValueError(f"proxima.sglang: host pool {type(p).__name__} has no {attr}; "
                                 "expected an MHA host pool (MLA pools are not supported)")
        if p.page_size < GOOD_PAGE_TOKENS:
            logger.warning(
                "proxima.sglang: pages of %d tokens are stored one per Proxima block, and "
                "proximad's 4-bit levels compress short blocks poorly (k4v3: 4.1x at 64 tokens, "
                "3.4x at 16, under 1x at 1, where blocks stay at fp8 at best); launch SGLang with "
                "--page-size %d or larger for the full ratio", p.page_size, GOOD_PAGE_TOKENS)
        spec = ProfileSpec(num_layers=p.layer_num, num_kv_heads=p.head_num, head_dim=p.head_dim,
                           tokens_per_block=p.page_size, dtype=_dtype_name(p.dtype),
                           fingerprint=self.fingerprint, rope_theta=self.rope_theta)
        self.link = Link(self.options, spec)
        buf = p.kv_buffer
        self.link.register_buffer(buf.data_ptr(), buf.numel() * buf.element_size())
        self.link.connected(wait=True)  # now if the daemon is up; in the background later

    def _keys(self, keys: List[str]) -> List[bytes]:
        return [block_key(self.scope, k) for k in keys]

    def _pages(self, keys: List[str], host_indices: torch.Tensor):
        """One scatter/gather list per page, from the pool's zero-copy metadata."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        n = len(keys)
        if n == 0 or len(ptrs) % n != 0:
            raise ValueError(f"proxima.sglang: {len(ptrs)} buffer pieces for {n} keys; "
                             "expected the same number of pieces for every page")
        per = len(ptrs) // n
        return [list(zip(ptrs[i * per:(i + 1) * per], sizes[i * per:(i + 1) * per]))
                for i in range(n)]

    # ---- zero-copy v1 interface

    def batch_exists(self, keys: List[str],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        return self.link.lookup(self._keys(keys))

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        return self.link.get(self._keys(keys), self._pages(keys, host_indices))

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        return self.link.put(self._keys(keys), self._pages(keys, host_indices))

    # ---- generic interface: flat page tensors

    @contextlib.contextmanager
    def _registered(self, tensors):
        """Registers tensors the pool does not own for the length of one call."""
        added = []
        try:
            for t in tensors:
                address, length = t.data_ptr(), t.numel() * t.element_size()
                try:
                    self.link.register_buffer(address, length)
                    added.append(address)
                except ValueError:
                    pass  # inside a registered buffer (a view of the pool): already covered
            yield
        finally:
            for address in added:
                self.link.unregister_buffer(address)

    @staticmethod
    def _whole(t: torch.Tensor):
        if not t.is_contiguous():
            raise ValueError(f"proxima.sglang: page tensor of shape {tuple(t.shape)} and strides "
                             f"{t.stride()}: expected a contiguous tensor")
        return [(t.data_ptr(), t.numel() * t.element_size())]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        if target_locations is None:
            raise ValueError("proxima.sglang: batch_get needs target_locations (page tensors)")
        with self._registered(target_locations):
            found = self.link.get(self._keys(keys), [self._whole(t) for t in target_locations])
        return [t if ok else None for t, ok in zip(target_locations, found)]

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        return self.batch_get([key], [target_location])[0]

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        values = [v.contiguous() for v in values]
        with self._registered(values):
            return all(self.link.put(self._keys(keys), [self._whole(v) for v in values]))

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def exists(self, key: str) -> bool:
        return self.link.exists(self._keys([key]))[0]

    def clear(self) -> None:
        """Proxima blocks are shared with other workers and evicted by the daemon: nothing to do."""

    def get_stats(self):
        return vars(self.link.counters).copy() if self.link is not None else None
