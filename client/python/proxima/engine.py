"""What the engine integrations (proxima.vllm, proxima.sglang) share: a connection to proximad
that never takes the engine down with it.

A Link connects lazily, registers its profile and buffers, and turns every failure of the daemon
(down, restarting, too slow) into the answer that makes the engine recompute: a lookup finds
nothing, a load reports its blocks missing, a save is dropped. Failures are counted and logged
once when they start and once when the daemon is back, never per call. Bad input (a ValueError)
is a bug in the caller and is raised.

Staging memory: with set_staging(nbytes), every client the link connects that moves bytes over
UCX allocates that much memory with UCX (Client.alloc_buffer: over shared memory the daemon copies
into and out of it directly, docs/operations.md) and the Connection carries it. A daemon restart
means a new client and so a new buffer: memory of one client's UCX context is never used with
another, because a caller takes one Connection (connection()) and makes its calls through it
(via=). Over inline, or when the allocation fails (logged once), Connection.staging is None and
the caller stages in memory of its own, registered with register_buffer.
"""
import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import proxima

Blocks = Sequence[Sequence[Tuple[int, int]]]

logger = logging.getLogger("proxima")


@dataclass
class LinkOptions:
    """Where and how to reach proximad. Every field may come from an engine's extra config
    (same names) or from the PROXIMA_* environment variables."""
    target: str = "unix:/run/proxima/proximad.sock"
    namespace: str = "default"
    token: str = ""
    # Or a file holding the token, which the client reads again every 10 s: a rotated token
    # (docs/security.md) reaches a running engine without a restart. `token` wins over it.
    token_file: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    connect_timeout: float = 2.0
    call_timeout: float = 5.0
    retry_seconds: float = 2.0  # after a failure, wait this long before connecting again
    transport: str = "auto"  # "auto" (UCX when the daemon serves it), "ucx" or "inline"
    # Pages in the engine's own memory over UCX shared memory: "auto" (through UCX-allocated
    # staging when the daemon reaches this process over posix/sysv), "always" or "never".
    host_staging: str = "auto"

    @classmethod
    def from_config(cls, extra: Optional[dict]) -> "LinkOptions":
        extra = dict(extra or {})
        o = cls()
        for name in o.__dataclass_fields__:
            env = os.environ.get("PROXIMA_" + name.upper())
            value = extra.get(name, env)
            if value is not None:
                setattr(o, name, type(getattr(o, name))(value))
        return o


@dataclass
class ProfileSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int
    dtype: str
    fingerprint: str
    rope_theta: float = 0.0  # the model's RoPE base, 0 = unknown (model_rope_theta)


def usable_rope_theta(value) -> float:
    """`value` as a RoPE base the daemon takes (a number from 1 to 1e12), else 0.0 (unknown): a
    profile with another value would be refused, and a missing base only costs k4v3 some of its
    gain, never bytes."""
    try:
        theta = float(value)
    except (TypeError, ValueError):
        return 0.0
    return theta if 1.0 <= theta <= 1e12 else 0.0


# k4v3 turns each block's keys back by its RoPE (docs/format.md, "k4v3"): rotate-half pairs
# (j, j + head_dim/2) over every channel, at the base's own frequencies. A model whose RoPE is laid
# out otherwise is better told nothing (K is then quantized as int4 quantizes it) than a base that
# turns the wrong channels, at the wrong rates, which widens K's groups instead.
# Model types whose RoPE pairs adjacent channels (GPT-J style) in vLLM and Hugging Face.
INTERLEAVED_ROPE_MODEL_TYPES = frozenset({"gptj", "cohere", "cohere2", "chatglm", "glm", "glm4"})
# Frequency scalings that keep the fast pairs (those a block's tokens turn through) at the base's
# own frequencies, rescaling only slow ones; any other (linear, dynamic, longrope, ...) moves them.
SCALINGS_KEEPING_FAST_PAIRS = frozenset({"default", "llama3", "yarn"})


def _rotary_fraction(hf_config, params: dict) -> float:
    """The share of a head's channels that RoPE turns, as the config states it (1.0 when it
    states none): partial_rotary_factor, rotary_pct (GPT-NeoX) or rotary_dim (GPT-J)."""
    for value in (getattr(hf_config, "partial_rotary_factor", None),
                  params.get("partial_rotary_factor"), getattr(hf_config, "rotary_pct", None)):
        if value is not None:
            return float(value)
    rotary_dim = getattr(hf_config, "rotary_dim", None)
    head_dim = getattr(hf_config, "head_dim", None)
    if head_dim is None:
        hidden = getattr(hf_config, "hidden_size", None)
        heads = getattr(hf_config, "num_attention_heads", None)
        head_dim = hidden // heads if hidden and heads else None
    if rotary_dim is not None and head_dim:
        return float(rotary_dim) / float(head_dim)
    return 1.0


