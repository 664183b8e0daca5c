"""proxima.vllm against real vLLM (installed by scripts/python-engines.sh; skipped, with the
reason, where vllm is absent): the connector made by vLLM's KVConnectorFactory from a real
VllmConfig, real Requests hashed by vLLM's own block hasher, real SchedulerOutput objects, and
paged KV tensors on the CPU in two layouts; driven through the calls the scheduler and the
worker make, checked byte for byte. The host staging buffer is memory the worker's client
allocated over UCX (reallocated with a new client after a daemon restart), a heap tensor over
inline."""
import inspect
import json
import time

import pytest

torch = pytest.importorskip("torch", reason="torch is installed by scripts/python-engines.sh")
pytest.importorskip("vllm", reason="vllm is installed by scripts/python-engines.sh")

from vllm import SamplingParams  # noqa: E402
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,  # noqa: E402
                         VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import (KVCacheBlock, get_request_block_hasher,  # noqa: E402
                                         init_none_hash)
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from conftest import Daemon  # noqa: E402
from proxima import KV_NO_BLOCK  # noqa: E402
from proxima.vllm import ProximaConnector  # noqa: E402

BLOCK, LAYERS, HEADS, DIM, NUM_BLOCKS = 4, 3, 2, 16, 40
RKEYS = "proxima_ucx_rkeys_unpacked_total"
# A tiny Llama: vLLM reads its geometry from config.json; no weights are needed.
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": HEADS,
        "num_hidden_layers": LAYERS, "vocab_size": 256, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "head_dim": DIM,
        "rope_theta": 500000.0}
HASH = get_hash_fn_by_name("sha256")
init_none_hash(HASH)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    (d / "config.json").write_text(json.dumps(TINY))
    return str(d)


@pytest.fixture(scope="module")
def model_config(model_dir):
    return ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16",
                       max_model_len=256)


def connector(model_config, target, role, layout="NHD", **extra):
    """A connector made by vLLM's factory. One Proxima block per vLLM block unless the test
    says otherwise (block_tokens; None: the connector's default)."""
    extra = {k: v for k, v in {"block_tokens": BLOCK, **extra}.items() if v is not None}
    config = VllmConfig(
        model_config=model_config, cache_config=CacheConfig(block_size=BLOCK),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="ProximaConnector", kv_role="kv_both",
            kv_connector_module_path="proxima.vllm",
            kv_connector_extra_config={"target": target, "connect_timeout": 1.0,
                                       "call_timeout": 2.0, **extra}))
    kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                                    kv_cache_groups=[],
                                    kv_cache_layout="HND" if layout == "HND" else "NHD")
    c = KVConnectorFactory.create_connector(config, role, kv_cache_config)
    assert isinstance(c, ProximaConnector)
    return c


def test_the_profile_carries_the_models_rope_base(model_config):
    # From the model's config.json, through vLLM's ModelConfig, for the daemon's k4v3 levels.
    from proxima.vllm import profile_spec
    config = VllmConfig(model_config=model_config, cache_config=CacheConfig(block_size=BLOCK),
                        device_config=DeviceConfig(device="cpu"))
    assert profile_spec(config, (0, 1, 0, 1)).rope_theta == 500000.0


def kv_caches(layout, seed):
    """Per-layer paged tensors: FlashAttention's [2][blocks][token][head][dim] (NHD), the HND
    order [2][blocks][head][token][dim], or vLLM's CPU attention's [blocks][head][token][2 * dim]
    (CPU), which it reads as [blocks][head][2 * token][dim]: K in the first BLOCK rows."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(LAYERS):
        t = torch.randn((2, NUM_BLOCKS, BLOCK, HEADS, DIM), generator=g).to(torch.bfloat16)
        if layout == "HND":
            t = t.permute(0, 1, 3, 2, 4).contiguous()
        elif layout == "CPU":
            t = t.permute(1, 3, 0, 2, 4).contiguous().view(NUM_BLOCKS, HEADS, BLOCK, 2 * DIM)
        out[f"model.layers.{layer}.self_attn.attn"] = t
    return out


def block_of(caches, layout, block_id):
    """Every layer's K and V of one block, in canonical [layer][kv][token][head][dim] order."""
    parts = []
    for t in caches.values():
        if layout == "CPU":  # as vLLM's CPU attention reads it: view, then K and V halves
            k, v = t[block_id].view(HEADS, 2 * BLOCK, DIM).chunk(2, dim=1)
            parts.append(torch.stack([k.permute(1, 0, 2), v.permute(1, 0, 2)]))
            continue
        b = t[:, block_id]
        parts.append(b if layout == "NHD" else b.permute(0, 2, 1, 3))
    return torch.stack(parts)


