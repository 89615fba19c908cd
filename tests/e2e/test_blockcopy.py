"""The block mover (connectors/blockcopy.py) on synthetic caches, torch alone: every
layout's geometry and copy plans against a reference built with index_select /
per-block slicing, host zero copy against the gather, round trips, and the CUDA
mover's stream discipline where a GPU exists (tests/gpu has the timed check)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvstore_client.connectors import blockcopy as bc  # noqa: E402

NB = 12


def _rand(shape: tuple[int, ...], dtype: object = None) -> object:
    g = torch.Generator().manual_seed(hash(shape) & 0xFFFF)
    dt = dtype or torch.bfloat16
    if dt in (torch.float32, torch.bfloat16, torch.float16):
        return torch.randn(shape, generator=g).to(dt)
    return torch.randint(0, 120, shape, generator=g, dtype=dt)


def _bytes(t: object) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def flash_attention() -> tuple[object, object]:
    """(2, nb, bs, heads, head): K/V split (FlashAttention)."""
    t = _rand((2, NB, 4, 2, 8))
    return t, lambda b: _bytes(t[0, b]) + _bytes(t[1, b])


def block_major() -> tuple[object, object]:
    """(nb, 2, bs, heads, head): vLLM's CPU / FlashInfer NHD layout."""
    t = _rand((NB, 2, 4, 2, 8))
    return t, lambda b: _bytes(t[b])


def hnd_strides() -> tuple[object, object]:
    """FlashInfer HND: logical (nb, 2, bs, heads, head), physical (nb, 2, heads, bs,
    head): the stored bytes are the logical order, as for NHD."""
    phys = _rand((NB, 2, 2, 4, 8))
    t = phys.permute(0, 1, 3, 2, 4)
    return t, lambda b: _bytes(t[b])


def kernel_split() -> tuple[object, object]:
    """(2, nb*r, kbs, heads, head) with r = 3: a hybrid model whose attention kernel
    block is a third of the engine's block."""
    t = _rand((2, NB * 3, 4, 2, 8))
    return t, lambda b: _bytes(t[0, b * 3 : b * 3 + 3]) + _bytes(t[1, b * 3 : b * 3 + 3])


def kernel_split_block_major() -> tuple[object, object]:
    t = _rand((NB * 2, 2, 4, 8), torch.float16)
    return t, lambda b: _bytes(t[b * 2 : b * 2 + 2])


def mla() -> tuple[object, object]:
    """(nb, bs, kv_lora_rank + rope_dim): one latent cache, no K/V split."""
    t = _rand((NB, 4, 40))
    return t, lambda b: _bytes(t[b])


def state_views() -> tuple[object, object]:
    """Hybrid state tensors: conv and SSM state as views into one page per block
    (strides larger than a block: the page holds both)."""
    page = torch.zeros((NB, 200), dtype=torch.float32)
    page.copy_(_rand((NB, 200), torch.float32))
    conv = page[:, :24].view(NB, 4, 6)
    return conv, lambda b: _bytes(conv[b])


def strided_blocks() -> tuple[object, object]:
    """A layout whose blocks are not one run of memory (heads outermost): a gather
    is needed even on the CPU."""
    phys = _rand((2, NB, 4, 8))  # (heads, nb, bs, head)
    t = phys.permute(1, 0, 2, 3)  # logical (nb, heads, bs, head)
    return t, lambda b: _bytes(t[b])


LAYOUTS = [flash_attention, block_major, hnd_strides, kernel_split,
           kernel_split_block_major, mla, state_views, strided_blocks]  # fmt: skip


@pytest.mark.parametrize("make", LAYOUTS, ids=lambda f: f.__name__)
def test_gather_matches_reference(make: object) -> None:
    t, ref = make()
    layer = bc.describe(t, NB)
    assert layer.nbytes == len(ref(0))
    ids = [5, 0, 11, 7]
    rows = torch.zeros((len(ids), layer.nbytes), dtype=torch.uint8)
    assert bc.HostMover().gather([layer], bc.plan([ids], "cpu"), rows).done()
    for i, b in enumerate(ids):
        assert _bytes(rows[i]) == ref(b), f"row {i} (block {b})"


@pytest.mark.parametrize("make", LAYOUTS, ids=lambda f: f.__name__)
def test_host_views_are_the_gathered_bytes(make: object) -> None:
    t, ref = make()
    layer = bc.describe(t, NB)
    dense = all(p.dense for p in layer.planes)
    assert (layer.flat is not None) == dense, layer.why_not
    if not dense:
        assert "not one run" in layer.why_not
        return
    for b in (0, 3, NB - 1):
        assert b"".join(bytes(v) for v in layer.views(b)) == ref(b)