def model_rope_theta(hf_config) -> float:
    """The RoPE base of a Hugging Face model config (`rope_theta`, or `rope_parameters
    ["rope_theta"]` in newer transformers), for the daemon's k4v3 levels; 0.0 when it has none
    (usable_rope_theta), and when its RoPE is not the one k4v3 turns keys back by: partial
    (a rotary factor, pct or dim below the whole head), interleaved (INTERLEAVED_ROPE_MODEL_TYPES)
    or scaled in a way that moves the fast pairs (a scaling outside SCALINGS_KEEPING_FAST_PAIRS)."""
    params = getattr(hf_config, "rope_parameters", None)
    params = params if isinstance(params, dict) else {}
    theta = getattr(hf_config, "rope_theta", None)
    if theta is None:
        theta = params.get("rope_theta")
    if getattr(hf_config, "model_type", None) in INTERLEAVED_ROPE_MODEL_TYPES:
        return 0.0
    try:
        if _rotary_fraction(hf_config, params) < 1.0:
            return 0.0
    except (TypeError, ValueError):
        return 0.0  # a factor that is no number: unknown
    scaling = getattr(hf_config, "rope_scaling", None)
    for spec in (scaling if isinstance(scaling, dict) else {}, params):
        kind = spec.get("rope_type", spec.get("type"))
        if kind is not None and kind not in SCALINGS_KEEPING_FAST_PAIRS:
            return 0.0
    return usable_rope_theta(theta)


@dataclass
class LinkCounters:
    lookups_failed: int = 0      # lookups answered 0 because the daemon failed
    blocks_load_failed: int = 0  # blocks a load reported missing because the daemon failed
    blocks_save_dropped: int = 0  # blocks a save dropped because the daemon failed
    blocks_saved: int = 0
    blocks_loaded: int = 0
    hit_blocks: int = 0          # blocks found by lookups


@dataclass(frozen=True)
class Connection:
    """One connected client, the profile registered with it, and the staging memory it allocated
    (Link.set_staging; None over inline, when the allocation failed, or when none was asked).
    Calls through a Connection (Link.get/put via=) use that client and that memory together."""
    client: proxima.Client
    profile: proxima.Profile
    staging: Optional[proxima.Buffer] = None


# The default of Link.get/put's `via`: the connection current at the call.
_CURRENT = object()


