"""A vLLM KV connector over proximad: prompt-prefix KV blocks saved once, loaded by any later
request (on any worker, after any restart) that shares the prefix.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "ProximaConnector",
        "kv_role": "kv_both", "kv_connector_module_path": "proxima.vllm",
        "kv_connector_extra_config": {"target": "unix:/run/proxima/proximad.sock",
                                      "namespace": "default"}}'

Proxima blocks of 64 tokens: vLLM's pages are small (16 tokens by default), and a codec's
metadata (scales, minimums per group of tokens) weighs more per token the fewer tokens a block
has (the trace replay holds 3.2-3.3x raw's blocks with k4v3 at 16 tokens, 4.1x at 64:
docs/benchmarks.md), and every block costs a key, a lookup entry and a share of a call. So the connector stores
`block_tokens` tokens per Proxima block (kv_connector_extra_config or PROXIMA_BLOCK_TOKENS; a
multiple of vLLM's block_size; default the smallest multiple >= 64), made of block_tokens /
block_size consecutive vLLM blocks of a request ("a group"). Only whole groups are stored and
loaded: up to block_tokens - block_size more tokens of a prompt's tail are recomputed than with
one Proxima block per vLLM block (block_tokens = block_size gives that back).

Keys: vLLM's own block hashes (request.block_hashes, which chain the hashes of the blocks before
them; a group's key is its last block's hash), scoped by namespace, model, revision, KV dtype and
tensor/pipeline rank (proxima.keys).
Workers and restarts agree only when vLLM's hashes do: set PYTHONHASHSEED to the same value on
every process and use a deterministic --prefix-caching-hash-algo (sha256 or sha256_cbor), see
docs/python.md.

Scheduler side: get_num_new_matched_tokens asks proximad once (one Lookup of the groups from the
one the local prefix-cache hit ends in) and claims the tokens of the groups found past that hit;
update_state_after_alloc records where they go; build_connector_meta lists, per step, the groups
to load (a group's blocks the local cache already holds are not written: proxima.KV_NO_BLOCK)
and the newly full groups to save.
Worker side: register_kv_caches reads each layer's KV tensor layout from its shape and strides
(the dimension order is matched against vLLM's known layouts, never assumed), start_load_kv gets
the blocks and scatters them into the paged tensors before the forward pass, wait_for_save
gathers the newly full blocks into Proxima's canonical block layout [layer][k|v][token][head][dim]
and puts them. Loads and saves are synchronous. Gather/scatter is proxima.KvLayout
(kernels/kv_layout.h), built from each layer's data pointer and the strides of its logical view:
on CPU tensors the C++ path copies straight between the paged tensors and the staging buffer the
daemon reads and writes; on CUDA tensors the CUDA kernel copies into a device staging buffer that
moves to the pinned host one in one copy (when the module was built with CUDA; otherwise torch
does the gather/scatter, logged once). The host staging buffer (proxima.staging) is memory the
connected client allocated with UCX when it moves bytes over UCX (reallocated with the client
after a daemon restart; every chunk's gather or scatter and its put or get use one connection's
client and buffer), else a heap tensor registered with the link.

A dead daemon never stops the engine: the lookup finds nothing, a load reports its blocks
through get_block_ids_with_load_errors() so vLLM recomputes them, saves are dropped; all counted
(get_kv_connector_stats-like counters on .link.counters) and logged once.
"""
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole)

from ._proxima import KV_LAYOUT_CUDA, KV_NO_BLOCK, KvLayout
from .engine import Link, LinkOptions, ProfileSpec, model_rope_theta
from .keys import block_key, scope_bytes
from .staging import HostStaging

logger = logging.getLogger("proxima")

