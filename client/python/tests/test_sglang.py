"""proxima.sglang against real SGLang (installed by scripts/python-engines.sh; skipped, with the
reason, where sglang is absent): the backend made by SGLang's own StorageBackendFactory through
`--hicache-storage-backend dynamic`, a real MHA host pool on the CPU in both layouts, driven with
the calls SGLang's cache controller makes, checked byte for byte."""
import pytest
from conftest import Daemon

torch = pytest.importorskip("torch", reason="torch is installed by scripts/python-engines.sh")
pytest.importorskip("sglang", reason="sglang is installed by scripts/python-engines.sh")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

PAGE, LAYERS, HEADS, DIM = 4, 3, 2, 8


def host_pool(layout, page=PAGE):
    size = max(64, 2 * page)
    device = MHATokenToKVPool(size=size, page_size=page, dtype=torch.bfloat16, head_num=HEADS,
                              head_dim=DIM, layer_num=LAYERS, device="cpu",
                              enable_memory_saver=False, enable_alt_stream=False)
    pool = MHATokenToKVPoolHost(device._mha_buffer_info(), host_to_device_ratio=2.0,
                                host_size=0, page_size=page, layout=layout, pin_memory=False,
                                device="cpu", device_capacity_tokens=size, start_layer=0,
                                end_layer=LAYERS)
    torch.manual_seed(0)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).to(pool.kv_buffer.dtype))
    return pool


def backend(target, pool, tp_rank=0, model="test/model", **link):
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name=model,
        extra_config={"backend_name": "proxima", "module_path": "proxima.sglang",
                      "class_name": "ProximaHiCacheStorage", "target": target,
                      "connect_timeout": 1.0, "call_timeout": 2.0, **link})
    b = StorageBackendFactory.create_backend("dynamic", config, pool)
    b.register_mem_pool_host(pool)  # what the cache controller does next
    return b


def page_bytes(pool, page):
    """One page's bytes in the order its zero-copy pieces list them."""
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page * PAGE, (page + 1) * PAGE))
    base = pool.kv_buffer.data_ptr()
    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    return b"".join(flat[p - base:p - base + s].numpy().tobytes() for p, s in zip(ptrs, sizes))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_zero_copy_v1_round_trip(daemon, layout):
    src, dst = host_pool(layout), host_pool(layout)
    dst.kv_buffer.zero_()
    b_src, b_dst = backend(daemon.target, src), backend(daemon.target, dst)
    keys = [f"{layout}-page-{i}" for i in range(5)]
    assert b_src.batch_exists(keys) == 0
    assert b_src.batch_set_v1(keys[:4], torch.arange(4 * PAGE, 8 * PAGE)) == [True] * 4
    assert b_dst.batch_exists(keys) == 4
    # Pages 4..8 of src land in pages 10..14 of dst; the fifth key is missing.
    assert b_dst.batch_get_v1(keys, torch.arange(10 * PAGE, 15 * PAGE)) == [True] * 4 + [False]
    for i in range(4):
        assert page_bytes(dst, 10 + i) == page_bytes(src, 4 + i)
    assert page_bytes(dst, 14) == bytes(len(page_bytes(dst, 14)))
    assert b_dst.get_stats()["blocks_loaded"] == 4


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_zero_copy_v1_over_shared_memory_moves_pages_through_host_staging(monkeypatch, layout):
    """The host pool is ordinary memory, which UCX's shared-memory transports cannot map: over
    posix the backend's client copies each page's pieces through UCX-allocated staging memory
    (host_staging "auto"), which the daemon maps; with "never" the daemon reaches into the pool
    itself. Both byte-exact, in both layouts, the pages scattered through the pool."""
    monkeypatch.setenv("UCX_TLS", "posix,self")
    monkeypatch.setenv("UCX_WARN_UNUSED_ENV_VARS", "n")
    d = Daemon(sets=["server.metrics_listen=127.0.0.1:0"])
    try:
        for mode in ("auto", "never"):
            src, dst = host_pool(layout), host_pool(layout)
            dst.kv_buffer.zero_()
            link = {"transport": "ucx", "host_staging": mode}
            b_src = backend(d.target, src, model=f"shm/{mode}", **link)
            b_dst = backend(d.target, dst, model=f"shm/{mode}", **link)
            for b in (b_src, b_dst):
                detail = b.link.connection().client.transport_detail
                assert detail.startswith("ucx") and " over posix" in detail, detail
                assert ("host staging" in detail) == (mode == "auto"), detail
            keys = [f"shm-{mode}-{i}" for i in range(6)]
            # Pages 1, 3, 5, 7, 9, 11 of src (not adjacent), then pages 20..25 of dst.
            src_pages = [1, 3, 5, 7, 9, 11]
            src_idx = torch.cat([torch.arange(q * PAGE, (q + 1) * PAGE) for q in src_pages])
            assert b_src.batch_set_v1(keys, src_idx) == [True] * 6
            assert b_dst.batch_exists(keys) == 6
            assert b_dst.batch_get_v1(keys, torch.arange(20 * PAGE, 26 * PAGE)) == [True] * 6
            for i, q in enumerate(src_pages):
                assert page_bytes(dst, 20 + i) == page_bytes(src, q), (mode, i)
            assert page_bytes(dst, 26) == bytes(len(page_bytes(dst, 26)))  # nothing past them
            assert b_dst.get_stats()["blocks_loaded"] == 6
    finally:
        d.kill()