def request(rid, tokens):
    return Request(rid, tokens, SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(BLOCK, HASH))


def new_request_data(req, block_ids):
    """NewRequestData as vLLM's scheduler makes it (0.34 added the prefill token ids)."""
    if "prefill_token_ids" in inspect.signature(NewRequestData.from_request).parameters:
        return NewRequestData.from_request(req, block_ids, req.prefill_token_ids)
    return NewRequestData.from_request(req, block_ids)


def schedule_new(sched, req, block_ids, num_computed=0):
    """One scheduler step that schedules the rest of `req`'s prompt on `block_ids`."""
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [new_request_data(req, (list(block_ids),))]
    out.scheduled_new_reqs[0].num_computed_tokens = num_computed
    out.num_scheduled_tokens = {req.request_id: req.num_tokens - num_computed}
    out.total_num_scheduled_tokens = req.num_tokens - num_computed
    return sched.build_connector_meta(out)


def run_worker_step(worker, meta):
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    for layer in range(LAYERS):
        worker.wait_for_layer_load(f"model.layers.{layer}.self_attn.attn")
    worker.wait_for_save()
    worker.clear_connector_metadata()
    return worker.get_block_ids_with_load_errors()


def blocks(ids):
    return KVCacheBlocks(blocks=([KVCacheBlock(i) for i in ids],))


def save_then_load(sched, saver, loader, name, tokens, save_ids, load_ids):
    """Request `name`-1 (nothing stored yet) saves its 2 full blocks of `tokens` from `saver`'s
    blocks `save_ids`; request `name`-2 of the same tokens then matches 8 tokens and loads them
    into `loader`'s blocks `load_ids`. Both worker steps finish without failed loads."""
    r1 = request(f"{name}-1", tokens)
    assert sched.get_num_new_matched_tokens(r1, 0) == (0, False)
    sched.update_state_after_alloc(r1, blocks(save_ids), 0)
    assert run_worker_step(saver, schedule_new(sched, r1, save_ids)) == set()
    r2 = request(f"{name}-2", tokens)
    assert sched.get_num_new_matched_tokens(r2, 0) == (8, False)
    sched.update_state_after_alloc(r2, blocks(load_ids), 8)
    assert run_worker_step(loader, schedule_new(sched, r2, load_ids, num_computed=8)) == set()


