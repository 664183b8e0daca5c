"""Proxima for Python: the client of proximad, a KV-cache memory tier for LLM inference.

The binding (`proxima._proxima`, over libproxima) takes plain integers, never tensors:

    import proxima
    c = proxima.Client("unix:/run/proxima/proximad.sock", namespace="default")
    profile = c.register_profile(num_layers=32, num_kv_heads=8, head_dim=128,
                                 tokens_per_block=16, dtype="bf16", fingerprint="llama-3.1-8b tp=1/0")
    c.register_buffer(address, length)           # memory the blocks below live in (registered
                                                 # with UCX once)
    buf = c.alloc_buffer(length)                 # memory UCX allocated, registered: buf.address,
                                                 # buffer protocol (numpy/torch.frombuffer)
    c.put(profile, keys, [[(addr, n), ...], ...])  # one block = a list of (address, length) pieces
    c.get(profile, keys, blocks)                 # -> [found, ...], bytes scattered into the pieces
    c.lookup(profile, chain)                     # -> number of leading keys present
    h = c.get_async(profile, keys, blocks); h.poll(); h.wait(timeout=1.0)

Paged KV caches (vLLM's tensors) to canonical blocks and back, by addresses and element strides:

    kv = proxima.KvLayout(layers=[(k_addr, 0, size_bytes, 0), ...],   # (K, V or 0, sizes)
                          strides=(s_kv, s_block, s_token, s_head, s_dim), num_blocks=...,
                          num_kv_heads=8, head_dim=128, tokens_per_block=16, element_size=2)
    kv.gather(block_ids, dst_address)   # blocks back to back, or a list of addresses
    kv.scatter(block_ids, src_addresses)

With blocks_per_canonical=n, n paged blocks make one canonical block (n * tokens_per_block
tokens): ids come n per canonical block, and KV_NO_BLOCK stands for a part not to copy.

Engines: `proxima.vllm` (a vLLM KV connector) and `proxima.sglang` (a HiCache storage backend).
The STAR-KV codec is `proxima.codec` (the module tools/eval uses, built from the same source).
"""
import json as _json
import os as _os

# Development builds: the extension modules of a CMake build tree (client/python/ and tools/eval/
# of it), named by the test harness; an installed package carries them beside this file.
__path__ += [d for d in _os.environ.get("PROXIMA_EXTENSION_DIRS", "").split(_os.pathsep) if d]

from ._proxima import (KEY_BYTES, KV_LAYOUT_CUDA, KV_NO_BLOCK, Buffer, Error, Handle, KvLayout,
                       Profile, Unavailable)
from ._proxima import Client as _Client
from .keys import block_key, chain_keys

__all__ = ["Buffer", "Client", "Error", "Handle", "KEY_BYTES", "KV_LAYOUT_CUDA", "KV_NO_BLOCK",
           "KvLayout", "Profile", "Unavailable", "block_key", "chain_keys"]


class Client(_Client):
    """A connection to one proximad, acting for one namespace; see the module docstring."""

    def stats(self) -> dict:
        """The daemon's stats (StatsResponse, proto field names) as a dict."""
        return _json.loads(self.stats_json())
