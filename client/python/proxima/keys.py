"""Block keys: 32 bytes that name one block of one model shard, the same on every worker.

A key is BLAKE2b-256 over a scope (namespace, model, parallel rank, anything else that makes
two blocks with the same tokens different) and the engine's own hash of the block, which
already chains the hashes of the blocks before it. Python's hash() is never used, so keys do not
depend on PYTHONHASHSEED; the engine's block hash must not either (see docs/python.md).
"""
import hashlib
from typing import Iterable, List, Union

_Hash = Union[bytes, str, int]


def _hash_bytes(h: _Hash) -> bytes:
    if isinstance(h, bytes):
        return h
    if isinstance(h, str):
        return h.encode()
    if isinstance(h, int):
        return h.to_bytes((h.bit_length() + 8) // 8 or 1, "little", signed=True)
    raise TypeError(f"block hash of type {type(h).__name__}: expected bytes, str or int")


def scope_bytes(*parts: object) -> bytes:
    """The scope of a set of keys, from its parts (namespace, model, rank, ...)."""
    return "\x1f".join(str(p) for p in parts).encode()


def block_key(scope: bytes, block_hash: _Hash) -> bytes:
    """The 32-byte key of the block the engine hashed to `block_hash`, within `scope`."""
    h = hashlib.blake2b(digest_size=32, person=b"proxima-key-v1")
    data = _hash_bytes(block_hash)
    h.update(len(scope).to_bytes(4, "little"))
    h.update(scope)
    h.update(data)
    return h.digest()


def chain_keys(scope: bytes, block_hashes: Iterable[_Hash]) -> List[bytes]:
    """block_key() of each hash, in order (a prefix chain when the engine's hashes chain)."""
    return [block_key(scope, h) for h in block_hashes]