@pytest.mark.parametrize("layout", ["NHD", "HND", "CPU"])
def test_second_request_loads_the_prefix_the_first_saved(daemon, model_config, layout):
    # 18 tokens: 4 full blocks and 2 tokens; other tokens per layout, as the blocks saved are
    # canonical and would be shared between the layouts.
    first = {"NHD": 100, "HND": 150, "CPU": 600}[layout]
    tokens = list(range(first, first + 18))
    # First engine: nothing cached; the 4 full blocks are saved after the prefill step.
    s1 = connector(model_config, daemon.target, KVConnectorRole.SCHEDULER, layout)
    w1 = connector(model_config, daemon.target, KVConnectorRole.WORKER, layout)
    src = kv_caches(layout, seed=1)
    w1.register_kv_caches(src)
    r1 = request(f"first-{layout}", tokens)
    assert s1.get_num_new_matched_tokens(r1, 0) == (0, False)
    s1.update_state_after_alloc(r1, blocks(range(5, 10)), 0)
    meta = schedule_new(s1, r1, range(5, 10))
    assert [len(t.block_ids) for t in meta.saves] == [4] and not meta.loads
    assert run_worker_step(w1, meta) == set()
    assert w1.link.counters.blocks_saved == 4
    assert s1.request_finished(r1, list(range(5, 10))) == (False, None)

    # Second engine (fresh connectors, fresh tensors): the same prompt hits 4 blocks (16 tokens:
    # vLLM computes the last 2 itself) and loads them into other block ids, byte for byte.
    s2 = connector(model_config, daemon.target, KVConnectorRole.SCHEDULER, layout)
    w2 = connector(model_config, daemon.target, KVConnectorRole.WORKER, layout)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    w2.register_kv_caches(dst)
    r2 = request(f"second-{layout}", tokens)
    assert s2.get_num_new_matched_tokens(r2, 0) == (16, False)
    s2.update_state_after_alloc(r2, blocks(range(20, 25)), 16)
    meta = schedule_new(s2, r2, range(20, 25), num_computed=16)
    assert [t.block_ids for t in meta.loads] == [[20, 21, 22, 23]] and not meta.saves
    assert run_worker_step(w2, meta) == set()
    for i in range(4):
        assert torch.equal(block_of(dst, layout, 20 + i).view(torch.int16),
                           block_of(src, layout, 5 + i).view(torch.int16))
    assert not block_of(dst, layout, 24).any()

    # A third prompt sharing 2 blocks; the local prefix cache already has the first one.
    r3 = request(f"third-{layout}", tokens[:8] + [7] * 9)
    assert s2.get_num_new_matched_tokens(r3, 4) == (4, False)


