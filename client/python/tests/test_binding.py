"""The binding against a real proximad: byte-exact round trips through scatter/gather lists,
lookups, presence, deletes, stats, the asynchronous calls, bad input, a stopped daemon, buffers
registered with UCX once, and buffers from alloc_buffer (over UCX on TCP and shared memory, and
inline)."""
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import proxima
from conftest import Daemon

LAYERS, HEADS, DIM, TOKENS = 2, 2, 8, 4
BLOCK_BYTES = 2 * LAYERS * TOKENS * HEADS * DIM * 2  # bf16


def keys_for(tag, n):
    scope = proxima.keys.scope_bytes("test", tag)
    return proxima.chain_keys(scope, range(n))


def random_blocks(n, seed):
    return np.random.default_rng(seed).integers(0, 256, size=(n, BLOCK_BYTES), dtype=np.uint8)


def whole(arr):
    """One piece per block: rows of a C-contiguous uint8 array."""
    base = arr.ctypes.data
    return [[(base + i * arr.shape[1], arr.shape[1])] for i in range(arr.shape[0])]


def split(arr, pieces):
    """Each block as `pieces` equal pieces, listed out of address order: the second half of a
    block's pieces first lives in one buffer, the first half in another (reversed)."""
    n, size = arr.shape
    step = size // pieces
    base = arr.ctypes.data
    return [[(base + b * size + p * step, step) for p in range(pieces)] for b in range(n)]


@pytest.fixture
def profile(client):
    return client.register_profile(LAYERS, HEADS, DIM, TOKENS, "bf16", fingerprint="binding-test")


def test_profile_block_size(client, profile):
    assert profile.block_bytes == BLOCK_BYTES
    again = client.register_profile(LAYERS, HEADS, DIM, TOKENS, "bfloat16", "binding-test")
    assert again.id == profile.id


def test_profile_rope_theta_is_part_of_its_identity_and_checked(client, profile):
    # The model's RoPE base (for k4v3 levels) names another profile; 0 is the plain one.
    llama = client.register_profile(LAYERS, HEADS, DIM, TOKENS, "bf16", "binding-test",
                                    rope_theta=500000.0)
    assert llama.id != profile.id and llama.block_bytes == profile.block_bytes
    assert client.register_profile(LAYERS, HEADS, DIM, TOKENS, "bf16", "binding-test",
                                   rope_theta=0.0).id == profile.id
    for bad in (float("nan"), 0.5, -10000.0, 1e13, float("inf")):
        with pytest.raises(ValueError, match="profile.rope_theta is .*expected 0"):
            client.register_profile(LAYERS, HEADS, DIM, TOKENS, "bf16", "binding-test",
                                    rope_theta=bad)


def test_put_get_single_piece_byte_exact(client, profile):
    src, dst = random_blocks(6, 1), np.zeros((6, BLOCK_BYTES), np.uint8)
    client.register_buffer(src.ctypes.data, src.nbytes)
    client.register_buffer(dst.ctypes.data, dst.nbytes)
    keys = keys_for("single", 6)
    assert client.put(profile, keys, whole(src)) == ["stored"] * 6
    assert client.put(profile, keys[:2], whole(src[:2])) == ["already_present"] * 2
    assert client.get(profile, keys, whole(dst)) == [True] * 6
    assert np.array_equal(src, dst)
    assert client.unregister_buffer(src.ctypes.data) and client.unregister_buffer(dst.ctypes.data)