# Dimension roles of a paged KV tensor and the orders vLLM's attention backends use.
ROLES = ("kv", "block", "token", "head", "dim")
KNOWN_LAYOUTS = (
    ("kv", "block", "token", "head", "dim"),  # FlashAttention, Triton (NHD)
    ("block", "kv", "token", "head", "dim"),  # FlashInfer (NHD), blocks outermost
    ("kv", "block", "head", "token", "dim"),  # HND
    ("block", "kv", "head", "token", "dim"),  # FlashInfer (HND)
)
# vLLM's CPU attention (CPU_ATTN) allocates [block][head][token][2 * dim] and reads it as
# [block][head][2 * token][dim], K in the first block_size rows and V in the rest: in memory,
# this order.
CPU_ATTN_LAYOUT = ("block", "head", "kv", "token", "dim")
STAGING_BLOCKS = 32  # vLLM blocks per put/get call through the staging buffer (whole groups)
DEFAULT_BLOCK_TOKENS = 64  # tokens per Proxima block: the smallest multiple of block_size >= this


def block_tokens(extra: Optional[dict], block_size: int) -> int:
    """Tokens per Proxima block: `block_tokens` of the connector's extra config (or
    PROXIMA_BLOCK_TOKENS), a positive multiple of vLLM's block_size; by default the smallest
    multiple of it that is >= DEFAULT_BLOCK_TOKENS."""
    value = (extra or {}).get("block_tokens", os.environ.get("PROXIMA_BLOCK_TOKENS"))
    if value is None:
        return -(-DEFAULT_BLOCK_TOKENS // block_size) * block_size
    try:
        tokens = int(value)
    except (TypeError, ValueError):
        tokens = 0
    if tokens <= 0 or tokens % block_size or str(value).strip() != str(tokens):
        raise ValueError(f"proxima.vllm: block_tokens {value!r}: expected a positive multiple of "
                         f"vLLM's block_size {block_size}")
    return tokens


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def kv_cache_dtype(vllm_config) -> torch.dtype:
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype in ("auto", None):
        return vllm_config.model_config.dtype
    if str(cache_dtype).startswith("fp8"):
        return torch.float8_e4m3fn
    raise ValueError(f"proxima.vllm: kv cache dtype '{cache_dtype}': expected auto or fp8")


def parallel_ranks(vllm_config) -> Tuple[int, int, int, int]:
    """(tp_rank, tp_size, pp_rank, pp_size) of this worker (rank 0 on the scheduler)."""
    p = vllm_config.parallel_config
    tp, pp = p.tensor_parallel_size, p.pipeline_parallel_size
    rank = int(getattr(p, "rank", 0) or 0)
    return rank % tp, tp, (rank // tp) % pp, pp


def profile_spec(vllm_config, ranks, tokens_per_block: Optional[int] = None) -> ProfileSpec:
    """The profile proximad keeps this shard's blocks under; `tokens_per_block`: tokens per
    Proxima block (block_tokens), vLLM's block_size when not given."""
    m = vllm_config.model_config
    p = vllm_config.parallel_config
    tp_rank, tp, pp_rank, pp = ranks
    fingerprint = f"{m.model}@{m.revision or ''} tp={tp}/{tp_rank} pp={pp}/{pp_rank}"
    return ProfileSpec(num_layers=m.get_num_layers(p), num_kv_heads=m.get_num_kv_heads(p),
                       head_dim=m.get_head_size(),
                       tokens_per_block=tokens_per_block or vllm_config.cache_config.block_size,
                       dtype=_dtype_name(kv_cache_dtype(vllm_config)),
                       fingerprint=fingerprint[:256],
                       rope_theta=model_rope_theta(getattr(m, "hf_text_config", None)
                                                   or getattr(m, "hf_config", None)))


def key_scope(options: LinkOptions, vllm_config, ranks) -> bytes:
    m = vllm_config.model_config
    return scope_bytes("vllm", options.namespace, m.model, m.revision or "",
                       _dtype_name(kv_cache_dtype(vllm_config)), *ranks)


def logical_view(t: torch.Tensor, block_size: int, num_heads: int, head_dim: int,
                 hint: Optional[str] = None) -> torch.Tensor:
    """`t` viewed as [kv][block][token][head][dim] (a permutation: same memory, its strides).

    The order of t's dimensions is found by matching its shape against KNOWN_LAYOUTS (5-D caches)
    or CPU_ATTN_LAYOUT (the 4-D cache of vLLM's CPU attention); when more than one fits (equal
    sizes), `hint` ("NHD": token before head, "HND": head before token) decides, and a layout
    still ambiguous is an error naming the shape.
    """
    fits = []
    if t.dim() == 4 and tuple(t.shape[1:]) == (num_heads, block_size, 2 * head_dim):
        if t.stride(3) != 1 or t.stride(2) != 2 * head_dim:
            raise ValueError(
                f"proxima.vllm: KV tensor of shape {tuple(t.shape)} (CPU attention's layout) "
                f"with strides {t.stride()}: expected its last two dimensions contiguous")
        t = t.view(t.shape[0], num_heads, 2, block_size, head_dim)
        fits.append(CPU_ATTN_LAYOUT)
    elif t.dim() == 5:
        for layout in KNOWN_LAYOUTS:
            num_blocks = t.shape[layout.index("block")]
            sizes = {"kv": 2, "block": num_blocks, "token": block_size, "head": num_heads,
                     "dim": head_dim}
            if tuple(t.shape) == tuple(sizes[r] for r in layout):
                fits.append(layout)
    if len(fits) > 1 and hint in ("NHD", "HND"):
        first = "token" if hint == "NHD" else "head"
        fits = [f for f in fits if f.index(first) < f.index("head" if first == "token" else
                                                                  "token")]
    if len({tuple(f.index(r) for r in ROLES) for f in fits}) != 1:
        raise ValueError(
            f"proxima.vllm: KV tensor of shape {tuple(t.shape)}: expected one of the layouts "
            f"{[','.join(l) for l in KNOWN_LAYOUTS]} (or CPU attention's block,head,token,2*dim) "
            f"with block_size={block_size}, "
            f"num_kv_heads={num_heads}, head_dim={head_dim}; matched {len(fits)} (MLA caches "
            "are not supported)")
    return t.permute(*[fits[0].index(r) for r in ROLES])


def kv_layout(views: Sequence[torch.Tensor], block_size: int, num_heads: int,
              head_dim: int, group: int = 1) -> Optional[KvLayout]:
    """The KvLayout of the logical [kv][block][token][head][dim] views of every layer (their data
    pointers and strides as vLLM made them), `group` vLLM blocks per Proxima block, or None when
    the C++ path cannot take them: layers with different strides or block counts, or CUDA
    tensors in a module built without CUDA."""
    first = views[0]
    if any(v.stride() != first.stride() or v.shape != first.shape or v.device != first.device or
           v.dtype != first.dtype for v in views):
        logger.warning("proxima.vllm: KV tensors of the layers differ in shape, strides, device "
                       "or dtype; gather/scatter falls back to torch")
        return None
    if first.is_cuda and not KV_LAYOUT_CUDA:
        logger.warning("proxima.vllm: proxima._proxima was built without CUDA; gather/scatter of "
                       "CUDA KV tensors falls back to torch")
        return None
    layers = []
    for v in views:
        size = v.untyped_storage().nbytes() - v.storage_offset() * v.element_size()
        layers.append((v.data_ptr(), 0, size, 0))
    return KvLayout(layers=layers, strides=tuple(first.stride()), num_blocks=first.shape[1],
                    num_kv_heads=num_heads, head_dim=head_dim, tokens_per_block=block_size,
                    element_size=first.element_size(), device=first.is_cuda,
                    blocks_per_canonical=group)


@dataclass
class _Transfer:
    block_ids: List[int]  # vLLM block ids, `group` per key (KV_NO_BLOCK: not to write)
    keys: List[bytes]  # one per Proxima block


@dataclass
class ProximaConnectorMetadata(KVConnectorMetadata):
    loads: List[_Transfer] = field(default_factory=list)
    saves: List[_Transfer] = field(default_factory=list)


@dataclass
class _RequestState:
    """Counts in groups (Proxima blocks of `group` vLLM blocks) unless named blocks."""
    request: Any
    keys: List[bytes] = field(default_factory=list)  # of the groups' last block hashes, as computed
    block_ids: List[int] = field(default_factory=list)  # vLLM's, of the request
    first_unsaved: int = 0  # groups before this are in proximad or were computed elsewhere
    first_hit: int = 0  # the group the local prefix-cache hit ends in, as last matched
    local_blocks: int = 0  # vLLM blocks of that local hit
    load: Optional[Tuple[int, int]] = None  # (first group, count) to load, once allocated


class ProximaConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = getattr(self._kv_transfer_config, "kv_connector_extra_config", None) or {}
        self.options = LinkOptions.from_config(extra)
        self.block_size = vllm_config.cache_config.block_size
        self.block_tokens = block_tokens(extra, self.block_size)
        self.group = self.block_tokens // self.block_size  # vLLM blocks per Proxima block
        self.ranks = parallel_ranks(vllm_config)
        self.spec = profile_spec(vllm_config, self.ranks, self.block_tokens)
        self.scope = key_scope(self.options, vllm_config, self.ranks)
        self.link = Link(self.options, self.spec)
        # Scheduler side.
        self._requests: Dict[str, _RequestState] = {}
        # Worker side.
        self._layers: List[torch.Tensor] = []  # logical [kv][block][token][head][dim] views
        self._staging: Optional[HostStaging] = None
        self._kv_layout: Optional[KvLayout] = None  # None: torch does the gather/scatter
        self._device_staging: Optional[torch.Tensor] = None  # CUDA KV: the kernel's side
        self._load_errors: set = set()
        if role == KVConnectorRole.SCHEDULER:
            self.link.connected(wait=True)  # the worker connects once its caches are known

    def _keys(self, state: _RequestState, upto: int) -> List[bytes]:
        """The keys of the request's first `upto` groups (fewer when vLLM has hashed fewer full
        blocks): each group's is its last block's hash, which chains all before it."""
        hashes = state.request.block_hashes
        while len(state.keys) < min(upto, len(hashes) // self.group):
            last = (len(state.keys) + 1) * self.group - 1
            state.keys.append(block_key(self.scope, hashes[last]))
        return state.keys[:upto]

    def _group_ids(self, state: _RequestState, first: int, count: int, skip: int = 0) -> List[int]:
        """vLLM block ids of groups first..first+count-1, the first `skip` as KV_NO_BLOCK."""
        g = self.group
        ids = list(state.block_ids[first * g:(first + count) * g])
        ids[:skip] = [KV_NO_BLOCK] * min(skip, len(ids))
        return ids

    # ---------------- scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        state = self._requests.get(request.request_id)
        if state is None or state.request is not request:
            state = self._requests[request.request_id] = _RequestState(request)
        local = num_computed_tokens // self.block_size  # vLLM blocks the local cache holds
        first = local // self.group  # the group that local hit ends in (or the next one)
        # Never the whole prompt: vLLM computes at least its last token.
        claimable = (request.num_tokens - 1) // self.block_tokens
        # A group wholly inside the local hit is not saved again; one it ends in is, unless found.
        state.first_unsaved = max(state.first_unsaved, first)
        if claimable <= first:
            return 0, False
        hits = self.link.lookup(self._keys(state, claimable)[first:])
        state.first_unsaved = max(state.first_unsaved, first + hits)
        state.first_hit, state.local_blocks = first, local
        if not hits:
            return 0, False
        return (first + hits) * self.block_tokens - num_computed_tokens, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        # Called once the request got its blocks (all of them, the local hits first); a load is
        # planned only here, so a request that matched but was not scheduled loads nothing.
        state = self._requests.get(request.request_id)
        if state is None:
            return
        state.block_ids = list(blocks.get_block_ids()[0]) if blocks is not None else []
        if not num_external_tokens:
            state.load = None
            return
        end = (state.local_blocks * self.block_size + num_external_tokens) // self.block_tokens
        state.load = (state.first_hit, end - state.first_hit)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = ProximaConnectorMetadata()
        computed_after: Dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            computed_after[new.req_id] = (new.num_computed_tokens +
                                          scheduler_output.num_scheduled_tokens[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set())
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in resumed:
                    state.block_ids = list(new_ids[0])
                else:
                    state.block_ids += list(new_ids[0])
            computed_after[req_id] = (cached.num_computed_tokens[i] +
                                      scheduler_output.num_scheduled_tokens[req_id])
        for req_id, state in self._requests.items():
            if state.load is not None:
                first, count = state.load
                keys = self._keys(state, first + count)[first:]
                # The blocks of the first group that the local cache holds are not written.
                skip = state.local_blocks - first * self.group
                meta.loads.append(_Transfer(self._group_ids(state, first, count, skip), keys))
                state.load = None
            if req_id not in computed_after:
                continue
            full = min(computed_after[req_id] // self.block_tokens,
                       len(state.request.block_hashes) // self.group,
                       len(state.block_ids) // self.group)
            if full > state.first_unsaved:
                first = state.first_unsaved
                keys = self._keys(state, full)[first:]
                meta.saves.append(_Transfer(self._group_ids(state, first, full - first), keys))
                state.first_unsaved = full
        return meta

    def request_finished(self, request, block_ids: List[int]):
        self._requests.pop(request.request_id, None)
        return False, None

    # ---------------- worker side

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]):
        # "NHD" or "HND", as the engine core resolved it, when this vLLM says.
        hint = getattr(self._kv_cache_config, "kv_cache_layout", None)
        s = self.spec
        self._layers = [logical_view(t, self.block_size, s.num_kv_heads, s.head_dim, hint)
                        for t in kv_caches.values()]
        if len(self._layers) != s.num_layers:
            raise ValueError(f"proxima.vllm: {len(self._layers)} KV tensors; expected one per "
                             f"layer, {s.num_layers}")
        first = self._layers[0]
        # Whole Proxima blocks (groups), STAGING_BLOCKS vLLM blocks' worth, at least one.
        shape = (max(1, STAGING_BLOCKS // self.group), s.num_layers, 2, s.tokens_per_block,
                 s.num_kv_heads, s.head_dim)
        # Before the link connects: its clients allocate the staging memory as they connect.
        self._staging = HostStaging(self.link, shape, first.dtype, pin=first.is_cuda)
        self._kv_layout = kv_layout(self._layers, self.block_size, s.num_kv_heads, s.head_dim,
                                    self.group)
        if self._kv_layout is not None and self._kv_layout.device:
            self._device_staging = torch.empty(shape, dtype=first.dtype, device=first.device)
        self.link.connected(wait=True)

    @staticmethod
    def _staged_blocks(staging: torch.Tensor, n: int) -> List[List[Tuple[int, int]]]:
        block_bytes = staging[0].numel() * staging.element_size()
        base = staging.data_ptr()
        return [[(base + i * block_bytes, block_bytes)] for i in range(n)]

    def _chunks(self, transfers: Sequence[_Transfer]):
        """(vLLM block ids, keys) of up to a staging buffer's worth of Proxima blocks at a time;
        `group` ids per key."""
        ids = [b for t in transfers for b in t.block_ids]
        keys = [k for t in transfers for k in t.keys]
        n, g = self._staging.blocks, self.group
        for i in range(0, len(keys), n):
            yield ids[i * g:(i + n) * g], keys[i:i + n]

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, ProximaConnectorMetadata) or not meta.loads:
            return
        for ids, keys in self._chunks(meta.loads):
            # One connection for the chunk: its client gets into its staging memory.
            conn = self.link.connection()
            if conn is None:  # the daemon is down: the blocks fail (counted), nothing to stage
                self._staging.release()
                self.link.get(keys, [], via=None)
                self._load_errors.update(b for b in ids if b != KV_NO_BLOCK)
                continue
            staging = self._staging.tensor(conn)
            found = self.link.get(keys, self._staged_blocks(staging, len(keys)), via=conn)
            g = self.group
            groups = [ids[i * g:(i + 1) * g] for i in range(len(keys))]
            self._load_errors.update(b for group, f in zip(groups, found) if not f
                                     for b in group if b != KV_NO_BLOCK)
            rows = [i for i, f in enumerate(found) if f]
            if not rows:
                continue
            self._scatter(staging, [b for i in rows for b in groups[i]], rows, len(keys))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv has loaded every layer

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata,
                      **kwargs) -> None:
        return  # saved whole blocks, all layers at once, in wait_for_save

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        if not isinstance(meta, ProximaConnectorMetadata) or not meta.saves:
            return
        for ids, keys in self._chunks(meta.saves):
            # One connection for the chunk: gathered into its staging memory, put by its client.
            conn = self.link.connection()
            if conn is None:  # the daemon is down: the saves are dropped, nothing to gather
                self._staging.release()
                self.link.put(keys, [], via=None)
                continue
            staging = self._staging.tensor(conn)
            self._gather(staging, ids)
            self.link.put(keys, self._staged_blocks(staging, len(keys)), via=conn)

    def _gather(self, staging: torch.Tensor, ids: List[int]) -> None:
        """Paged blocks `ids` of every layer into staging rows 0..len(ids)/group-1, `group` of
        them per row, their tokens one after the other."""
        g = self.group
        n = len(ids) // g
        if self._kv_layout is None:
            for layer, view in enumerate(self._layers):
                index = torch.tensor(ids, device=view.device)
                x = view[:, index]  # [kv][n * g][token][head][dim]
                x = x.reshape(2, n, g * self.block_size, *x.shape[3:]).transpose(0, 1)
                staging[:n, layer].copy_(x)
        elif self._device_staging is None:
            self._kv_layout.gather(ids, staging.data_ptr())
        else:
            stream = torch.cuda.current_stream(self._device_staging.device)
            self._kv_layout.gather(ids, self._device_staging.data_ptr(), stream.cuda_stream)
            staging[:n].copy_(self._device_staging[:n])  # waits for the kernel

    def _scatter(self, staging: torch.Tensor, ids: List[int], rows: List[int],
                 staged: int) -> None:
        """Staging rows `rows` into paged blocks `ids` (`group` per row; KV_NO_BLOCK: that part
        of the row is not written) of every layer."""
        if self._kv_layout is None:
            g, bs = self.group, self.block_size
            parts = [(row, p, ids[j * g + p]) for j, row in enumerate(rows) for p in range(g)
                     if ids[j * g + p] != KV_NO_BLOCK]
            for layer, view in enumerate(self._layers):
                index = torch.tensor([b for _, _, b in parts], device=view.device)
                # [parts][kv][token][head][dim]: each part's tokens of its staging row
                src = torch.stack([staging[row, layer, :, p * bs:(p + 1) * bs]
                                   for row, p, _ in parts])
                view[:, index] = src.to(view.device).transpose(0, 1)
            return
        bb = self._kv_layout.block_bytes
        if self._device_staging is None:
            self._kv_layout.scatter(ids, [staging.data_ptr() + r * bb for r in rows])
            return
        dev = self._device_staging
        dev[:staged].copy_(staging[:staged])
        stream = torch.cuda.current_stream(dev.device).cuda_stream  # ordered after the copy
        self._kv_layout.scatter(ids, [dev.data_ptr() + r * bb for r in rows], stream)

    def get_block_ids_with_load_errors(self) -> set:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_finished(self, finished_req_ids):
        return None, None