def test_proxima_blocks_are_64_tokens_of_whole_vllm_blocks_by_default(daemon, model_config):
    c = connector(model_config, daemon.target, KVConnectorRole.WORKER, block_tokens=None)
    assert (c.block_tokens, c.group, c.spec.tokens_per_block) == (64, 64 // BLOCK, 64)
    c = connector(model_config, daemon.target, KVConnectorRole.WORKER, block_tokens=12)
    assert (c.block_tokens, c.group, c.spec.tokens_per_block) == (12, 3, 12)
    for bad in (6, 0, -4, "12x", 2.5):
        with pytest.raises(ValueError, match=f"block_tokens {bad!r}: expected a positive "
                           f"multiple of vLLM's block_size {BLOCK}"):
            connector(model_config, daemon.target, KVConnectorRole.WORKER, block_tokens=bad)


@pytest.mark.parametrize("save_path,load_path", [("kv_layout", "kv_layout"),
                                                  ("torch", "kv_layout"),
                                                  ("kv_layout", "torch")])
def test_groups_of_blocks_are_saved_whole_and_loaded_past_the_local_hit(daemon, model_config,
                                                                        save_path, load_path):
    """block_tokens=12: three vLLM blocks per Proxima block. A 30-token prompt has 7 full
    blocks: 2 whole groups are saved (blocks 0-5), block 6 is not (its group is not full). A
    second engine whose local prefix cache holds the first block claims the other 20 tokens of
    the two groups and loads them; its first block is not written. Torch's gather and scatter
    (the fallback) each meet the C++ path on the other side."""
    path = f"{save_path}-{load_path}"
    first = {"kv_layout-kv_layout": 800, "torch-kv_layout": 850, "kv_layout-torch": 900}[path]
    tokens = list(range(first, first + 30))
    s1 = connector(model_config, daemon.target, KVConnectorRole.SCHEDULER, block_tokens=12)
    w1 = connector(model_config, daemon.target, KVConnectorRole.WORKER, block_tokens=12)
    src = kv_caches("NHD", seed=11)
    w1.register_kv_caches(src)
    r1 = request(f"group-{path}-1", tokens)
    assert s1.get_num_new_matched_tokens(r1, 0) == (0, False)
    s1.update_state_after_alloc(r1, blocks(range(0, 8)), 0)
    meta = schedule_new(s1, r1, range(0, 8))
    assert [(t.block_ids, len(t.keys)) for t in meta.saves] == [([0, 1, 2, 3, 4, 5], 2)]
    if save_path == "torch":
        w1._kv_layout = None
    assert run_worker_step(w1, meta) == set()
    assert w1.link.counters.blocks_saved == 2

    s2 = connector(model_config, daemon.target, KVConnectorRole.SCHEDULER, block_tokens=12)
    w2 = connector(model_config, daemon.target, KVConnectorRole.WORKER, block_tokens=12)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    w2.register_kv_caches(dst)
    if load_path == "torch":
        w2._kv_layout = None
    r2 = request(f"group-{path}-2", tokens)
    assert s2.get_num_new_matched_tokens(r2, BLOCK) == (2 * 12 - BLOCK, False)
    s2.update_state_after_alloc(r2, blocks(range(20, 28)), 2 * 12 - BLOCK)
    meta = schedule_new(s2, r2, range(20, 28), num_computed=24)
    assert [t.block_ids for t in meta.loads] == [[KV_NO_BLOCK, 21, 22, 23, 24, 25]]
    assert not meta.saves  # both groups are in proximad; block 6's group is not full
    assert run_worker_step(w2, meta) == set()
    for i in range(1, 6):
        assert torch.equal(block_of(dst, "NHD", 20 + i).view(torch.int16),
                           block_of(src, "NHD", i).view(torch.int16)), i
    for untouched in (20, 26, 27):  # the local hit's block, and blocks past the groups
        assert not block_of(dst, "NHD", untouched).any(), untouched

    # A prompt whose only whole group the local hit already covers claims nothing (17 tokens:
    # one group of 12 claimable; 4 blocks held locally).
    r3 = request(f"group-{path}-3", tokens[:17])
    assert s2.get_num_new_matched_tokens(r3, 4 * BLOCK) == (0, False)


def test_dead_daemon_misses_reports_failed_loads_drops_saves(daemon, model_config, tmp_path):
    live_s = connector(model_config, daemon.target, KVConnectorRole.SCHEDULER)
    live_w = connector(model_config, daemon.target, KVConnectorRole.WORKER)
    live_w.register_kv_caches(kv_caches("NHD", seed=3))
    tokens = list(range(200, 213))
    r = request("dead-seed", tokens)
    live_s.get_num_new_matched_tokens(r, 0)
    live_s.update_state_after_alloc(r, blocks(range(0, 4)), 0)
    run_worker_step(live_w, schedule_new(live_s, r, range(0, 4)))
    r2 = request("dead-plan", tokens)
    assert live_s.get_num_new_matched_tokens(r2, 0) == (12, False)
    live_s.update_state_after_alloc(r2, blocks(range(10, 14)), 12)
    load_meta = schedule_new(live_s, r2, range(10, 14), num_computed=12)

    dead = f"unix:{tmp_path}/none.sock"
    s = connector(model_config, dead, KVConnectorRole.SCHEDULER)
    w = connector(model_config, dead, KVConnectorRole.WORKER)
    w.register_kv_caches(kv_caches("NHD", seed=4))
    assert s.get_num_new_matched_tokens(request("dead-1", tokens), 0) == (0, False)
    # The worker lost its daemon after the scheduler planned loads: vLLM learns which blocks
    # to recompute; the saves of the step are dropped and counted.
    assert run_worker_step(w, load_meta) == {10, 11, 12}
    r3 = request("dead-save", list(range(300, 313)))
    s.get_num_new_matched_tokens(r3, 0)
    s.update_state_after_alloc(r3, blocks(range(20, 24)), 0)
    assert run_worker_step(w, schedule_new(s, r3, range(20, 24))) == set()
    assert w.link.counters.blocks_save_dropped == 3
    assert w.link.counters.blocks_load_failed == 3


@pytest.mark.parametrize("save_path,load_path", [("kv_layout", "kv_layout"),
                                                  ("torch", "kv_layout"),
                                                  ("kv_layout", "torch")])
def test_blocks_are_canonical_across_layouts(daemon, model_config, save_path, load_path):
    """Saved from FlashAttention's NHD tensors, loaded into HND tensors: the same K/V values,
    whether proxima.KvLayout (the C++ path, used for CPU tensors) or torch (the fallback) does
    the gather and the scatter. The saver stages in its client's UCX memory, the loader (over
    inline) in a heap tensor."""
    case = f"{save_path}-{load_path}"
    first = 400 + 20 * ["kv_layout-kv_layout", "torch-kv_layout", "kv_layout-torch"].index(case)
    tokens = list(range(first, first + 9))  # 2 full blocks
    s = connector(model_config, daemon.target, KVConnectorRole.SCHEDULER, "NHD")
    w_nhd = connector(model_config, daemon.target, KVConnectorRole.WORKER, "NHD")
    w_hnd = connector(model_config, daemon.target, KVConnectorRole.WORKER, "HND",
                      transport="inline")
    src = kv_caches("NHD", seed=5)
    dst = {k: torch.zeros_like(v) for k, v in kv_caches("HND", seed=6).items()}
    w_nhd.register_kv_caches(src)
    w_hnd.register_kv_caches(dst)
    for w, path in ((w_nhd, save_path), (w_hnd, load_path)):
        assert w._kv_layout is not None and not w._kv_layout.device  # CPU tensors: C++ path
        if path == "torch":
            w._kv_layout = None
    save_then_load(s, w_nhd, w_hnd, f"canon-{case}", tokens, [3, 4, 5], [30, 31, 32])
    for a, b in ((3, 30), (4, 31)):
        assert torch.equal(block_of(dst, "HND", b).view(torch.int16),
                           block_of(src, "NHD", a).view(torch.int16))
    assert (w_nhd._staging.kind, w_hnd._staging.kind) == ("ucx", "heap")
    assert w_nhd.link.connection().client.registered_buffers == 1  # the staging buffer only


def test_cpu_attention_caches_hold_the_canonical_blocks(daemon, model_config):
    """Saved from vLLM's CPU attention cache ([blocks][head][token][2 * dim], read as K rows then
    V rows), loaded into FlashAttention's NHD tensors, as a CPU engine and a GPU engine sharing
    a proximad would: the same K/V values, through the C++ gather/scatter on both sides."""
    tokens = list(range(650, 659))  # 2 full blocks
    s = connector(model_config, daemon.target, KVConnectorRole.SCHEDULER, "NHD")
    w_cpu = connector(model_config, daemon.target, KVConnectorRole.WORKER, "CPU")
    w_nhd = connector(model_config, daemon.target, KVConnectorRole.WORKER, "NHD")
    src = kv_caches("CPU", seed=9)
    dst = {k: torch.zeros_like(v) for k, v in kv_caches("NHD", seed=10).items()}
    w_cpu.register_kv_caches(src)
    w_nhd.register_kv_caches(dst)
    assert w_cpu._kv_layout is not None and w_nhd._kv_layout is not None
    save_then_load(s, w_cpu, w_nhd, "cpu-attn", tokens, [6, 7, 8], [33, 34, 35])
    for a, b in ((6, 33), (7, 34)):
        assert torch.equal(block_of(dst, "NHD", b).view(torch.int16),
                           block_of(src, "CPU", a).view(torch.int16))


def test_a_match_not_scheduled_plans_no_load(daemon, model_config):
    """get_num_new_matched_tokens without an allocation (no room this step): no load is sent;
    once allocated, the load goes to the blocks vLLM gave."""
    tokens = list(range(500, 509))
    s = connector(model_config, daemon.target, KVConnectorRole.SCHEDULER)
    w = connector(model_config, daemon.target, KVConnectorRole.WORKER)
    w.register_kv_caches(kv_caches("NHD", seed=7))
    r1 = request("sched-1", tokens)
    s.get_num_new_matched_tokens(r1, 0)
    s.update_state_after_alloc(r1, blocks([1, 2, 3]), 0)
    run_worker_step(w, schedule_new(s, r1, [1, 2, 3]))
    r2 = request("sched-2", tokens)
    assert s.get_num_new_matched_tokens(r2, 0) == (8, False)
    assert s.build_connector_meta(SchedulerOutput.make_empty()).loads == []
    s.update_state_after_alloc(r2, blocks([7, 8, 9]), 8)
    assert [t.block_ids for t in schedule_new(s, r2, [7, 8, 9], num_computed=8).loads] == [[7, 8]]


def test_staging_is_the_clients_ucx_memory_and_follows_a_restart(model_config):
    """The worker stages in memory its client allocated over UCX; a daemon killed and restarted
    means a new client, which allocates its own: the connector moves to it (the old one let go)
    and saves and loads byte for byte again, one registration per daemon."""
    d = Daemon(sets=["server.metrics_listen=127.0.0.1:0"])
    try:
        s = connector(model_config, d.target, KVConnectorRole.SCHEDULER, retry_seconds=0.0)
        w = connector(model_config, d.target, KVConnectorRole.WORKER, retry_seconds=0.0)
        src = kv_caches("NHD", seed=8)
        w.register_kv_caches(src)

        def save_then_load(tag, tokens, save_ids, load_ids):
            r = request(f"{tag}-save", tokens)
            assert s.get_num_new_matched_tokens(r, 0) == (0, False)
            s.update_state_after_alloc(r, blocks(save_ids), 0)
            assert run_worker_step(w, schedule_new(s, r, save_ids)) == set()
            r2 = request(f"{tag}-load", tokens)
            hit = (len(save_ids) - 1) * BLOCK
            assert s.get_num_new_matched_tokens(r2, 0) == (hit, False)
            s.update_state_after_alloc(r2, blocks(load_ids), hit)
            assert run_worker_step(w, schedule_new(s, r2, load_ids, num_computed=hit)) == set()
            for a, b in zip(save_ids[:-1], load_ids[:-1]):
                assert torch.equal(block_of(src, "NHD", b).view(torch.int16),
                                   block_of(src, "NHD", a).view(torch.int16)), (a, b)

        tokens = list(range(600, 613))  # 3 full blocks
        before = d.metric(RKEYS)
        save_then_load("before", tokens, [1, 2, 3, 4], [11, 12, 13, 14])
        first = w.link.connection()
        assert first.client.transport == "ucx" and first.staging is not None
        assert w._staging.kind == "ucx"
        assert w._staging.tensor(first).data_ptr() == first.staging.address
        assert d.metric(RKEYS) - before == 1  # every save and load through one staging buffer

        d.kill()  # the step finds no daemon: both clients are dropped, the saves too
        r = request("down", list(range(700, 709)))
        s.get_num_new_matched_tokens(r, 0)
        s.update_state_after_alloc(r, blocks([20, 21, 22]), 0)
        run_worker_step(w, schedule_new(s, r, [20, 21, 22]))
        assert w.link.counters.blocks_save_dropped == 2
        assert w.link.connection() is None
        d.start()
        deadline = time.monotonic() + 10
        while w.link.connection() is None or s.link.connection() is None:
            assert time.monotonic() < deadline, "the links did not come back within 10 s"
            time.sleep(0.02)
        second = w.link.connection()
        assert second.client is not first.client and second.staging is not first.staging
        # A fresh daemon: nothing is cached; save and load again, through the new buffer.
        before = d.metric(RKEYS)
        save_then_load("after", tokens, [5, 6, 7, 8], [15, 16, 17, 18])
        assert w._staging.kind == "ucx"
        assert w._staging.tensor(second).data_ptr() == second.staging.address
        assert w._staging._heap is None  # never fell back
        assert d.metric(RKEYS) - before == 1
    finally:
        d.kill()
