"""What a key is made of: the namespace of one model layout and rank, and the
``extra`` bytes mixed into every block hash of a request. No engine or torch import.

Every engine instance of one model layout and rank must agree on these, in every
process and on every host (see DESIGN.md, "Key"), and two different models (or
weights, or adapters, or prompts) must never agree by accident.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from ..keys import MAX_NAMESPACE_LEN, check_namespace

STATE_KIND = "state"
# Bump when the bytes of a stored block (or the way keys are made) change meaning,
# so old entries become misses instead of wrong hits.
FORMAT_VERSION = 2

_BAD = re.compile(r"[^A-Za-z0-9._:+=@-]")


def _segment(text: str, limit: int = 64) -> str:
    """One namespace segment from free text: bad characters become '_', a leading
    '.' is dropped, and a long text keeps its head plus a short hash of the whole."""
    seg = _BAD.sub("_", text).lstrip(".") or "_"
    if not seg[0].isalnum() and seg[0] != "_":
        seg = "_" + seg
    if len(seg) > limit:
        seg = f"{seg[: limit - 17]}-{xxhash.xxh3_64_hexdigest(text.encode())}"
    return seg


@dataclass(slots=True, frozen=True)
class ModelIdentity:
    """Everything that decides which weights produced a block.

    ``model``: an index repo ("org/name") or a path; ``revision``: the repo revision
    (commit, tag or branch; None = the default branch); ``quantization``: the
    weights' quantization method (None = unquantized). A path is identified by the
    whole path (two checkpoints ``/ckpt/a/final`` and ``/ckpt/b/final`` differ);
    engines that keep one model under different paths set ``model_id`` to name it
    alike, which replaces ``model`` (and ``revision``) here."""

    model: str
    revision: str | None = None
    quantization: str | None = None

    def segment(self) -> str:
        """The model part of a namespace: readable head, plus a digest of the whole
        identity (so nothing is lost to shortening or character replacement)."""
        name = self.model.rstrip("/") or "/"
        is_path = name.startswith(("/", "./", "../", "~"))
        head = name.rsplit("/", 1)[-1] if is_path else name.replace("/", "--")
        full = "\x00".join(
            [f"v{FORMAT_VERSION}", name, self.revision or "", self.quantization or ""]
        )
        digest = xxhash.xxh3_64_hexdigest(full.encode())[:12]
        return _segment(f"{head[:40]}@{digest}")


def namespace(
    model: str | ModelIdentity,
    dtype: str,
    layout: str,
    block_tokens: int,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    kind: str = "kv",
) -> str:
    """The namespace of one model layout and rank, e.g.
    ``tiny-llama@0123456789ab/float32/l2-full2x2x64-cpu/b32/tp0of1/pp0of1``;
    ``kind="state"`` names the namespace of hybrid-model state blocks (same
    hashes, separate keys).

    Everything that changes the bytes of a block is in it: the model identity
    (name or path, revision, quantization, format version), the KV dtype, the
    layout, the block size and the rank's shard. Raises ValueError for a
    non-positive block size or a bad rank."""
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    if not (0 <= tp_rank < tp_size and 0 <= pp_rank < pp_size):
        raise ValueError(f"bad rank tp{tp_rank}of{tp_size} pp{pp_rank}of{pp_size}")
    ident = model if isinstance(model, ModelIdentity) else ModelIdentity(model)
    segs = [
        ident.segment(),
        _segment(dtype.removeprefix("torch.")),
        _segment(layout),
        f"b{block_tokens}",
        f"tp{tp_rank}of{tp_size}",
        f"pp{pp_rank}of{pp_size}",
    ]
    if kind != "kv":
        segs.append(_segment(kind))
    ns = "/".join(segs)
    if len(ns) > MAX_NAMESPACE_LEN:  # only with absurd inputs: keep it valid
        ns = f"{segs[0][:60]}/{xxhash.xxh3_64_hexdigest(ns.encode())}"
    return check_namespace(ns)


def extra_keys(
    *,
    lora: str | None = None,
    lora_path: str | None = None,
    cache_salt: str | None = None,
    mm_hashes: Sequence[str] = (),
    embeds_digest: bytes | None = None,
) -> bytes:
    """The ``extra`` bytes mixed into every block hash of a request.

    Empty when the request has none of them, so plain prompts hash the same in
    every engine. Each part is tagged and length-prefixed, so ("ab", "") and
    ("a", "b") never collide. A LoRA adapter is keyed by its name and path (two
    adapters named alike are different weights); ``embeds_digest`` is a digest of
    a prompt-embeddings request's embeddings (its token ids are all zero, so
    without it two embedding prompts would share keys). Multimodal hashes are
    mixed into every block of the request (coarser than per-placeholder, never
    wrong)."""
    out = bytearray()

    def put(tag: bytes, raw: bytes) -> None:
        out.extend(tag + struct.pack("<I", len(raw)) + raw)

    if lora:
        put(b"L", lora.encode())
        if lora_path:
            put(b"P", lora_path.encode())
    if cache_salt:
        put(b"S", cache_salt.encode())
    for h in mm_hashes:
        put(b"M", h.encode())
    if embeds_digest is not None:
        put(b"E", embeds_digest)
    return b"kvx1" + bytes(out) if out else b""


def embeds_digest(raw: bytes | memoryview, shape: Sequence[int], dtype: str) -> bytes:
    """A 16-byte digest of prompt embeddings given as raw bytes plus shape and dtype."""
    h = xxhash.xxh3_128()
    h.update(f"{dtype}:{tuple(int(s) for s in shape)}".encode())
    h.update(raw)
    return h.digest()


def rank_namespaces(
    model: str | ModelIdentity,
    dtype: str,
    layout: str,
    block_tokens: int,
    tp_size: int,
    pp_size: int,
    kind: str = "kv",
) -> list[str]:
    """The namespaces of every (tp, pp) rank of one engine, rank-major: a block is
    loadable only when every rank holds its shard, so the scheduler asks for all."""
    return [
        namespace(
            model,
            dtype,
            layout,
            block_tokens,
            tp_rank=t,
            tp_size=tp_size,
            pp_rank=p,
            pp_size=pp_size,
            kind=kind,
        )
        for p in range(pp_size)
        for t in range(tp_size)
    ]


def resolve_ranks(
    groups: tuple[int, int, int, int] | None, tp_size: int, pp_size: int
) -> tuple[int, int, int, int]:
    """A worker's (tp_rank, tp_size, pp_rank, pp_size) from the engine's process
    groups (None when they are not set up). Without groups the engine must run one
    rank; anything else raises ValueError, never a silent ``tp0of1``."""
    if groups is None:
        if tp_size == 1 and pp_size == 1:
            return 0, 1, 0, 1
        raise ValueError(
            f"kvstore connector: cannot tell this worker's rank (tensor parallel "
            f"{tp_size}, pipeline parallel {pp_size}, no process groups)"
        )
    tp, tps, pp, pps = groups
    if (tps, pps) != (tp_size, pp_size) or not (0 <= tp < tps and 0 <= pp < pps):
        raise ValueError(
            f"kvstore connector: rank tp{tp}of{tps} pp{pp}of{pps} does not match the "
            f"engine's parallel config (tp {tp_size}, pp {pp_size})"
        )
    return tp, tps, pp, pps


def sglang_shard(
    *,
    is_mla: bool,
    tp_rank: int,
    tp_size: int,
    dcp_rank: int = 0,
    dcp_size: int = 1,
    attn_cp_size: int = 1,
) -> tuple[str, int, int]:
    """Which shard of the KV an SGLang rank holds: (tag, rank, size) for its
    namespace. MLA KV is the same on every TP rank (one shared copy, ``tp0of1``)
    unless decode-context parallelism splits each page's tokens across the DCP
    group (then one copy per DCP rank, ``dcp<r>of<n>``). Attention context
    parallelism is refused (ValueError): its ranks hold token slices the keys do
    not name."""
    if attn_cp_size > 1:
        raise ValueError(
            f"kvstore HiCache backend: attention context parallelism ({attn_cp_size} ranks) "
            "splits a page's tokens across ranks; not supported"
        )
    if dcp_size > 1:
        if not is_mla:
            raise ValueError("kvstore HiCache backend: decode-context parallelism needs MLA")
        return "dcp", dcp_rank, dcp_size
    if is_mla:
        return "tp", 0, 1
    return "tp", tp_rank, tp_size