@pytest.mark.parametrize("make", LAYOUTS, ids=lambda f: f.__name__)
def test_scatter_round_trip_touches_only_its_blocks(make: object) -> None:
    t, ref = make()
    layer = bc.describe(t, NB)
    before = {b: ref(b) for b in range(NB)}
    ids = [2, 9, 4]
    rows = torch.zeros((3, layer.nbytes), dtype=torch.uint8)
    mover = bc.HostMover()
    mover.gather([layer], bc.plan([ids], "cpu"), rows)
    # Write the rows into other blocks, then back: only the target blocks change.
    targets = [1, 6, 10]
    assert mover.scatter([layer], bc.plan([targets], "cpu"), rows).done()
    for src, dst in zip(ids, targets, strict=True):
        assert ref(dst) == before[src]
    for b in set(range(NB)) - set(targets):
        assert ref(b) == before[b]


def test_index_select_reference_for_flash_attention() -> None:
    """An independent oracle: per block, K rows then V rows from index_select."""
    t, _ = flash_attention()
    ids = torch.tensor([3, 1, 8])
    k = t[0].index_select(0, ids).reshape(3, -1)
    v = t[1].index_select(0, ids).reshape(3, -1)
    want = torch.cat([k, v], dim=1).contiguous().view(torch.uint8)
    layer = bc.describe(t, NB)
    rows = torch.empty((3, layer.nbytes), dtype=torch.uint8)
    bc.HostMover().gather([layer], bc.plan([[3, 1, 8]], "cpu"), rows)
    assert torch.equal(rows, want)


def test_nhd_hnd_and_kernel_split_store_the_same_bytes() -> None:
    """Three physical layouts of one logical cache give one value per block, so
    engines with different attention backends share their blocks."""
    logical = _rand((NB, 2, 6, 2, 8))  # (nb, 2, bs, heads, head)
    hnd = logical.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)
    fa = logical.permute(1, 0, 2, 3, 4).contiguous()  # (2, nb, bs, heads, head)
    split = fa.reshape(2, NB * 2, 3, 2, 8)  # kernel blocks of 3 tokens
    values = []
    for t in (logical, hnd, fa, split):
        layer = bc.describe(t, NB)
        rows = torch.empty((NB, layer.nbytes), dtype=torch.uint8)
        bc.HostMover().gather([layer], bc.plan([list(range(NB))], "cpu"), rows)
        values.append(_bytes(rows))
    assert len(set(values)) == 1


def test_several_layers_and_groups_in_one_value() -> None:
    """A value is layer after layer; each layer takes the block ids of its group."""
    a, ref_a = flash_attention()
    m, ref_m = mla()
    la = bc.describe(a, NB, offset=0, group=0)
    lm = bc.describe(m, NB, offset=la.nbytes, group=1)
    ids = [[1, 2], [7, 4]]
    rows = torch.empty((2, la.nbytes + lm.nbytes), dtype=torch.uint8)
    bc.HostMover().gather([la, lm], bc.plan(ids, "cpu"), rows)
    assert _bytes(rows[0]) == ref_a(1) + ref_m(7)
    assert _bytes(rows[1]) == ref_a(2) + ref_m(4)
    flat = b"".join(bytes(v) for v in bc.value_views([la, lm], ids, 1))
    assert flat == ref_a(2) + ref_m(4)


def test_mixed_dtypes_unaligned_offsets_round_trip() -> None:
    """A state value of an odd-sized bf16 tensor then a float32 one: the second
    part starts off its dtype's alignment and still round-trips."""
    conv = _rand((NB, 3), torch.bfloat16)  # 6 bytes a block
    ssm = _rand((NB, 2, 2), torch.float32)
    lc = bc.describe(conv, NB, 0)
    ls = bc.describe(ssm, NB, lc.nbytes)
    rows = torch.empty((2, lc.nbytes + ls.nbytes), dtype=torch.uint8)
    mover = bc.HostMover()
    mover.gather([lc, ls], bc.plan([[3, 5]], "cpu"), rows)
    want_c, want_s = conv[[3, 5]].clone(), ssm[[3, 5]].clone()
    mover.scatter([lc, ls], bc.plan([[0, 1]], "cpu"), rows)
    assert torch.equal(conv[[0, 1]], want_c) and torch.equal(ssm[[0, 1]], want_s)


def test_unknown_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown KV cache layout"):
        bc.describe(torch.zeros((5, 3)), 4)


def test_plan_refuses_unequal_groups() -> None:
    with pytest.raises(ValueError):
        bc.plan([[1, 2], [3]], "cpu")


def test_host_rows_and_movers_on_cpu_torch() -> None:
    """On a CPU-only torch the staging rows are plain memory (pinning raises there)
    and the mover is the host one; registering host memory is refused, not raised."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA torch: tests/gpu covers the device mover")
    rows = bc.pinned_rows(4, 64)
    assert rows.shape == (4, 64) and not rows.is_pinned()
    assert isinstance(bc.mover_for("cpu"), bc.HostMover)
    assert not bc.register_host(memoryview(bytearray(64)))
    assert not bc.capturing()


def test_tickets() -> None:
    class Slow(bc.Ticket):
        def __init__(self) -> None:
            self.polls = 0

        def done(self) -> bool:
            self.polls += 1
            return self.polls > 2

        def wait(self, timeout: float | None = None) -> bool:
            return self.done()

    s = Slow()
    both = bc.AllTickets([bc.DONE, s])
    assert not both.done() and not both.done() and both.done()
