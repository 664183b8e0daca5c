"""The GPU half of what the vLLM connector does, with real torch CUDA tensors: KvLayout(device=True)
gathers and scatters vLLM-shaped paged KV caches (addresses and strides taken from torch, as the
connector takes them) on the GPU, byte for byte against torch's own indexing, and a block
gathered on the GPU goes through a real proximad (put, get) and is scattered back into another
GPU cache unchanged, also through the connector's host staging (proxima.staging) in UCX memory
pinned with cudaHostRegister. Skips (saying why) without torch, without a CUDA device, or when
the module was built without CUDA; scripts/gpu-check.sh runs it on a machine with a GPU."""
import os

import pytest

import proxima

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to torch"),
    pytest.mark.skipif(not proxima.KV_LAYOUT_CUDA, reason="module built without CUDA"),
]

LAYERS, BLOCKS, TOKENS, HEADS, DIM = 4, 64, 16, 8, 128
# Physical axis orders of vLLM's caches (outermost first) and the permutation back to the
# logical [kv][block][token][head][dim].
ORDERS = {
    "flash_attn_nhd": ("kv", "block", "token", "head", "dim"),
    "flashinfer_nhd": ("block", "kv", "token", "head", "dim"),
    "hnd": ("kv", "block", "head", "token", "dim"),
    "flashinfer_hnd": ("block", "kv", "head", "token", "dim"),
}
AXES = ("kv", "block", "token", "head", "dim")
SIZES = {"kv": 2, "block": BLOCKS, "token": TOKENS, "head": HEADS, "dim": DIM}


