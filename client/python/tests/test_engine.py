"""proxima.engine.Link, what the vLLM connector and the SGLang backend stand on: a dead or
killed daemon turns into misses, failed loads and dropped saves, counted and logged once; the
link comes back by itself; multi-piece pages round-trip byte-exact; staging memory is allocated
by each client that moves bytes over UCX (a new one after a restart), none over inline."""
import logging
import time

import numpy as np
import pytest

from conftest import Daemon

RKEYS = "proxima_ucx_rkeys_unpacked_total"
from proxima.engine import Link, LinkOptions, ProfileSpec, model_rope_theta, usable_rope_theta
from proxima.keys import chain_keys, scope_bytes

SPEC = ProfileSpec(num_layers=3, num_kv_heads=2, head_dim=8, tokens_per_block=4, dtype="fp16",
                   fingerprint="engine-test")
PIECE = SPEC.tokens_per_block * SPEC.num_kv_heads * SPEC.head_dim * 2  # one layer's K or V
BLOCK = 2 * SPEC.num_layers * PIECE


def layer_first_pool(pages, seed):
    """A host pool laid out [kv][layer][page][bytes]: a page is 2 * layers pieces."""
    return np.random.default_rng(seed).integers(0, 256, (2, SPEC.num_layers, pages, PIECE),
                                                dtype=np.uint8)


def page_pieces(pool, page):
    base, (kv_stride, layer_stride, page_stride, _) = pool.ctypes.data, pool.strides
    return [(base + kv * kv_stride + layer * layer_stride + page * page_stride, PIECE)
            for layer in range(SPEC.num_layers) for kv in range(2)]


def options(target, **kw):
    return LinkOptions(target=target, connect_timeout=0.5, call_timeout=2.0, **kw)


def staged(conn, n):
    """The first n blocks of a connection's staging buffer: a numpy view and one piece each."""
    arr = np.frombuffer(conn.staging, np.uint8)[:n * BLOCK].reshape(n, BLOCK)
    return arr, [[(conn.staging.address + i * BLOCK, BLOCK)] for i in range(n)]


def test_pages_of_many_pieces_round_trip(daemon):
    link = Link(options(daemon.target), SPEC)
    assert link.connected(wait=True)
    src, dst = layer_first_pool(5, 1), np.zeros((2, SPEC.num_layers, 5, PIECE), np.uint8)
    for a in (src, dst):
        link.register_buffer(a.ctypes.data, a.nbytes)
    keys = chain_keys(scope_bytes("engine", "pages"), ["p0", "p1", "p2", "p3", "p4"])
    assert link.put(keys[:4], [page_pieces(src, p) for p in range(4)]) == [True] * 4
    assert link.lookup(keys) == 4
    assert link.get(keys, [page_pieces(dst, p) for p in range(5)]) == [True] * 4 + [False]
    assert np.array_equal(src[:, :, :4], dst[:, :, :4]) and not dst[:, :, 4].any()
    assert link.counters.blocks_saved == 4 and link.counters.blocks_loaded == 4
    assert link.profile.block_bytes == BLOCK


def test_dead_daemon_misses_fails_drops_and_logs_once(caplog, tmp_path):
    link = Link(options(f"unix:{tmp_path}/none.sock", retry_seconds=0), SPEC)
    assert not link.connected(wait=True)
    pool = layer_first_pool(2, 2)
    link.register_buffer(pool.ctypes.data, pool.nbytes)
    keys = chain_keys(b"dead", ["a", "b"])
    with caplog.at_level(logging.WARNING, logger="proxima"):
        for _ in range(5):
            assert link.lookup(keys) == 0
            assert link.get(keys, [page_pieces(pool, p) for p in range(2)]) == [False, False]
            assert link.put(keys, [page_pieces(pool, p) for p in range(2)]) == [False, False]
    c = link.counters
    assert (c.lookups_failed, c.blocks_load_failed, c.blocks_save_dropped) == (5, 10, 10)
    warnings = [r for r in caplog.records if r.name == "proxima"]
    assert len(warnings) == 1 and "logged once" in warnings[0].getMessage()