def test_put_get_scatter_gather_across_buffers(client, profile):
    # A block made of 8 pieces, 4 in each of two separate buffers (per-layer K/V pieces).
    n, pieces = 3, 8
    half = BLOCK_BYTES // 2
    lo = np.random.default_rng(2).integers(0, 256, size=(n, half), dtype=np.uint8)
    hi = np.random.default_rng(3).integers(0, 256, size=(n, half), dtype=np.uint8)
    for a in (lo, hi):
        client.register_buffer(a.ctypes.data, a.nbytes)
    blocks = [split(lo, pieces // 2)[b] + split(hi, pieces // 2)[b] for b in range(n)]
    keys = keys_for("sg", n)
    assert client.put(profile, keys, blocks) == ["stored"] * n

    # Read back contiguous: block b is lo[b] then hi[b].
    whole_dst = np.zeros((n, BLOCK_BYTES), np.uint8)
    client.register_buffer(whole_dst.ctypes.data, whole_dst.nbytes)
    assert client.get(profile, keys, whole(whole_dst)) == [True] * n
    assert np.array_equal(whole_dst, np.concatenate([lo, hi], axis=1))

    # And scattered into two other buffers, in the same piece order.
    lo2, hi2 = np.zeros_like(lo), np.zeros_like(hi)
    for a in (lo2, hi2):
        client.register_buffer(a.ctypes.data, a.nbytes)
    blocks2 = [split(lo2, pieces // 2)[b] + split(hi2, pieces // 2)[b] for b in range(n)]
    assert client.get(profile, keys, blocks2) == [True] * n
    assert np.array_equal(lo, lo2) and np.array_equal(hi, hi2)


def test_lookup_exists_delete(client, profile):
    src = random_blocks(5, 4)
    client.register_buffer(src.ctypes.data, src.nbytes)
    keys = keys_for("chain", 5)
    client.put(profile, [keys[0], keys[1], keys[3]], [whole(src)[i] for i in (0, 1, 3)])
    assert client.lookup(profile, keys) == 2
    assert client.lookup(profile, keys[3:]) == 1
    assert client.lookup(profile, []) == 0
    assert client.exists(profile, keys) == [True, True, False, True, False]
    assert client.exists(profile, []) == []
    assert client.delete(profile, keys) == 3
    assert client.exists(profile, keys) == [False] * 5
    dst = np.zeros((5, BLOCK_BYTES), np.uint8)
    client.register_buffer(dst.ctypes.data, dst.nbytes)
    assert client.get(profile, keys, whole(dst)) == [False] * 5


def test_stats_count_the_calls(client, profile, daemon):
    before = next(n for n in client.stats()["namespaces"] if n["name"] == "default")
    src = random_blocks(2, 5)
    client.register_buffer(src.ctypes.data, src.nbytes)
    keys = keys_for("stats", 2)
    client.put(profile, keys, whole(src))
    stats = client.stats()
    after = next(n for n in stats["namespaces"] if n["name"] == "default")
    assert int(after["puts"]) == int(before["puts"]) + 2
    assert stats["version"] == client.server_info["version"]
    assert client.server_info["max_batch_blocks"] > 0
    assert client.server_info["max_inflight_bytes_per_client"] > 0


def test_async_calls_complete_out_of_line(client, profile):
    n = 64
    src, dst = random_blocks(n, 6), np.zeros((n, BLOCK_BYTES), np.uint8)
    client.register_buffer(src.ctypes.data, src.nbytes)
    client.register_buffer(dst.ctypes.data, dst.nbytes)
    keys = keys_for("async", n)
    puts = [client.put_async(profile, keys[i:i + 8], whole(src[i:i + 8])) for i in range(0, n, 8)]
    assert [h.wait(timeout=30) for h in puts] == [["stored"] * 8] * 8
    assert all(h.poll() for h in puts)
    assert client.lookup_async(profile, keys).wait(30) == n
    assert client.exists_async(profile, keys[:3] + keys_for("absent", 1)).wait(30) == \
        [True, True, True, False]
    gets = [client.get_async(profile, keys[i:i + 16], whole(dst[i:i + 16]))
            for i in range(0, n, 16)]
    assert all(h.wait(30) == [True] * 16 for h in gets)
    assert np.array_equal(src, dst)


def test_bad_input_is_a_value_error_naming_it(client, profile):
    src = random_blocks(1, 7)
    keys = keys_for("bad", 1)
    with pytest.raises(ValueError, match=r"block 0 piece 0 \(address \d+, length 512\): "
                                         r"expected it inside a registered buffer"):
        client.put(profile, keys, whole(src))
    client.register_buffer(src.ctypes.data, src.nbytes)
    with pytest.raises(ValueError, match="block 0 spans 256 bytes; expected the profile's "
                                         "block size 512"):
        client.put(profile, keys, [[(src.ctypes.data, 256)]])
    with pytest.raises(ValueError, match="piece 0 .*length 513"):
        client.put(profile, keys, [[(src.ctypes.data, 513)]])
    with pytest.raises(ValueError, match="key 0 is 5 bytes; expected 32"):
        client.lookup(profile, [b"short"])
    with pytest.raises(ValueError, match="2 blocks for 1 keys"):
        client.get(profile, keys, whole(src) * 2)
    with pytest.raises(ValueError, match="overlaps a buffer already registered"):
        client.register_buffer(src.ctypes.data + 8, 8)
    with pytest.raises(ValueError, match="dtype 'int3'"):
        client.register_profile(1, 1, 8, 4, "int3")
    assert not client.unregister_buffer(12345)


def test_gil_released_and_unavailable_when_daemon_stops():
    d = Daemon()
    try:
        c = proxima.Client(d.target, call_timeout=1.5)
        profile = c.register_profile(LAYERS, HEADS, DIM, TOKENS, "bf16", "gil-test")
        patient = proxima.Client(d.target, call_timeout=30)
        assert patient.register_profile(LAYERS, HEADS, DIM, TOKENS, "bf16", "gil-test").id == \
            profile.id
        d.stop()  # the daemon answers nothing until SIGCONT
        errors, ticks = [], 0

        def stuck_call():
            try:
                errors.append(f"answered {c.lookup(profile, keys_for('gil', 4))}")
            except Exception as e:  # noqa: BLE001 (the assertion below names it)
                errors.append(e)

        t = threading.Thread(target=stuck_call)
        t.start()
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:  # runs only if the call released the GIL
            ticks += 1
        t.join(10)
        assert ticks > 1000
        assert len(errors) == 1 and isinstance(errors[0], proxima.Unavailable), errors
        assert "DEADLINE_EXCEEDED" in str(errors[0])
        # An asynchronous call waits out the stop (a client with a long deadline).
        h = patient.lookup_async(profile, keys_for("gil", 4))
        with pytest.raises(TimeoutError):
            h.wait(timeout=0.1)
        with pytest.raises(ValueError, match="nan"):
            h.wait(timeout=float("nan"))
        # A wait without a limit, however it is written, lasts until the answer (an infinite
        # one overflowed and raised TimeoutError at once).
        threading.Timer(0.3, d.signal, (signal.SIGCONT,)).start()
        assert h.wait(timeout=float("inf")) == 0  # answered once the daemon runs again
        assert h.wait(timeout=1e300) == 0
    finally:
        d.kill()


def test_dead_daemon_is_unavailable_not_a_hang():
    start = time.monotonic()
    with pytest.raises(proxima.Unavailable, match="cannot reach proximad"):
        proxima.Client("unix:/nonexistent/proximad.sock", connect_timeout=0.5)
    assert time.monotonic() - start < 5


def test_killed_daemon_calls_fail_with_unavailable():
    d = Daemon()
    c = proxima.Client(d.target, call_timeout=2)
    profile = c.register_profile(LAYERS, HEADS, DIM, TOKENS, "bf16", "kill-test")
    d.kill()
    with pytest.raises(proxima.Unavailable):
        c.lookup(profile, keys_for("kill", 2))
    with pytest.raises(proxima.Unavailable):
        c.lookup_async(profile, keys_for("kill", 2)).wait(10)


def test_token_namespace():
    token = "s3cret-token-for-python-test-0123456789"
    d = None
    path = os.path.join("/tmp", f"proxima-py-token-{os.getpid()}")
    with open(path, "w") as f:
        f.write(token + "\n")
    try:
        d = Daemon(config_text=f"namespaces:\n  - name: team\n    tokens:\n"
                               f"      - {{name: worker, file: {path}, access: read_write}}\n")
        ok = proxima.Client(d.target, namespace="team", token=token)
        assert ok.register_profile(1, 1, 8, 4, "fp16").block_bytes == 2 * 4 * 8 * 2
        anonymous = proxima.Client(d.target, namespace="team")
        with pytest.raises(proxima.Error, match="UNAUTHENTICATED"):
            anonymous.register_profile(1, 1, 8, 4, "fp16")
        # The token from a file (read again while the client runs: docs/security.md).
        from_file = proxima.Client(d.target, namespace="team", token_file=path)
        assert from_file.register_profile(1, 1, 8, 4, "fp16").block_bytes == 2 * 4 * 8 * 2
        with pytest.raises(ValueError, match="token and token_file are both set"):
            proxima.Client(d.target, namespace="team", token=token, token_file=path)
        with pytest.raises(proxima.Error, match="token_file.*/nonexistent/token"):
            proxima.Client(d.target, namespace="team", token_file="/nonexistent/token")
    finally:
        os.remove(path)
        if d is not None:
            d.kill()


def test_tls_options_reach_the_client():
    with pytest.raises(proxima.Error, match="/nonexistent/ca.pem"):
        proxima.Client("127.0.0.1:1", tls_ca="/nonexistent/ca.pem", connect_timeout=0.5)


def test_codec_is_the_eval_binding():
    import proxima.codec
    assert "star" in proxima.codec.codec_names()
    block = np.arange(2 * 2 * 4 * 2 * 8, dtype=np.uint16).reshape(2, 2, 4, 2, 8)
    enc = proxima.codec.encode_block(block, "lossless", True)
    assert np.array_equal(proxima.codec.decode_block(enc, list(block.shape)), block)


def test_put_hints_reach_the_tierer():
    """positions / high_priority / importance reach the daemon: in a compressing namespace the
    tierer passes over the high-priority blocks (raw, byte-exact) though they are the coldest,
    and compresses the normal ones (lossy int8) instead."""
    d = Daemon(sets=["tiers.host.capacity_bytes=4MiB",
                     "namespaces=[{name: default, compression: {enabled: true, levels: [int8], "
                     "trigger: {memory_pressure_threshold: 0.7}, priority: {high_max_level: 0}}}]"])
    try:
        c = proxima.Client(d.target)
        p = c.register_profile(4, 8, 128, 16, "bf16", fingerprint="hints-test")  # 256 KiB blocks
        blocks = np.random.default_rng(11).integers(0, 256, size=(12, p.block_bytes),
                                                    dtype=np.uint8)
        c.register_buffer(blocks.ctypes.data, blocks.nbytes)
        keys = keys_for("hints", 12)
        assert c.put(p, keys[:6], whole(blocks)[:6], high_priority=True) == ["stored"] * 6
        with pytest.raises(ValueError, match="6 keys but 2 positions"):
            c.put(p, keys[6:], whole(blocks)[6:], positions=[0, 1])
        assert c.put(p, keys[6:], whole(blocks)[6:], positions=list(range(6)),
                     importance=[0.0] * 6) == ["stored"] * 6
        for _ in range(200):  # the tierer gets under 70% of 4 MiB by encoding two blocks
            levels = json_levels(c)
            if sum(n for level, n in levels.items() if level > 0) >= 2:
                break
            time.sleep(0.05)
        out = np.zeros_like(blocks)
        c.register_buffer(out.ctypes.data, out.nbytes)
        assert c.get(p, keys, whole(out)) == [True] * 12
        for i in range(6):
            assert np.array_equal(out[i], blocks[i]), f"high-priority block {i} was compressed"
        assert not np.array_equal(out[6], blocks[6]), "the coldest normal block stayed raw"
    finally:
        d.kill()


def json_levels(client):
    """Blocks per compression level of the host tier, from the daemon's stats."""
    stats = json.loads(client.stats_json())
    return {int(l.get("level", 0)): int(l.get("blocks", 0))
            for l in stats["tiers"][0].get("levels", [])}


RKEYS = "proxima_ucx_rkeys_unpacked_total"


@pytest.fixture
def ucx_daemon(request, monkeypatch):
    """A proximad with metrics, and this process, on the UCX transports request.param names
    (UCX_TLS for both, as tests/integration/ucx_test.cc does); None: UCX's own choice."""
    if request.param is not None:
        monkeypatch.setenv("UCX_TLS", request.param)
        monkeypatch.setenv("UCX_WARN_UNUSED_ENV_VARS", "n")
    d = Daemon(sets=["server.metrics_listen=127.0.0.1:0"])
    yield d
    d.kill()


@pytest.mark.parametrize("ucx_daemon", ["tcp"], indirect=True)
def test_a_session_replaced_after_a_stalled_put_is_closed_on_the_daemon(ucx_daemon):
    """A put of 1 MiB blocks (rendezvous messages) to a daemon that stalls (SIGSTOP) past the
    call's deadline fails, and its sends' endpoint is closed by force; the next put finds the
    endpoint dead and opens a new session. The old one, which the daemon still held, is closed
    first: before, each stall left one more session open on the daemon (1, 2, 3, 4) until the
    client went, toward ucx.max_sessions, which every client of the node shares."""
    d = ucx_daemon
    c = proxima.Client(f"127.0.0.1:{d.tcp_port}", transport="ucx", call_timeout=1.0)
    p = c.register_profile(4, 8, 128, 64, "bf16")
    assert p.block_bytes == 1 << 20 and c.transport == "ucx", c.transport_detail
    buf = np.random.default_rng(7).integers(0, 256, (4, p.block_bytes), dtype=np.uint8)
    c.register_buffer(buf.ctypes.data, buf.nbytes)
    blocks = [[(buf.ctypes.data + i * p.block_bytes, p.block_bytes)] for i in range(4)]
    assert c.put(p, keys_for("stall-0", 4), blocks) == ["stored"] * 4
    assert d.metric("proxima_ucx_sessions") == 1
    for stall in range(1, 4):
        d.signal(signal.SIGSTOP)
        try:
            with pytest.raises(proxima.Unavailable, match="DEADLINE_EXCEEDED"):
                c.put(p, keys_for(f"stall-{stall}", 4), blocks)
        finally:
            d.signal(signal.SIGCONT)
        assert c.put(p, keys_for(f"stall-{stall}", 4), blocks) == ["stored"] * 4
        deadline = time.monotonic() + 5
        while d.metric("proxima_ucx_sessions") != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert d.metric("proxima_ucx_sessions") == 1, f"after stall {stall}"
    got = np.zeros_like(buf)
    c.register_buffer(got.ctypes.data, got.nbytes)
    out = [[(got.ctypes.data + i * p.block_bytes, p.block_bytes)] for i in range(4)]
    assert c.get(p, keys_for("stall-3", 4), out) == [True] * 4
    assert np.array_equal(got, buf)


@pytest.mark.parametrize("ucx_daemon", [None], indirect=True)
def test_registered_buffers_are_registered_with_ucx_once(ucx_daemon):
    """Every call on a registered buffer names the same UCX registration, so the daemon unpacks
    one rkey per buffer, not one per call; unregistering and registering again makes a new one."""
    c = proxima.Client(ucx_daemon.target, transport="ucx")
    assert c.transport == "ucx", c.transport_detail
    p = c.register_profile(LAYERS, HEADS, DIM, TOKENS, "bf16", fingerprint="ucx-once")
    n = 16
    src, dst = random_blocks(n, 21), np.zeros((n, BLOCK_BYTES), np.uint8)
    c.register_buffer(src.ctypes.data, src.nbytes)
    c.register_buffer(dst.ctypes.data, dst.nbytes)
    keys = keys_for("ucx-once", n)
    # Puts name the source buffer only over shared memory; elsewhere (UCX's default transports
    # run this session over tcp) their bytes go as UCX messages and name no buffer.
    named = 2 if " over " in c.transport_detail else 1
    before = ucx_daemon.metric(RKEYS)
    for i in range(n):  # one call per block: 2n calls on two buffers
        assert c.put(p, keys[i:i + 1], whole(src[i:i + 1])) == ["stored"]
        assert c.get(p, keys[i:i + 1], whole(dst[i:i + 1])) == [True]
    assert np.array_equal(src, dst)
    assert ucx_daemon.metric(RKEYS) - before == named

    # Register/unregister cycles on one buffer: each registration is new to the daemon, and
    # every cycle moves the bytes exactly.
    cycles = 5
    for cycle in range(cycles):
        assert c.unregister_buffer(dst.ctypes.data)
        with pytest.raises(ValueError, match="expected it inside a registered buffer"):
            c.get(p, keys[:1], whole(dst[:1]))
        c.register_buffer(dst.ctypes.data, dst.nbytes)
        dst[:] = 0
        assert c.get(p, keys, whole(dst)) == [True] * n
        assert c.get(p, keys, whole(dst)) == [True] * n
        assert np.array_equal(src, dst), f"cycle {cycle}"
    assert ucx_daemon.metric(RKEYS) - before == named + cycles
    assert c.registered_buffers == 2


@pytest.mark.parametrize("ucx_daemon", ["tcp", "posix,self"], indirect=True)
def test_registered_buffers_move_through_host_staging_over_shared_memory(ucx_daemon):
    """host_staging="auto" stages registered (engine-owned) memory only where the daemon reaches
    this process over posix: every call then names the one staging region (one rkey unpacked);
    "never" moves the registered buffer itself. Both byte-exact; a bad value is a ValueError."""
    shm = os.environ.get("UCX_TLS", "").startswith("posix")
    with pytest.raises(ValueError, match="host_staging 'sometimes'"):
        proxima.Client(ucx_daemon.target, transport="ucx", host_staging="sometimes")
    for mode in ("auto", "never"):
        c = proxima.Client(ucx_daemon.target, transport="ucx", host_staging=mode)
        assert c.transport == "ucx", c.transport_detail
        staged = mode == "auto" and shm
        assert ("host staging" in c.transport_detail) == staged, c.transport_detail
        p = c.register_profile(LAYERS, HEADS, DIM, TOKENS, "bf16", fingerprint="hs-" + mode)
        n = 6
        src, dst = random_blocks(n, 31), np.zeros((n, BLOCK_BYTES), np.uint8)
        c.register_buffer(src.ctypes.data, src.nbytes)
        c.register_buffer(dst.ctypes.data, dst.nbytes)
        keys = keys_for("hs-" + mode, n)
        before = ucx_daemon.metric(RKEYS)
        assert c.put(p, keys, whole(src)) == ["stored"] * n
        for _ in range(3):
            dst[:] = 0
            assert c.get(p, keys, whole(dst)) == [True] * n
            assert np.array_equal(src, dst)
        # Staged: the staging region alone; over tcp the destination alone (puts go as
        # messages); over shared memory unstaged, the two registered buffers.
        assert ucx_daemon.metric(RKEYS) - before == (2 if shm and not staged else 1)
        del c


@pytest.mark.parametrize("ucx_daemon", ["tcp", "posix,self"], indirect=True)
def test_alloc_buffer_round_trip_over_ucx(ucx_daemon):
    c = proxima.Client(ucx_daemon.target, transport="ucx")
    assert c.transport == "ucx", c.transport_detail
    p = c.register_profile(LAYERS, HEADS, DIM, TOKENS, "bf16", fingerprint="alloc-ucx")
    n = 8
    buf = c.alloc_buffer(n * BLOCK_BYTES)
    assert buf.length == len(buf) == n * BLOCK_BYTES and not buf.closed
    assert c.registered_buffers == 1
    arr = np.frombuffer(buf, np.uint8).reshape(n, BLOCK_BYTES)  # a view, not a copy
    assert arr.ctypes.data == buf.address and not arr.any()  # zeroed
    src = random_blocks(n, 22)
    arr[:] = src
    keys = keys_for("alloc-ucx", n)
    before = ucx_daemon.metric(RKEYS)
    for i in range(n):
        assert c.put(p, keys[i:i + 1], whole(arr[i:i + 1])) == ["stored"]
    arr[:] = 0
    for _ in range(3):
        assert c.get(p, keys, whole(arr)) == [True] * n
    assert np.array_equal(arr, src)
    # Bytes written through the buffer protocol are the ones the daemon stored.
    assert bytes(memoryview(buf)[:BLOCK_BYTES]) == src[0].tobytes()
    assert ucx_daemon.metric(RKEYS) - before == 1  # n + 3 calls, one registration

    address = buf.address
    del arr
    buf.close()
    assert buf.closed and c.registered_buffers == 0
    with pytest.raises(ValueError, match="is closed"):
        buf.address
    with pytest.raises(ValueError, match="is closed"):
        memoryview(buf)
    with pytest.raises(ValueError, match="expected it inside a registered buffer"):
        c.get(p, keys[:1], [[(address, BLOCK_BYTES)]])
    buf.close()  # idempotent


def test_alloc_buffer_over_inline(daemon):
    c = proxima.Client(daemon.target, transport="inline")
    assert c.transport == "inline"
    p = c.register_profile(LAYERS, HEADS, DIM, TOKENS, "bf16", fingerprint="alloc-inline")
    n = 4
    with c.alloc_buffer(2 * n * BLOCK_BYTES) as buf:
        arr = np.frombuffer(buf, np.uint8).reshape(2 * n, BLOCK_BYTES)
        src, dst = arr[:n], arr[n:]
        src[:] = random_blocks(n, 23)
        keys = keys_for("alloc-inline", n)
        assert c.put(p, keys, split(src, 4)) == ["stored"] * n
        assert c.get(p, keys, whole(dst)) == [True] * n
        assert np.array_equal(src, dst)
        del arr, src, dst
    assert buf.closed and c.registered_buffers == 0


def test_buffer_close_is_refused_while_viewed(client):
    buf = client.alloc_buffer(4096)
    assert client.registered_buffers == 1
    view = memoryview(buf)
    arr = np.frombuffer(buf, np.uint8)
    with pytest.raises(BufferError, match="2 view"):
        buf.close()
    view.release()
    with pytest.raises(BufferError, match="1 view"):
        buf.close()
    with pytest.raises(ValueError, match="the memory of an alloc_buffer; close the buffer"):
        client.unregister_buffer(buf.address)
    del arr
    buf.close()
    assert client.registered_buffers == 0
    with pytest.raises(ValueError, match=r"alloc_buffer\(0\): expected a length > 0"):
        client.alloc_buffer(0)
    # More than the machine has: refused at once, nothing allocated (UCX would fill a
    # shared-memory segment until the process is killed).
    with pytest.raises(ValueError, match=r"AllocateMemory of 1125899906842624 bytes: expected "
                                         r"less than this machine's \d+ bytes of memory"):
        client.alloc_buffer(1 << 50)
    dropped = client.alloc_buffer(4096)
    assert client.registered_buffers == 1
    del dropped  # without close(): unregistered when the object goes
    gc.collect()
    assert client.registered_buffers == 0
    with pytest.raises(ValueError, match="not made by Client.alloc_buffer"):
        memoryview(proxima.Buffer.__new__(proxima.Buffer))


@pytest.mark.parametrize("ucx_daemon", [None], indirect=True)
def test_buffer_outlives_its_client(ucx_daemon):
    """A Buffer keeps its client's connection (and UCX session) alive until it is dropped."""
    d = ucx_daemon
    c = proxima.Client(d.target)
    assert c.transport == "ucx", c.transport_detail
    p = c.register_profile(LAYERS, HEADS, DIM, TOKENS, "bf16", fingerprint="outlive")
    buf = c.alloc_buffer(BLOCK_BYTES)
    src = np.frombuffer(buf, np.uint8).reshape(1, BLOCK_BYTES)
    src[:] = random_blocks(1, 24)
    expected = src.copy()
    keys = keys_for("outlive", 1)
    assert c.put(p, keys, whole(src)) == ["stored"]
    c.register_buffer(expected.ctypes.data, expected.nbytes)  # unregistered with the session
    sessions = d.metric("proxima_ucx_sessions")
    del c
    gc.collect()
    assert np.array_equal(src, expected)  # the memory is still there
    assert d.metric("proxima_ucx_sessions") == sessions
    del src
    buf.close()  # the last holder: the client closes its UCX session
    deadline = time.monotonic() + 10
    while d.metric("proxima_ucx_sessions") != sessions - 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert d.metric("proxima_ucx_sessions") == sessions - 1
    other = proxima.Client(d.target)
    out = np.zeros((1, BLOCK_BYTES), np.uint8)
    other.register_buffer(out.ctypes.data, out.nbytes)
    assert other.get(p, keys, whole(out)) == [True] and np.array_equal(out, expected)


def test_buffer_with_torch_frombuffer(client, profile):
    torch = pytest.importorskip("torch")
    buf = client.alloc_buffer(2 * BLOCK_BYTES)
    t = torch.frombuffer(buf, dtype=torch.uint8).view(2, BLOCK_BYTES)
    assert t.data_ptr() == buf.address
    t[0] = torch.arange(BLOCK_BYTES, dtype=torch.int32).remainder(251).to(torch.uint8)
    keys = keys_for("torch-frombuffer", 1)
    assert client.put(profile, keys, [[(buf.address, BLOCK_BYTES)]]) == ["stored"]
    assert client.get(profile, keys, [[(buf.address + BLOCK_BYTES, BLOCK_BYTES)]]) == [True]
    assert torch.equal(t[0], t[1])
    del t
    buf.close()


_EXITS_MID_CALL = r"""
import os, signal, socket, sys, threading, time
import proxima
mode, target, daemon_pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
keys = proxima.chain_keys(proxima.keys.scope_bytes("test", "exit"), range(4))
started = threading.Event()

def work():
    try:
        if mode == "connect":  # to a socket that listens but never answers
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(1)
            started.set()
            proxima.Client(f"127.0.0.1:{s.getsockname()[1]}", connect_timeout=1.0)
        c = proxima.Client(target, call_timeout=0.5)
        p = c.register_profile(2, 2, 8, 4, "bf16", "exit-test")
        os.kill(daemon_pid, signal.SIGSTOP)  # answers nothing: the calls below time out
        if mode == "call":
            started.set()
            c.lookup(p, keys)
        else:  # "close": the client's end waits for its call, then closes its session (2 s)
            c.lookup_async(p, keys)
            started.set()
            del c
    except proxima.Error:
        pass

threading.Thread(target=work, daemon=True).start()
assert started.wait(10)
time.sleep(0.2)

class SlowExit:  # holds the interpreter's exit open until the calls above have returned
    def __del__(self, sleep=time.sleep):
        sleep(4)

sys.modules["_slow_exit"] = SlowExit()
"""


@pytest.mark.parametrize("mode", ["connect", "call", "close"])
def test_python_exiting_while_a_daemon_thread_is_in_a_call_does_not_abort(mode):
    """A daemon thread is inside a call (connecting, a blocking call, a client's end waiting for
    its call in flight) when the main thread exits. The call returns while the interpreter is
    finalizing; Python then stops the thread in PyEval_RestoreThread with pthread_exit, which
    unwinding out of pybind11's gil_scoped_release destructor turned into std::terminate: the
    process aborted after its work was done ("terminate called without an active exception")."""
    d = Daemon()
    try:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [os.path.dirname(os.path.dirname(proxima.__file__)),
             os.environ.get("PYTHONPATH", "")]))
        r = subprocess.run([sys.executable, "-c", _EXITS_MID_CALL, mode, d.target,
                            str(d.proc.pid)], env=env, capture_output=True, timeout=60)
        if r.returncode != 0 or b"terminate" in r.stderr:
            print(r.stderr.decode(errors="replace"))  # whole, where the assertion truncates it
        assert r.returncode == 0 and b"terminate" not in r.stderr, (r.returncode, r.stderr)
    finally:
        d.kill()


_WRITER = r"""
import sys
import numpy as np
import proxima
c = proxima.Client(sys.argv[1], transport="ucx")
assert c.transport == "ucx", c.transport_detail
p = c.register_profile(128, 8, 128, 16, "bf16", fingerprint="stopped-writer")
buf = np.ones(p.block_bytes, np.uint8)
c.register_buffer(buf.ctypes.data, buf.nbytes)
print("ready", flush=True)
i = int(sys.argv[2]) << 32
while True:
    c.put(p, proxima.chain_keys(proxima.keys.scope_bytes("stopped", "writer"), [i]),
          [[(buf.ctypes.data, p.block_bytes)]])
    i += 1
"""


@pytest.mark.parametrize("ucx_daemon", ["tcp"], indirect=True)
def test_writers_stopped_mid_transfer_do_not_hold_up_other_calls(ucx_daemon):
    """Three processes putting 8 MiB blocks over UCX on tcp are stopped (SIGSTOP) mid-transfer:
    the daemon's pull from each then waits for the stopped process until the call's deadline.
    Another client must still connect and be answered at once (before the daemon ran UCX
    transfers on threads of its own, the waits held gRPC's few handler threads and a new client
    could not connect within 5 s)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(proxima.__file__)), os.environ.get("PYTHONPATH", "")]))
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, f"127.0.0.1:{ucx_daemon.tcp_port}",
                                 str(k)], env=env, stdout=subprocess.PIPE)
               for k in range(3)]
    try:
        for w in writers:
            assert w.stdout.readline().strip() == b"ready"
        time.sleep(1.0)
        for w in writers:
            w.send_signal(signal.SIGSTOP)
        time.sleep(0.3)
        start = time.monotonic()
        c = proxima.Client(ucx_daemon.target, transport="inline", connect_timeout=10.0)
        p = c.register_profile(LAYERS, HEADS, DIM, TOKENS, "bf16", fingerprint="not-stopped")
        assert c.lookup(p, keys_for("not-stopped", 4)) == 0
        took = time.monotonic() - start
        assert ucx_daemon.metric('proxima_transfer_bytes_total{transport="ucx",direction="in"}') > 0
        assert took < 2.0, f"a call took {took:.1f} s while UCX writers were stopped"
    finally:
        for w in writers:
            w.kill()
            w.wait(10)