def test_generic_interface_as_the_cache_controller_calls_it(daemon):
    src, dst = host_pool("layer_first"), host_pool("layer_first")
    b_src, b_dst = backend(daemon.target, src), backend(daemon.target, dst)
    keys = ["generic-0", "generic-1"]
    data = [src.get_data_page(i * PAGE) for i in (2, 3)]  # _generic_page_set
    assert b_src.batch_set(keys, data) is True
    assert b_src.exists("generic-1") and not b_src.exists("generic-2")
    dummies = [dst.get_dummy_flat_data_page() for _ in keys]  # _generic_page_get
    got = b_dst.batch_get(keys + ["generic-2"], dummies + [dst.get_dummy_flat_data_page()])
    assert got[2] is None
    for page, want in zip(got[:2], data):
        assert torch.equal(page.view(torch.uint8), want.view(torch.uint8))
    one = b_dst.get("generic-0", dst.get_dummy_flat_data_page())
    assert torch.equal(one.view(torch.uint8), data[0].view(torch.uint8))


def test_ranks_and_models_do_not_share_pages(daemon):
    pool = host_pool("page_first")
    b0 = backend(daemon.target, pool, tp_rank=0)
    b1 = backend(daemon.target, pool, tp_rank=1)
    other = backend(daemon.target, pool, model="other/model")
    assert b0.batch_set_v1(["shared-0"], torch.arange(0, PAGE)) == [True]
    assert b0.batch_exists(["shared-0"]) == 1
    assert b1.batch_exists(["shared-0"]) == 0 and other.batch_exists(["shared-0"]) == 0


def test_dead_daemon_does_not_stop_the_server(tmp_path):
    pool = host_pool("layer_first")
    b = backend(f"unix:{tmp_path}/none.sock", pool)
    keys = ["dead-0", "dead-1"]
    assert b.batch_exists(keys) == 0
    assert b.batch_set_v1(keys, torch.arange(0, 2 * PAGE)) == [False, False]
    assert b.batch_get_v1(keys, torch.arange(0, 2 * PAGE)) == [False, False]
    assert b.batch_set(keys, [pool.get_data_page(0), pool.get_data_page(PAGE)]) is False
    stats = b.get_stats()
    assert stats["blocks_save_dropped"] == 4 and stats["blocks_load_failed"] == 2


def test_short_pages_are_warned_about_at_registration(daemon, caplog):
    """Pages under 64 tokens are one Proxima block each, which the 4-bit levels compress poorly:
    registering such a pool says so (with the flag that fixes it); a 64-token pool does not."""
    with caplog.at_level("WARNING", logger="proxima"):
        backend(daemon.target, host_pool("layer_first"), model="short/pages")
    warned = [r.getMessage() for r in caplog.records if "--page-size 64" in r.getMessage()]
    assert len(warned) == 1 and f"pages of {PAGE} tokens" in warned[0], caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="proxima"):
        b = backend(daemon.target, host_pool("layer_first", page=64), model="long/pages")
    assert not [r for r in caplog.records if "--page-size" in r.getMessage()], caplog.text
    keys = ["long-0", "long-1"]
    assert b.batch_set_v1(keys, torch.arange(0, 2 * 64)) == [True, True]
    assert b.batch_exists(keys) == 2