def test_link_survives_a_killed_daemon_and_comes_back(caplog):
    d = Daemon(sets=["server.metrics_listen=127.0.0.1:0"])
    try:
        link = Link(options(d.target, retry_seconds=0), SPEC)
        link.set_staging(3 * BLOCK)
        first = link.connection(wait=True)
        assert first is not None and first.client.transport == "ucx", first
        assert first.staging is not None and first.staging.length == 3 * BLOCK
        pool = layer_first_pool(3, 3)
        link.register_buffer(pool.ctypes.data, pool.nbytes)
        keys = chain_keys(b"restart", ["a", "b", "c"])
        pages = [page_pieces(pool, p) for p in range(3)]
        assert link.put(keys[:1], pages[:1]) == [True]
        d.kill()
        with caplog.at_level(logging.WARNING, logger="proxima"):
            assert link.lookup(keys) == 0
            assert link.connection() is None  # no client, no staging
            assert link.put(keys[1:], pages[1:]) == [False, False]
            assert link.get(keys, pages) == [False] * 3
            assert link.get(keys, [], via=None) == [False] * 3  # a caller with no connection
            d.start()  # a fresh daemon on the same socket, empty
            deadline = time.monotonic() + 10  # the link reconnects in the background
            while link.put(keys, pages) != [True] * 3:
                assert time.monotonic() < deadline, "the link did not come back within 10 s"
                time.sleep(0.02)
            assert link.lookup(keys) == 3
        messages = [r.getMessage() for r in caplog.records if r.name == "proxima"]
        assert len(messages) == 2, messages
        assert "logged once" in messages[0] and "answers again" in messages[1]
        assert link.counters.blocks_save_dropped >= 2
        assert link.counters.blocks_load_failed == 6

        # The new client allocated staging memory of its own; the old client's is not its.
        second = link.connection()
        assert second.client is not first.client and second.staging is not first.staging
        assert not first.staging.closed  # still the old client's, for whoever holds it
        _, old_pieces = staged(first, 3)
        with pytest.raises(ValueError, match="inside a registered buffer"):
            link.get(keys, old_pieces, via=second)
        arr, pieces = staged(second, 3)
        before = d.metric(RKEYS)
        assert link.get(keys, pieces, via=second) == [True] * 3
        for p in range(3):  # the pages, as laid out in the pool, back to back in staging
            assert arr[p].tobytes() == b"".join(pool[kv, layer, p].tobytes()
                                                for layer in range(SPEC.num_layers)
                                                for kv in range(2))
        keys2 = chain_keys(b"restart-staged", ["a", "b", "c"])
        assert link.put(keys2, pieces, via=second) == [True] * 3
        arr[:] = 0
        assert link.get(keys2, pieces, via=second) == [True] * 3
        assert link.get(keys[:1], pieces[:1], via=second) == [True]
        assert d.metric(RKEYS) - before == 1  # 4 calls, one registration: the staging buffer
    finally:
        d.kill()


def test_a_connect_that_fails_on_a_bad_token_file_is_tried_again(tmp_path, caplog):
    # A token file caught empty by a rotation is a ValueError, not proxima.Error: the link logs
    # it once, as any failure, and connects once the file holds the token again.
    token = "engine-test-token-0123456789abcdef"
    valid = tmp_path / "valid.token"
    valid.write_text(token + "\n")
    d = Daemon(config_text="namespaces:\n  - name: team\n    tokens:\n"
                           f"      - {{name: worker, file: {valid}, access: read_write}}\n")
    try:
        path = tmp_path / "worker.token"
        path.write_text("")
        link = Link(options(d.target, namespace="team", token_file=str(path), retry_seconds=0),
                    SPEC)
        with caplog.at_level(logging.WARNING, logger="proxima"):
            assert link.connection(wait=True) is None
            assert link.connection() is None  # tried again in the background: fails the same
            path.write_text(token + "\n")
            deadline = time.monotonic() + 10
            while link.connection() is None:
                assert time.monotonic() < deadline, "the link did not connect within 10 s"
                time.sleep(0.02)
        messages = [r.getMessage() for r in caplog.records if r.name == "proxima"]
        assert "the token is 0 bytes" in messages[0], messages
        assert "answers again" in messages[-1], messages
        pool = layer_first_pool(1, 4)
        link.register_buffer(pool.ctypes.data, pool.nbytes)
        keys = chain_keys(b"token-file", ["a"])
        assert link.put(keys, [page_pieces(pool, 0)]) == [True]
        assert link.lookup(keys) == 1
    finally:
        d.kill()


