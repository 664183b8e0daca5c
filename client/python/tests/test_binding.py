"""The binding against a real proximad: byte-exact round trips through scatter/gather lists,
lookups, presence, deletes, stats, the asynchronous calls, bad input, and a stopped daemon."""
import json
import os
import signal
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
        d.signal(signal.SIGCONT)
        assert h.wait(timeout=10) == 0  # answered once the daemon runs again
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
