"""proxima.KvLayout (kernels/kv_layout.h through the binding) on numpy arrays, no torch: paged KV
tensors in vLLM's layouts (NHD, HND, K/V outermost or blocks outermost, separate K and V, padded
strides) gathered into canonical blocks [layer][k|v][token][head][dim] and scattered back, byte
for byte against numpy's own indexing, and the bad input the binding must refuse."""
import numpy as np
import pytest

import proxima

LAYERS, BLOCKS, TOKENS, HEADS, DIM = 3, 10, 4, 2, 16
AXES = ("kv", "block", "token", "head", "dim")
SIZES = {"kv": 2, "block": BLOCKS, "token": TOKENS, "head": HEADS, "dim": DIM}
ORDERS = {
    "nhd": ("kv", "block", "token", "head", "dim"),        # FlashAttention
    "nhd_block_first": ("block", "kv", "token", "head", "dim"),  # FlashInfer
    "hnd": ("kv", "block", "head", "token", "dim"),
    "hnd_block_first": ("block", "kv", "head", "token", "dim"),
}


def paged(order, dtype, seed, pad=0):
    """One layer's tensor in `order` (pad: extra elements on the head_dim rows' outer axis) and
    its logical view [kv][block][token][head][dim] (same memory)."""
    rng = np.random.default_rng(seed)
    shape = [SIZES[a] for a in order]
    shape[-2] += pad
    full = rng.integers(0, 2**16 if dtype == np.uint16 else 2**8, size=shape).astype(dtype)
    t = full[..., :SIZES[order[-2]], :] if pad else full
    logical = np.transpose(t, [order.index(a) for a in AXES])
    return full, logical