def cache(order, seed, dtype=torch.bfloat16):
    """One layer's cache in physical `order` on the GPU, and its logical view (same memory)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    phys = torch.randn([SIZES[a] for a in order], generator=g, device="cuda").to(dtype)
    return phys, phys.permute([order.index(a) for a in AXES])


def layout(logicals):
    first = logicals[0]
    return proxima.KvLayout(
        layers=[(lg.data_ptr(), 0, lg.untyped_storage().nbytes(), 0) for lg in logicals],
        strides=tuple(first.stride()), num_blocks=BLOCKS, num_kv_heads=HEADS, head_dim=DIM,
        tokens_per_block=TOKENS, element_size=first.element_size(), device=True)


def canonical(logicals, ids):
    """Canonical blocks by torch indexing: [n][layer][kv][token][head][dim]."""
    return torch.stack([torch.stack([lg[:, b] for lg in logicals]) for b in ids])


@pytest.mark.parametrize("order", list(ORDERS))
def test_gather_and_scatter_on_the_gpu_match_torch(order):
    logicals = [cache(ORDERS[order], seed=l)[1] for l in range(LAYERS)]
    kv = layout(logicals)
    ids = [5, 0, 63, 17, 42, 8]
    out = torch.full((len(ids),) + tuple(canonical(logicals, [0]).shape[1:]), float("nan"),
                     dtype=torch.bfloat16, device="cuda")
    assert kv.block_bytes == out[0].numel() * out.element_size()
    stream = torch.cuda.current_stream()
    kv.gather(ids, out.data_ptr(), stream.cuda_stream)
    torch.cuda.synchronize()
    want = canonical(logicals, ids)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))

    # Scatter into an empty cache of the same layout: those blocks equal the source, every
    # other block keeps its poison.
    targets = [cache(ORDERS[order], seed=100 + l)[1].fill_(-7.0) for l in range(LAYERS)]
    kv2 = layout(targets)
    kv2.scatter(ids, out.data_ptr(), stream.cuda_stream)
    torch.cuda.synchronize()
    for lg, tg in zip(logicals, targets):
        for b in range(BLOCKS):
            if b in ids:
                assert torch.equal(tg[:, b].view(torch.int16), lg[:, b].view(torch.int16)), b
            else:
                assert bool((tg[:, b] == -7.0).all()), b


def test_separate_k_and_v_tensors_on_the_gpu():
    shape = (BLOCKS, TOKENS, HEADS, DIM)  # vLLM's per-layer K and V tensors, NHD
    ks = [torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)]
    vs = [torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)]
    kv = proxima.KvLayout(
        layers=[(k.data_ptr(), v.data_ptr(), k.untyped_storage().nbytes(),
                 v.untyped_storage().nbytes()) for k, v in zip(ks, vs)],
        strides=(0,) + tuple(ks[0].stride()), num_blocks=BLOCKS, num_kv_heads=HEADS,
        head_dim=DIM, tokens_per_block=TOKENS, element_size=2, device=True)
    ids = [3, 60]
    out = torch.empty((len(ids), LAYERS, 2, TOKENS, HEADS, DIM), dtype=torch.bfloat16,
                      device="cuda")
    kv.gather(ids, out.data_ptr(), 0)
    torch.cuda.synchronize()
    want = torch.stack([torch.stack([torch.stack([k[b], v[b]]) for k, v in zip(ks, vs)])
                        for b in ids])
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


def test_blocks_gathered_on_the_gpu_round_trip_through_proximad(client):
    """The connector's save and load paths: GPU gather -> pinned host staging -> put; get ->
    pinned staging -> device staging -> GPU scatter into another cache."""
    logicals = [cache(ORDERS["flash_attn_nhd"], seed=l)[1] for l in range(LAYERS)]
    kv = layout(logicals)
    profile = client.register_profile(LAYERS, HEADS, DIM, TOKENS, "bf16", fingerprint="cuda-test")
    assert profile.block_bytes == kv.block_bytes
    ids = [1, 2, 30, 31]
    n = len(ids)
    dev = torch.empty(n * kv.block_bytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(n * kv.block_bytes, dtype=torch.uint8, pin_memory=True)
    kv.gather(ids, dev.data_ptr(), torch.cuda.current_stream().cuda_stream)
    host.copy_(dev)  # waits for the kernel (same stream)
    client.register_buffer(host.data_ptr(), host.numel())
    keys = [os.urandom(proxima.KEY_BYTES) for _ in ids]
    pieces = [[(host.data_ptr() + i * kv.block_bytes, kv.block_bytes)] for i in range(n)]
    assert client.put(profile, keys, pieces) == ["stored"] * n

    back = torch.zeros(n * kv.block_bytes, dtype=torch.uint8, pin_memory=True)
    client.register_buffer(back.data_ptr(), back.numel())
    got = [[(back.data_ptr() + i * kv.block_bytes, kv.block_bytes)] for i in range(n)]
    assert client.get(profile, keys, got) == [True] * n
    assert torch.equal(back, host)
    dev2 = back.to("cuda")
    targets = [cache(ORDERS["flash_attn_nhd"], seed=200 + l)[1].zero_() for l in range(LAYERS)]
    layout(targets).scatter(ids, dev2.data_ptr(), torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    for lg, tg in zip(logicals, targets):
        for b in ids:
            assert torch.equal(tg[:, b].view(torch.int16), lg[:, b].view(torch.int16))


def test_blocks_in_gpu_memory_go_straight_through_the_client(client):
    """Device pointers handed to put/get as they are: the client library stages them through its
    own pinned buffers (double-buffered), so the caller needs no host copy of its own."""
    logicals = [cache(ORDERS["hnd"], seed=300 + l)[1] for l in range(LAYERS)]
    kv = layout(logicals)
    profile = client.register_profile(LAYERS, HEADS, DIM, TOKENS, "bf16",
                                      fingerprint="cuda-direct-test")
    ids = list(range(0, BLOCKS, 3))
    n = len(ids)
    dev = torch.empty(n * kv.block_bytes, dtype=torch.uint8, device="cuda")
    kv.gather(ids, dev.data_ptr(), torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    back = torch.full((n * kv.block_bytes,), 0xA5, dtype=torch.uint8, device="cuda")
    client.register_buffer(dev.data_ptr(), dev.numel())
    client.register_buffer(back.data_ptr(), back.numel())
    keys = [os.urandom(proxima.KEY_BYTES) for _ in ids]
    # Each block in two pieces of device memory.
    half = kv.block_bytes // 2
    pieces = [[(dev.data_ptr() + i * kv.block_bytes, half),
               (dev.data_ptr() + i * kv.block_bytes + half, half)] for i in range(n)]
    assert client.put(profile, keys, pieces) == ["stored"] * n

    got = [[(back.data_ptr() + i * kv.block_bytes, kv.block_bytes)] for i in range(n)]
    missing = os.urandom(proxima.KEY_BYTES)
    assert client.get(profile, keys[:-1] + [missing], got) == [True] * (n - 1) + [False]
    last = slice((n - 1) * kv.block_bytes, n * kv.block_bytes)
    assert torch.equal(back[:last.start], dev[:last.start])
    assert bool((back[last] == 0xA5).all())  # the miss left its buffer alone
    # And through host memory: the daemon holds exactly the gathered bytes.
    host = torch.zeros(n * kv.block_bytes, dtype=torch.uint8)
    client.register_buffer(host.data_ptr(), host.numel())
    got_host = [[(host.data_ptr() + i * kv.block_bytes, kv.block_bytes)] for i in range(n)]
    assert client.get(profile, keys, got_host) == [True] * n
    assert torch.equal(host, dev.cpu())


def test_connector_staging_in_ucx_memory_is_pinned(daemon):
    """proxima.vllm's host staging for CUDA caches (proxima.staging.HostStaging): over UCX the
    client's alloc_buffer memory as a tensor, pinned with cudaHostRegister; blocks gathered on
    the GPU go through it to proximad and back into another GPU cache; unpinned when let go."""
    from proxima.engine import Link, LinkOptions, ProfileSpec
    from proxima.staging import HostStaging

    link = Link(LinkOptions(target=daemon.target),
                ProfileSpec(LAYERS, HEADS, DIM, TOKENS, "bf16", "cuda-staging-test"))
    shape = (8, LAYERS, 2, TOKENS, HEADS, DIM)
    staging = HostStaging(link, shape, torch.bfloat16, pin=True)
    conn = link.connection(wait=True)
    assert conn is not None and conn.client.transport == "ucx", conn
    host = staging.tensor(conn)
    assert staging.kind == "ucx" and host.data_ptr() == conn.staging.address
    assert host.is_pinned()
    logicals = [cache(ORDERS["flashinfer_nhd"], seed=400 + l)[1] for l in range(LAYERS)]
    kv = layout(logicals)
    ids = [3, 9, 27, 60]
    n = len(ids)
    dev = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    kv.gather(ids, dev.data_ptr(), stream)
    host[:n].copy_(dev[:n])  # waits for the kernel (same stream)
    keys = [os.urandom(proxima.KEY_BYTES) for _ in ids]
    pieces = [[(host.data_ptr() + i * kv.block_bytes, kv.block_bytes)] for i in range(n)]
    assert link.put(keys, pieces, via=conn) == [True] * n
    host.zero_()
    assert link.get(keys, pieces, via=conn) == [True] * n
    back = torch.zeros_like(dev)
    back[:n].copy_(host[:n], non_blocking=True)
    targets = [cache(ORDERS["flashinfer_nhd"], seed=500 + l)[1].zero_() for l in range(LAYERS)]
    layout(targets).scatter(ids, back.data_ptr(), stream)
    torch.cuda.synchronize()
    for lg, tg in zip(logicals, targets):
        for b in ids:
            assert torch.equal(tg[:, b].view(torch.int16), lg[:, b].view(torch.int16))
    staging.release()
    assert not host.is_pinned()  # unregistered; the memory is still the buffer's
    assert staging._heap is None  # never fell back to the heap