def test_staging_memory_follows_the_transport(daemon):
    # Asked after connecting: allocated at once, by the client connected.
    link = Link(options(daemon.target), SPEC)
    assert link.connection(wait=True).staging is None  # none asked
    link.set_staging(2 * BLOCK)
    conn = link.connection()
    assert conn.client.transport == "ucx" and conn.staging.length == 2 * BLOCK
    assert conn.client.registered_buffers == 1
    # Inline: nothing to allocate, the caller stages in memory of its own.
    inline = Link(options(daemon.target, transport="inline"), SPEC)
    inline.set_staging(2 * BLOCK)
    conn = inline.connection(wait=True)
    assert conn.client.transport == "inline" and conn.staging is None


def test_options_from_config_and_environment(monkeypatch, tmp_path):
    token = tmp_path / "token"
    token.write_text("tok-123\n")
    monkeypatch.setenv("PROXIMA_TARGET", "unix:/env.sock")
    monkeypatch.setenv("PROXIMA_CALL_TIMEOUT", "7.5")
    o = LinkOptions.from_config({"namespace": "team", "token_file": str(token)})
    assert (o.target, o.namespace, o.token, o.token_file, o.call_timeout) == (
        "unix:/env.sock", "team", "", str(token), 7.5)
    monkeypatch.setenv("PROXIMA_TOKEN_FILE", "/run/secrets/proxima-token")
    assert LinkOptions.from_config({}).token_file == "/run/secrets/proxima-token"
    assert LinkOptions.from_config({"target": "127.0.0.1:1"}).target == "127.0.0.1:1"


def test_model_rope_theta_reads_both_config_forms_and_drops_unusable_values():
    from types import SimpleNamespace as Config
    assert model_rope_theta(Config(rope_theta=500000.0)) == 500000.0
    assert model_rope_theta(Config(rope_theta=None, rope_parameters={"rope_theta": 1e6})) == 1e6
    assert model_rope_theta(Config(rope_parameters={"rope_type": "default"})) == 0.0
    assert model_rope_theta(Config()) == 0.0  # no RoPE (or an unknown config): unknown
    for bad in (float("nan"), 0.5, -1.0, 1e13, "high", None):
        assert usable_rope_theta(bad) == 0.0
    assert usable_rope_theta("10000") == 10000.0


def test_model_rope_theta_is_unknown_for_a_rope_k4v3_does_not_turn_keys_by():
    from types import SimpleNamespace as Config
    # Full rotate-half RoPE, plain or with a scaling that keeps the fast pairs: the base.
    assert model_rope_theta(Config(model_type="llama", rope_theta=5e5, rope_scaling={
        "rope_type": "llama3", "factor": 8.0})) == 5e5
    assert model_rope_theta(Config(model_type="qwen2", rope_theta=1e6,
                                   rope_scaling={"type": "yarn", "factor": 4.0})) == 1e6
    assert model_rope_theta(Config(model_type="phi3", rope_theta=1e4,
                                   partial_rotary_factor=1.0)) == 1e4
    assert model_rope_theta(Config(rope_theta=1e4, rotary_dim=128, head_dim=128)) == 1e4
    # Partial RoPE, in each way configs say it (Phi-2, Phi-4-mini, GPT-NeoX, GPT-J, and
    # transformers' rope_parameters).
    assert model_rope_theta(Config(model_type="phi", rope_theta=1e4,
                                   partial_rotary_factor=0.4)) == 0.0
    assert model_rope_theta(Config(rope_theta=1e4, partial_rotary_factor=0.75)) == 0.0
    assert model_rope_theta(Config(model_type="gpt_neox", rotary_emb_base=1e4, rope_theta=1e4,
                                   rotary_pct=0.25)) == 0.0
    assert model_rope_theta(Config(rope_theta=1e4, rotary_dim=64, hidden_size=4096,
                                   num_attention_heads=16)) == 0.0
    assert model_rope_theta(Config(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                    "partial_rotary_factor": 0.5})) == 0.0
    # Interleaved pairs (GPT-J style), even over every channel.
    assert model_rope_theta(Config(model_type="cohere", rope_theta=8e6)) == 0.0
    # Scalings that move the fast pairs too.
    for kind in ("linear", "dynamic", "longrope", "su"):
        assert model_rope_theta(Config(rope_theta=1e4, rope_scaling={"type": kind,
                                                                     "factor": 2.0})) == 0.0
        assert model_rope_theta(Config(rope_parameters={"rope_type": kind,
                                                        "rope_theta": 1e4})) == 0.0
    assert model_rope_theta(Config(rope_theta=1e4, partial_rotary_factor="most")) == 0.0