class Link:
    def __init__(self, options: LinkOptions, spec: ProfileSpec):
        self.options = options
        self.spec = spec
        self.counters = LinkCounters()
        self._conn: Optional[Connection] = None
        self._profile: Optional[proxima.Profile] = None  # the last one registered
        self._buffers: Dict[int, int] = {}
        self._staging_bytes = 0
        self._staging_failed = False  # an alloc_buffer failure was logged
        self._lock = threading.Lock()
        self._next_try = 0.0
        self._down = False  # a failure was logged and the daemon has not answered since
        self._connecting = False

    @property
    def profile(self) -> Optional[proxima.Profile]:
        return self._profile

    def register_buffer(self, address: int, length: int) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.client.register_buffer(address, length)  # ValueError on an overlap
            self._buffers[address] = length

    def unregister_buffer(self, address: int) -> None:
        with self._lock:
            self._buffers.pop(address, None)
            if self._conn is not None:
                self._conn.client.unregister_buffer(address)

    def set_staging(self, nbytes: int) -> None:
        """Every client that moves bytes over UCX allocates `nbytes` of staging memory when it
        connects (Connection.staging); the one connected now, if any, at once. Call it before
        the link starts connecting (a connection attempt already running allocates nothing)."""
        with self._lock:
            self._staging_bytes = nbytes
            conn = self._conn
        if conn is not None and conn.staging is None:
            staging = self._alloc_staging(conn.client)
            with self._lock:
                if staging is not None and self._conn is conn:
                    self._conn = Connection(conn.client, conn.profile, staging)

    def connection(self, wait: bool = False) -> Optional[Connection]:
        """The connected client, its profile and its staging memory, or None. With none, starts
        a connection attempt (at most one per retry_seconds) on a background thread, so no
        engine call waits on a dead daemon; with wait=True the attempt runs here (start-up)."""
        with self._lock:
            if self._conn is not None:
                return self._conn
            now = time.monotonic()
            if self._connecting or now < self._next_try:
                return None
            self._next_try = now + self.options.retry_seconds
            self._connecting = True
        if wait:
            self._connect()
            return self._conn
        threading.Thread(target=self._connect, name="proxima-connect", daemon=True).start()
        return None

    def connected(self, wait: bool = False) -> bool:
        """True when a client is connected; see connection()."""
        return self.connection(wait) is not None

    def _connect(self) -> None:
        """One connection attempt. Whatever it fails on, the link tries again after
        retry_seconds: an unreachable daemon (proxima.Error), and equally a token file caught
        empty or half-written by a rotation, a TLS file mid-renewal or a profile the daemon
        refuses (ValueError). An attempt never stays pending: before, a ValueError escaped and
        left the link disconnected for the life of the process."""
        o, s = self.options, self.spec
        try:
            client = proxima.Client(o.target, namespace=o.namespace, token=o.token,
                                    token_file="" if o.token else o.token_file,
                                    tls_ca=o.tls_ca, tls_cert=o.tls_cert, tls_key=o.tls_key,
                                    connect_timeout=o.connect_timeout,
                                    call_timeout=o.call_timeout, transport=o.transport,
                                    host_staging=o.host_staging)
            profile = client.register_profile(s.num_layers, s.num_kv_heads, s.head_dim,
                                              s.tokens_per_block, s.dtype, s.fingerprint,
                                              s.rope_theta)
            staging = self._alloc_staging(client)
            with self._lock:
                for address, length in self._buffers.items():
                    with contextlib.suppress(ValueError):  # inside another: covered by it
                        client.register_buffer(address, length)
                self._conn = Connection(client, profile, staging)
                self._profile = profile
                self._recovered()
        except (proxima.Error, ValueError) as e:
            with self._lock:
                self._failed(e)
        finally:
            with self._lock:
                self._connecting = False

    def _alloc_staging(self, client: proxima.Client) -> Optional[proxima.Buffer]:
        nbytes = self._staging_bytes
        if not nbytes or client.transport != "ucx":
            return None
        try:
            return client.alloc_buffer(nbytes)
        except (proxima.Error, ValueError) as e:
            if not self._staging_failed:
                self._staging_failed = True
                logger.warning("proxima: alloc_buffer(%d) failed (%s); staging uses memory "
                               "registered with register_buffer instead (logged once)",
                               nbytes, e)
            return None

    def _failed(self, error: Exception) -> None:
        if not self._down:
            self._down = True
            logger.warning("proxima: proximad at %s failed (%s); lookups miss, loads fail and "
                           "saves are dropped until it answers again (logged once)",
                           self.options.target, error)

    def _recovered(self) -> None:
        if self._down:
            self._down = False
            logger.warning("proxima: proximad at %s answers again; while it was down: %s",
                           self.options.target, self.counters)

    def _call(self, fn, *args, via=_CURRENT):
        """fn(client, profile, *args) through `via` (a Connection; by default the current one;
        None: no connection, the call fails); None when the daemon failed (logged once). When
        it is unreachable the client is dropped: the next calls reconnect in the background (a
        fresh channel, not gRPC's reconnect backoff of up to two minutes)."""
        conn = self.connection() if via is _CURRENT else via
        if conn is None:
            return None
        try:
            result = fn(conn.client, conn.profile, *args)
        except proxima.Unavailable as e:
            with self._lock:
                self._failed(e)
                if self._conn is conn:
                    self._conn = None
                    self._next_try = time.monotonic() + self.options.retry_seconds
            return None
        except proxima.Error as e:
            with self._lock:
                self._failed(e)
            return None
        if self._down:
            with self._lock:
                self._recovered()
        return result

    def lookup(self, keys: List[bytes]) -> int:
        if not keys:
            return 0
        n = self._call(proxima.Client.lookup, keys)
        if n is None:
            self.counters.lookups_failed += 1
            return 0
        self.counters.hit_blocks += n
        return n

    def exists(self, keys: List[bytes]) -> List[bool]:
        found = self._call(proxima.Client.exists, keys)
        if found is None:
            self.counters.lookups_failed += 1
            return [False] * len(keys)
        return found

    def get(self, keys: List[bytes], blocks: Blocks, via=_CURRENT) -> List[bool]:
        """via: the Connection whose memory (its staging) the blocks are in; None: there is
        none, the load fails."""
        if not keys:
            return []
        found = self._call(proxima.Client.get, keys, blocks, via=via)
        if found is None:
            self.counters.blocks_load_failed += len(keys)
            return [False] * len(keys)
        self.counters.blocks_loaded += sum(found)
        return found

    def put(self, keys: List[bytes], blocks: Blocks, via=_CURRENT) -> List[bool]:
        """Per block: stored now or already present (False: dropped). via: as for get."""
        if not keys:
            return []
        outcomes = self._call(proxima.Client.put, keys, blocks, via=via)
        if outcomes is None:
            self.counters.blocks_save_dropped += len(keys)
            return [False] * len(keys)
        ok = [o != "no_space" for o in outcomes]
        self.counters.blocks_saved += sum(ok)
        self.counters.blocks_save_dropped += len(ok) - sum(ok)
        return ok