def strides_of(logical):
    return tuple(s // logical.itemsize for s in logical.strides)


def layout_of(logicals, fulls, separate=None):
    if separate is None:
        layers = [(lg.ctypes.data, 0, f.nbytes, 0) for lg, f in zip(logicals, fulls)]
        strides = strides_of(logicals[0])
    else:
        layers = [(k.ctypes.data, v.ctypes.data, k.nbytes, v.nbytes) for k, v in separate]
        strides = (0,) + tuple(s // separate[0][0].itemsize for s in separate[0][0].strides)
    return proxima.KvLayout(layers=layers, strides=strides, num_blocks=BLOCKS,
                            num_kv_heads=HEADS, head_dim=DIM, tokens_per_block=TOKENS,
                            element_size=logicals[0].itemsize)


def reference(logicals, ids):
    """Canonical blocks by numpy: [n][layer][kv][token][head][dim]."""
    return np.stack([np.stack([lg[:, b] for lg in logicals]) for b in ids])


@pytest.mark.parametrize("dtype", [np.uint16, np.uint8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("pad", [0, 3])
@pytest.mark.parametrize("order", list(ORDERS))
def test_gather_matches_numpy_and_scatter_round_trips(order, pad, dtype):
    tensors = [paged(ORDERS[order], dtype, seed=l, pad=pad) for l in range(LAYERS)]
    fulls, logicals = zip(*tensors)
    kv = layout_of(logicals, fulls)
    assert kv.block_bytes == 2 * LAYERS * TOKENS * HEADS * DIM * np.dtype(dtype).itemsize
    ids = [7, 0, 3, 9]
    out = np.zeros((len(ids), LAYERS, 2, TOKENS, HEADS, DIM), dtype=dtype)
    kv.gather(ids, out.ctypes.data)  # blocks back to back
    np.testing.assert_array_equal(out, reference(logicals, ids))
    # One address per block, in any order.
    rows = np.zeros_like(out)
    kv.gather(ids, [rows[i].ctypes.data for i in (3, 2, 1, 0)][::-1])
    np.testing.assert_array_equal(rows, out)
    # Scatter the blocks into other slots and read them back; nothing else changes.
    before = [lg.copy() for lg in logicals]
    before_pad = [f[..., SIZES[ORDERS[order][-2]]:, :].copy() for f in fulls]
    dest = [1, 2, 5, 8]
    kv.scatter(dest, out.ctypes.data)
    for layer, lg in enumerate(logicals):
        for b in range(BLOCKS):
            want = out[dest.index(b), layer] if b in dest else before[layer][:, b]
            np.testing.assert_array_equal(lg[:, b], want)
        np.testing.assert_array_equal(fulls[layer][..., SIZES[ORDERS[order][-2]]:, :],
                                      before_pad[layer])


@pytest.mark.parametrize("order", ["nhd", "hnd_block_first"])
def test_several_paged_blocks_make_one_canonical_block(order):
    """blocks_per_canonical=3: each canonical block holds 3 paged blocks' tokens one after the
    other ([layer][kv][3 * TOKENS][head][dim]); KV_NO_BLOCK parts are neither read nor
    written."""
    tensors = [paged(ORDERS[order], np.uint16, seed=10 + l) for l in range(LAYERS)]
    fulls, logicals = zip(*tensors)
    one = layout_of(logicals, fulls)
    layers = [(lg.ctypes.data, 0, f.nbytes, 0) for lg, f in zip(logicals, fulls)]
    kv = proxima.KvLayout(layers=layers, strides=strides_of(logicals[0]), num_blocks=BLOCKS,
                          num_kv_heads=HEADS, head_dim=DIM, tokens_per_block=TOKENS,
                          element_size=2, blocks_per_canonical=3)
    assert kv.block_bytes == 3 * one.block_bytes
    ids = [7, 0, 3, 9, 2, 5]
    out = np.zeros((2, LAYERS, 2, 3 * TOKENS, HEADS, DIM), dtype=np.uint16)
    kv.gather(ids, out.ctypes.data)
    per_block = reference(logicals, ids)  # [6][layer][kv][token][head][dim]
    want = per_block.reshape(2, 3, LAYERS, 2, TOKENS, HEADS, DIM).transpose(0, 2, 3, 1, 4, 5, 6)
    np.testing.assert_array_equal(out, want.reshape(out.shape))
    # A part not to copy: left as it was in the gather, not written by the scatter.
    again = np.full_like(out, 0x7777)
    kv.gather([7, proxima.KV_NO_BLOCK, 3, 9, 2, 5], again.ctypes.data)
    np.testing.assert_array_equal(again[0, :, :, TOKENS:2 * TOKENS], 0x7777)
    np.testing.assert_array_equal(again[0, :, :, :TOKENS], out[0, :, :, :TOKENS])
    np.testing.assert_array_equal(again[1], out[1])
    before = [lg.copy() for lg in logicals]
    kv.scatter([1, proxima.KV_NO_BLOCK, 4, 6, 8, proxima.KV_NO_BLOCK], out.ctypes.data)
    for layer, lg in enumerate(logicals):
        np.testing.assert_array_equal(lg[:, 1], per_block[0, layer])
        np.testing.assert_array_equal(lg[:, 4], per_block[2, layer])
        np.testing.assert_array_equal(lg[:, 6], per_block[3, layer])
        np.testing.assert_array_equal(lg[:, 8], per_block[4, layer])
        for b in (0, 2, 3, 5, 7, 9):
            np.testing.assert_array_equal(lg[:, b], before[layer][:, b])
    with pytest.raises(ValueError, match="4 block ids for 1 block pointers: expected 3"):
        kv.gather([0, 1, 2, 3], out.ctypes.data)


def test_separate_k_and_v_tensors():
    rng = np.random.default_rng(5)
    pairs = [(rng.integers(0, 2**16, size=(BLOCKS, TOKENS, HEADS, DIM)).astype(np.uint16),
              rng.integers(0, 2**16, size=(BLOCKS, TOKENS, HEADS, DIM)).astype(np.uint16))
             for _ in range(LAYERS)]
    logicals = [np.stack([k, v]) for k, v in pairs]  # copies, for the reference only
    kv = layout_of(logicals, None, separate=pairs)
    ids = [4, 1]
    out = np.zeros((len(ids), LAYERS, 2, TOKENS, HEADS, DIM), dtype=np.uint16)
    kv.gather(ids, out.ctypes.data)
    np.testing.assert_array_equal(out, reference(logicals, ids))
    out2 = out[::-1].copy()
    kv.scatter(ids, out2.ctypes.data)
    np.testing.assert_array_equal(pairs[2][1][4], out2[0, 2, 1])
    np.testing.assert_array_equal(pairs[0][0][1], out2[1, 0, 0])


def test_bad_input_is_a_value_error_naming_the_value():
    full, logical = paged(ORDERS["nhd"], np.uint16, seed=1)
    kv = layout_of([logical], [full])
    out = np.zeros(kv.block_bytes * 2, dtype=np.uint8)
    with pytest.raises(ValueError, match="block id 10"):
        kv.gather([0, 10], out.ctypes.data)
    with pytest.raises(ValueError, match="block id 3 appears twice"):
        kv.scatter([3, 3], out.ctypes.data)
    with pytest.raises(ValueError, match="2 block ids for 1 block pointers"):
        kv.gather([0, 1], [out.ctypes.data])
    with pytest.raises(ValueError, match="block pointer 1 .* is null"):
        kv.gather([0, 1], [out.ctypes.data, 0])
    with pytest.raises(ValueError, match="address 0 is null"):
        kv.gather([0], 0)
    args = dict(num_blocks=BLOCKS, num_kv_heads=HEADS, head_dim=DIM, tokens_per_block=TOKENS,
                element_size=2)
    good = strides_of(logical)
    with pytest.raises(ValueError, match="past its size_bytes 100"):
        proxima.KvLayout(layers=[(logical.ctypes.data, 0, 100, 0)], strides=good, **args)
    with pytest.raises(ValueError, match="stride 8 of axis 'token'"):
        proxima.KvLayout(layers=[(logical.ctypes.data, 0, 0, 0)],
                         strides=(good[0], good[1], 8, good[3], good[4]), **args)
    with pytest.raises(ValueError, match="layer 0: null data"):
        proxima.KvLayout(layers=[(0, 0, 0, 0)], strides=good, **args)
    with pytest.raises(ValueError, match="element_size 3"):
        proxima.KvLayout(layers=[(logical.ctypes.data, 0, 0, 0)], strides=good,
                         **{**args, "element_size": 3})


@pytest.mark.skipif(proxima.KV_LAYOUT_CUDA, reason="module built with CUDA: device=True runs the "
                    "kernel (covered by kernels_kv_layout_cuda_test on a GPU)")
def test_device_layout_without_cuda_says_why():
    full, logical = paged(ORDERS["nhd"], np.uint16, seed=1)
    layers = [(logical.ctypes.data, 0, full.nbytes, 0)]
    kv = proxima.KvLayout(layers=layers, strides=strides_of(logical), num_blocks=BLOCKS,
                          num_kv_heads=HEADS, head_dim=DIM, tokens_per_block=TOKENS,
                          element_size=2, device=True)
    out = np.zeros(kv.block_bytes, dtype=np.uint8)
    with pytest.raises(proxima.Error, match="built without CUDA"):
        kv.gather([0], out.ctypes.data)
