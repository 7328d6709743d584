"""Triton kernels of GGD-BAM attention (`@triton.jit` code only; `triton_bam.py` launches them).

Per query head h, query i at absolute position p_i and key j (stored from 0):

    b_ij   = prior table[h, p_i - j]                    (the GGD prior, built by the launcher)
    s_ij   = c_i * (q_i.k_j * scaling + b_ij)           (SSMax, ssmax_prior=True)
           = c_i * q_i.k_j * scaling + b_ij             (SSMax, ssmax_prior=False)
           = q_i.k_j * scaling + b_ij                   (no SSMax)
    out_i  = softmax_j(s_ij over visible keys) @ v      (0 for a row that sees no key)

The launcher passes c_i * scaling (QkScale) and c_i or 1 (BiasScale) per row; j is visible to i when
j <= p_i, key_valid[b, j] and document_ids[b, j] == document_ids[b, p_i].

Kernels (flash-attention style: online softmax in the log2 domain, fp32 accumulation and fp32 prior math):
- `_attention_forward_kernel`: one program per (BLOCK_M queries, batch, head), streams the visible key tiles.
- `_attention_backward_dkdv_kernel` / `_attention_backward_dq_kernel`: dk/dv per key block (looping over the
  query heads of its GQA group, so no reduction over heads is needed) and dq per query block. The dq kernel
  also writes per-row partial sums for the prior and SSMax gradients, summed afterwards in torch:
  deterministic, no float atomics.
- `_decode_split_kernel` + `_decode_combine_kernel`: split-KV for a few queries against a long cache. The query
  heads sharing a key/value head are packed into one tile, so each cache tile is read once per group; the
  per-split results are merged exactly with their log-sum-exp.

The prefill kernels visit their tiles in two loops: the tiles that need a mask (the diagonal, padded keys,
document boundaries), then the interior ones every query sees whole, without mask or distance clamp
(`_key_schedule`, `_unmasked_query_tiles`).

Every kernel reads the prior from the same per-head table over distances t = p_i - j, so the forward of any path
and the backward (which recomputes the scores against the saved log-sum-exp) agree on it exactly.

Assumptions: query_positions are strictly increasing and < Lk (as `cache_position` is), and documents are
contiguous runs of equal ids. They bound the loops and decide which tiles are interior (unmasked); the masks of
the other tiles use the exact positions and ids.

CPU testing: with TRITON_INTERPRET=1 the kernels run in Triton's interpreter. Triton fixes that choice when it
is imported, so this module imports it on first use (`import_triton`) and reads the variable at call time:
it may be set after this module was imported, as long as nothing else imported triton before.
"""

from __future__ import annotations  # kernel signatures say `tl.constexpr` before triton is imported

import importlib.util
import os
import sys


def _triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # e.g. sys.modules["triton"] = None
        return False


TRITON_AVAILABLE = _triton_installed()
# `triton` and `triton.language as tl` are imported on first use (`import_triton`), not here: Triton decides
# between its interpreter and its compiler when it is imported, so importing this module (with the package)
# must not fix that choice before a test sets TRITON_INTERPRET=1.
triton = None
tl = None

# Constants the kernels read as globals (made `tl.constexpr` on import).
KERNEL_CONSTANTS = {"LOG2E": 1.4426950408889634}


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (TRITON_INTERPRET=1), read at call time."""
    return os.environ.get("TRITON_INTERPRET") == "1"


# ----------------------------------------------------------------------------------------------------------
# Lazy triton.jit
# ----------------------------------------------------------------------------------------------------------

_TRITON_FUNCTIONS = {}  # name -> undecorated kernel or device function
_JITTED = {}  # interpret (bool) -> {name: triton.jit(function)}
_ACTIVE_MODE = [None]


def _triton_function(function):
    """Register a kernel or device function; it is wrapped by `triton.jit` on first use."""
    _TRITON_FUNCTIONS[function.__name__] = function
    return function


def activate_kernels() -> dict:
    """The kernels wrapped by `triton.jit` for the TRITON_INTERPRET setting of this call.

    `triton.jit` decides between interpreter and compiler when it wraps a function, and a kernel finds the
    device functions it calls among this module's globals. Wrapping lazily, and swapping the globals when the
    setting changes, lets a process import this module before it sets TRITON_INTERPRET=1.
    """
    import_triton()
    interpret = interpreting()
    if interpret and not _interpreter_ready():
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after triton was imported: triton.language's own reductions (tl.max, "
            "tl.sum) were then wrapped for the compiler and the interpreter cannot run them. Set it before the "
            "first `import triton` in the process."
        )
    if interpret not in _JITTED:
        _JITTED[interpret] = {name: triton.jit(fn) for name, fn in _TRITON_FUNCTIONS.items()}
    if _ACTIVE_MODE[0] != interpret:  # kernels find their device functions among this module's globals
        globals().update(_JITTED[interpret])
        _ACTIVE_MODE[0] = interpret
    return _JITTED[interpret]


def import_triton():
    """The `triton` module, imported on first use."""
    global triton, tl
    if triton is None:
        if not TRITON_AVAILABLE:
            raise RuntimeError("the fused GGD-BAM kernels need the `triton` package, which is not installed")
        import triton
        import triton.language as tl

        globals().update({name: tl.constexpr(value) for name, value in KERNEL_CONSTANTS.items()})
    return triton


def _interpreter_ready() -> bool:
    """Whether triton is (or will be) imported in interpreter mode: TRITON_INTERPRET=1 must be set before the
    first `import triton`, since triton.language's own reductions (tl.max, tl.sum) are wrapped on import."""
    if "triton.language" not in sys.modules:
        return interpreting()
    import triton.language
    import triton.runtime

    return not isinstance(triton.language.max, triton.runtime.JITFunction)


# ----------------------------------------------------------------------------------------------------------
# Device functions
# ----------------------------------------------------------------------------------------------------------
# Pointer arithmetic on batch, head and sequence offsets is int64 (512K tokens x 32 heads x 128 dims overflow
# int32). Few, coarse device functions: the interpreter re-patches triton.language on every call.


@_triton_function
def _head_pointer(base, batch, head, stride_b, stride_h):
    """Pointer to the first row of (batch, head) in a (B, H, L, D) tensor."""
    return base + tl.cast(batch, tl.int64) * stride_b + tl.cast(head, tl.int64) * stride_h


@_triton_function
def _load_tile(head, start, offsets, stride_l, dims, stride_d, row_ok, dim_ok, UPCAST: tl.constexpr):
    """Rows start + offsets of a head: (len(offsets), BLOCK_D), zero past the end and past the head size
    (head sizes are padded to a power of two)."""
    pointers = head + tl.cast(start, tl.int64) * stride_l + offsets[:, None] * stride_l + dims[None, :] * stride_d
    tile = tl.load(pointers, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:  # fp32 inputs, or the interpreter (whose bf16 arithmetic is wrong)
        tile = tile.to(tl.float32)
    return tile


@_triton_function
def _store_tile(head, start, tile, offsets, stride_l, dims, stride_d, row_ok, dim_ok):
    pointers = head + tl.cast(start, tl.int64) * stride_l + offsets[:, None] * stride_l + dims[None, :] * stride_d
    tl.store(pointers, tile.to(head.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@_triton_function
def _load_query_rows(Positions, QkScale, BiasScale, doc_row, row_index, queries, row_ok, k_len,
                     HAS_DOCS: tl.constexpr):
    """Per-query data: position (-1 past the end, so it sees nothing), natural-unit logit scales, document.

    QkScale = c_i * scaling multiplies q.k; BiasScale = c_i (ssmax_prior) or 1 multiplies the prior.
    """
    query_pos = tl.load(Positions + queries, mask=row_ok, other=-1).to(tl.int32)
    qk_scale = tl.load(QkScale + row_index, mask=row_ok, other=0.0)
    bias_scale = tl.load(BiasScale + row_index, mask=row_ok, other=0.0)
    query_doc = query_pos
    if HAS_DOCS:  # queries take the document of the key slot at their own position
        query_doc = tl.load(doc_row + tl.minimum(tl.maximum(query_pos, 0), k_len - 1), mask=row_ok, other=-1)
    return query_pos, qk_scale, bias_scale, query_doc


@_triton_function
def _load_key_columns(key_valid_row, doc_row, keys, k_len, HAS_KEY_VALID: tl.constexpr, HAS_DOCS: tl.constexpr):
    """Per-key data: whether the key exists and is not padding, and its document."""
    key_valid = keys < k_len
    key_doc = keys
    if HAS_KEY_VALID:
        key_valid = key_valid & (tl.load(key_valid_row + keys, mask=keys < k_len, other=0) != 0)
    if HAS_DOCS:
        key_doc = tl.load(doc_row + keys, mask=keys < k_len, other=-2)
    return key_valid, key_doc


@_triton_function
def _visible(query_pos, keys, key_valid, query_doc, key_doc, HAS_DOCS: tl.constexpr):
    """Causal & valid & same document; operands broadcast to a (queries, keys) or (keys, queries) tile."""
    visible = (keys <= query_pos) & key_valid
    if HAS_DOCS:
        visible = visible & (key_doc == query_doc)
    return visible


@_triton_function
def _document_span(query_doc, row_ok, HAS_DOCS: tl.constexpr):
    """Lowest and highest document of the valid queries of a block (0, 0 without documents)."""
    if HAS_DOCS:
        return (tl.min(tl.where(row_ok, query_doc, 2147483647), 0),
                tl.max(tl.where(row_ok, query_doc, -2147483647), 0))
    return 0, 0


@_triton_function
def _unmasked_key_tiles(Positions, start_m, query_doc, row_ok, doc_start_row, padding_end, key_start, key_end,
                        BLOCK_N: tl.constexpr, HAS_KEY_VALID: tl.constexpr, HAS_DOCS: tl.constexpr):
    """[interior_start, causal_end): key tiles that every query of the block sees whole, so need no mask: at or
    before the first query's position (positions increase), after the row's last padded key, and inside the
    document of the block when all its queries share one. Both bounds are multiples of BLOCK_N."""
    first_pos = tl.load(Positions + start_m).to(tl.int32)
    causal_end = tl.maximum(tl.minimum(((first_pos + 1) // BLOCK_N) * BLOCK_N, key_end), key_start)
    clean_start = key_start
    if HAS_KEY_VALID:
        clean_start = tl.maximum(clean_start, tl.load(padding_end))
    if HAS_DOCS:
        doc_low, doc_high = _document_span(query_doc, row_ok, HAS_DOCS)
        doc_start = tl.load(doc_start_row + first_pos)
        clean_start = tl.where(doc_low == doc_high, tl.maximum(clean_start, doc_start), causal_end)
    interior_start = tl.minimum(tl.cdiv(clean_start, BLOCK_N) * BLOCK_N, causal_end)
    return interior_start, causal_end


@_triton_function
def _key_schedule(Positions, start_m, query_pos, query_doc, row_ok, doc_start_row, padding_end, k_len,
                  BLOCK_N: tl.constexpr, HAS_KEY_VALID: tl.constexpr, HAS_DOCS: tl.constexpr):
    """The key tiles a block of queries visits: `masked_tiles` that need a mask (`_masked_tile_start`: the first
    `prefix_tiles` from key_start, the rest from causal_end), then [interior_start, causal_end) without one."""
    key_start, key_end = _key_range(query_pos, row_ok, doc_start_row, k_len, BLOCK_N, HAS_DOCS)
    interior_start, causal_end = _unmasked_key_tiles(Positions, start_m, query_doc, row_ok, doc_start_row,
                                                     padding_end, key_start, key_end, BLOCK_N, HAS_KEY_VALID,
                                                     HAS_DOCS)
    prefix_tiles = tl.cdiv(interior_start - key_start, BLOCK_N)
    masked_tiles = prefix_tiles + tl.cdiv(key_end - causal_end, BLOCK_N)
    return key_start, prefix_tiles, masked_tiles, interior_start, causal_end


@_triton_function
def _unmasked_query_tiles(Positions, doc_end_row, key_valid, key_doc, keys, start_n, q_len, k_len, query_start,
                          query_end, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_KEY_VALID: tl.constexpr,
                          HAS_DOCS: tl.constexpr):
    """[interior_start, interior_end): query tiles that see the whole key block, so need no mask: at or after its
    last key (p_i >= p_first + i), when no key of the block is padding and, with documents, all keys share one
    document that every query of those tiles is in (p_i <= p_last - (q_len - 1 - i) < its end). Both bounds are
    query_start plus multiples of BLOCK_M."""
    first_pos = tl.load(Positions).to(tl.int32)
    last_pos = tl.load(Positions + q_len - 1).to(tl.int32)
    interior_start = tl.maximum(start_n + BLOCK_N - 1 - first_pos, query_start)
    interior_start = tl.minimum(query_start + tl.cdiv(interior_start - query_start, BLOCK_M) * BLOCK_M, query_end)
    interior_end = query_end
    clean = start_n + BLOCK_N <= k_len
    if HAS_KEY_VALID:
        clean = clean & (tl.min(key_valid.to(tl.int32), 0) != 0)
    if HAS_DOCS:
        clean = clean & (tl.min(key_doc, 0) == tl.max(key_doc, 0))
        doc_end = tl.max(tl.load(doc_end_row + keys, mask=keys < k_len, other=0), 0)
        interior_end = tl.minimum(interior_end, doc_end - (last_pos - (q_len - 1)))
    interior_end = tl.maximum(interior_start + (interior_end - interior_start) // BLOCK_M * BLOCK_M, interior_start)
    interior_start = tl.where(clean, interior_start, query_end)
    interior_end = tl.where(clean, interior_end, query_end)
    return interior_start, interior_end


@_triton_function
def _masked_tile_start(tile, key_start, prefix_tiles, causal_end, BLOCK_N: tl.constexpr):
    """Start of the tile-th key tile that needs a mask: the prefix tiles [key_start, interior_start), then the
    diagonal ones from causal_end."""
    return tl.where(tile < prefix_tiles, key_start + tile * BLOCK_N, causal_end + (tile - prefix_tiles) * BLOCK_N)


@_triton_function
def _distance_index(query_pos, keys, table_len):
    """Index t = p_i - j into the prior tables, clamped into range (hidden entries read a valid slot)."""
    return tl.minimum(tl.maximum(query_pos - keys, 0), table_len - 1)


@_triton_function
def _online_softmax_step(scores, m_i, l_i, acc, v, DOT_PRECISION: tl.constexpr):
    """Fold a (BLOCK_M, BLOCK_N) tile of log2-domain scores (-inf where hidden) into the running softmax."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: avoid -inf - -inf
    p = tl.exp2(scores - m_safe[:, None])
    rescale = tl.exp2(m_i - m_safe)
    l_i = l_i * rescale + tl.sum(p, 1)
    acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@_triton_function
def _finish_softmax(m_i, l_i, acc):
    """Normalized output and log2-sum-exp2 per row; rows that saw no key give 0 and -inf."""
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
    return acc / l_safe[:, None], lse


@_triton_function
def _key_range(query_pos, row_ok, doc_start_row, k_len, BLOCK_N: tl.constexpr, HAS_DOCS: tl.constexpr):
    """[start, end) of the keys a block of queries can see: causal end, start of the earliest document."""
    key_end = tl.minimum(tl.max(query_pos, 0) + 1, k_len)
    key_start = key_end * 0
    if HAS_DOCS:
        slot = tl.minimum(tl.maximum(query_pos, 0), k_len - 1)
        starts = tl.load(doc_start_row + slot, mask=row_ok, other=k_len)
        key_start = (tl.min(starts, 0) // BLOCK_N) * BLOCK_N
    return key_start, key_end


@_triton_function
def _query_range(Positions, doc_end_row, keys, start_n, q_len, k_len, BLOCK_M: tl.constexpr,
                 HAS_DOCS: tl.constexpr):
    """[start, end) of the queries that can see a block of keys, for strictly increasing positions.

    p_i <= p_last - (q_len - 1 - i) bounds the first query at or after the block; p_i >= p_first + i bounds
    the last one inside the documents of the block.
    """
    first_pos = tl.load(Positions).to(tl.int32)
    last_pos = tl.load(Positions + q_len - 1).to(tl.int32)
    query_start = tl.maximum(start_n - (last_pos - (q_len - 1)), 0)
    query_start = (query_start // BLOCK_M) * BLOCK_M
    query_end = query_start * 0 + q_len
    if HAS_DOCS:
        ends = tl.load(doc_end_row + keys, mask=keys < k_len, other=0)
        query_end = tl.minimum(query_end, tl.max(ends, 0) - first_pos)
    return query_start, query_end


# ----------------------------------------------------------------------------------------------------------
# Prefill forward
# ----------------------------------------------------------------------------------------------------------


@_triton_function
def _attention_forward_kernel(
    Q, K, V, Out, Lse, PriorTable, Positions, QkScale, BiasScale, KeyValid, DocIds, DocStart, PaddingEnd,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kb, stride_kh, stride_kl, stride_kd,
    stride_vb, stride_vh, stride_vl, stride_vd,
    stride_ob, stride_oh, stride_ol, stride_od,
    num_heads, group_size, q_len, k_len, length_bucket,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_KEY_VALID: tl.constexpr, HAS_DOCS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_PRIOR: tl.constexpr = True,
):
    """Output and log2-sum-exp2 of BLOCK_M queries of one (batch, head), streaming the keys they can see.

    HAS_PRIOR=False (plain causal attention) exists only as the baseline of benchmarks/gpu_readiness.py.
    """
    start_m = tl.program_id(0) * BLOCK_M
    batch_head = tl.program_id(1)
    batch = batch_head // num_heads
    head = batch_head % num_heads
    kv_head = head // group_size

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    queries = start_m + offs_m
    row_ok = queries < q_len
    dim_ok = offs_d < HEAD_DIM
    row_index = tl.cast(batch_head, tl.int64) * q_len + queries
    key_row = tl.cast(batch, tl.int64) * k_len  # offset of this batch row in the (B, Lk) side inputs
    k_head = _head_pointer(K, batch, kv_head, stride_kb, stride_kh)
    v_head = _head_pointer(V, batch, kv_head, stride_vb, stride_vh)
    table_row = PriorTable + tl.cast(head, tl.int64) * k_len

    q = _load_tile(_head_pointer(Q, batch, head, stride_qb, stride_qh), start_m, offs_m, stride_ql, offs_d,
                   stride_qd, row_ok, dim_ok, UPCAST)  # (BLOCK_M, BLOCK_D)
    query_pos, qk_scale, bias_scale, query_doc = _load_query_rows(
        Positions, QkScale, BiasScale, DocIds + key_row, row_index, queries, row_ok, k_len, HAS_DOCS)
    qk_scale = qk_scale * LOG2E
    bias_scale = bias_scale * LOG2E

    key_start, prefix_tiles, masked_tiles, interior_start, causal_end = _key_schedule(
        Positions, start_m, query_pos, query_doc, row_ok, DocStart + key_row, PaddingEnd + batch, k_len, BLOCK_N,
        HAS_KEY_VALID, HAS_DOCS)
    table_pos = tl.where(row_ok, query_pos, k_len - 1)  # rows past the end read a valid slot, then are dropped
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for tile in range(0, masked_tiles):  # padding, document boundaries, the diagonal
        start_n = _masked_tile_start(tile, key_start, prefix_tiles, causal_end, BLOCK_N)
        keys = start_n + offs_n
        k = _load_tile(k_head, start_n, offs_n, stride_kl, offs_d, stride_kd, keys < k_len, dim_ok, UPCAST)
        v = _load_tile(v_head, start_n, offs_n, stride_vl, offs_d, stride_vd, keys < k_len, dim_ok, UPCAST)
        key_valid, key_doc = _load_key_columns(KeyValid + key_row, DocIds + key_row, keys, k_len, HAS_KEY_VALID,
                                               HAS_DOCS)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        scores = qk * qk_scale[:, None]
        if HAS_PRIOR:
            scores += tl.load(table_row + _distance_index(query_pos[:, None], keys[None, :], k_len)) * bias_scale[:, None]
        visible = _visible(query_pos[:, None], keys[None, :], key_valid[None, :], query_doc[:, None],
                           key_doc[None, :], HAS_DOCS)
        scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(scores, m_i, l_i, acc, v, DOT_PRECISION)
    for start_n in range(interior_start, causal_end, BLOCK_N):  # every key visible to every query: no mask
        offsets = start_n + offs_n
        k = _load_tile(k_head, start_n, offs_n, stride_kl, offs_d, stride_kd, offsets < k_len, dim_ok, UPCAST)
        v = _load_tile(v_head, start_n, offs_n, stride_vl, offs_d, stride_vd, offsets < k_len, dim_ok, UPCAST)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale[:, None]
        if HAS_PRIOR:  # distances p_i - j >= 0 here: no clamp
            scores += tl.load(table_row + (table_pos[:, None] - offsets[None, :])) * bias_scale[:, None]
        m_i, l_i, acc = _online_softmax_step(scores, m_i, l_i, acc, v, DOT_PRECISION)

    out, lse = _finish_softmax(m_i, l_i, acc)
    _store_tile(_head_pointer(Out, batch, head, stride_ob, stride_oh), start_m, out, offs_m, stride_ol, offs_d,
                stride_od, row_ok, dim_ok)
    tl.store(Lse + row_index, lse, mask=row_ok)


# ----------------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------------


@_triton_function
def _attention_backward_dkdv_kernel(
    Q, K, V, GradOut, GradK, GradV, Lse, Delta, PriorTable, Positions, QkScale, BiasScale, KeyValid, DocIds, DocEnd,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kb, stride_kh, stride_kl, stride_kd,
    stride_vb, stride_vh, stride_vl, stride_vd,
    stride_gb, stride_gh, stride_gl, stride_gd,
    stride_dkb, stride_dkh, stride_dkl, stride_dkd,
    stride_dvb, stride_dvh, stride_dvl, stride_dvd,
    num_heads, group_size, q_len, k_len, length_bucket,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_KEY_VALID: tl.constexpr, HAS_DOCS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dk, dv of BLOCK_N keys of one kv head, summed over the query heads of its group. Tiles are (keys, queries)."""
    start_n = tl.program_id(0) * BLOCK_N
    num_kv_heads = num_heads // group_size
    batch = tl.program_id(1) // num_kv_heads
    kv_head = tl.program_id(1) % num_kv_heads

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    keys = start_n + offs_n
    key_ok = keys < k_len
    dim_ok = offs_d < HEAD_DIM
    key_row = tl.cast(batch, tl.int64) * k_len

    k = _load_tile(_head_pointer(K, batch, kv_head, stride_kb, stride_kh), start_n, offs_n, stride_kl, offs_d,
                   stride_kd, key_ok, dim_ok, UPCAST)  # (BLOCK_N, BLOCK_D)
    v = _load_tile(_head_pointer(V, batch, kv_head, stride_vb, stride_vh), start_n, offs_n, stride_vl, offs_d,
                   stride_vd, key_ok, dim_ok, UPCAST)
    key_valid, key_doc = _load_key_columns(KeyValid + key_row, DocIds + key_row, keys, k_len, HAS_KEY_VALID,
                                           HAS_DOCS)
    query_start, query_end = _query_range(Positions, DocEnd + key_row, keys, start_n, q_len, k_len, BLOCK_M,
                                          HAS_DOCS)

    interior_start, interior_end = _unmasked_query_tiles(
        Positions, DocEnd + key_row, key_valid, key_doc, keys, start_n, q_len, k_len, query_start, query_end,
        BLOCK_M, BLOCK_N, HAS_KEY_VALID, HAS_DOCS)
    prefix_tiles = tl.cdiv(interior_start - query_start, BLOCK_M)
    masked_tiles = prefix_tiles + tl.cdiv(query_end - interior_end, BLOCK_M)

    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    for group_index in range(group_size):
        head = kv_head * group_size + group_index
        batch_head = batch * num_heads + head
        q_head = _head_pointer(Q, batch, head, stride_qb, stride_qh)
        do_head = _head_pointer(GradOut, batch, head, stride_gb, stride_gh)
        table_row = PriorTable + tl.cast(head, tl.int64) * k_len
        for tile in range(0, masked_tiles):  # the diagonal, padding, document boundaries
            start_m = _masked_tile_start(tile, query_start, prefix_tiles, interior_end, BLOCK_M)
            queries = start_m + offs_m
            row_ok = queries < q_len
            row_index = tl.cast(batch_head, tl.int64) * q_len + queries
            query_pos, qk_scale, bias_scale, query_doc = _load_query_rows(
                Positions, QkScale, BiasScale, DocIds + key_row, row_index, queries, row_ok, k_len, HAS_DOCS)
            visible_t = _visible(query_pos[None, :], keys[:, None], key_valid[:, None], query_doc[None, :],
                                 key_doc[:, None], HAS_DOCS)
            dk, dv = _dkdv_step(
                k, v, q_head, do_head, start_m, offs_m, stride_ql, stride_gl, offs_d, stride_qd, stride_gd, row_ok,
                dim_ok, table_row + _distance_index(query_pos[None, :], keys[:, None], k_len), visible_t,
                Lse + row_index, Delta + row_index, qk_scale, bias_scale, dk, dv, True, UPCAST, DOT_PRECISION)
        for start_m in range(interior_start, interior_end, BLOCK_M):  # every query sees every key: no mask
            queries = start_m + offs_m
            row_index = tl.cast(batch_head, tl.int64) * q_len + queries
            query_pos = tl.load(Positions + queries).to(tl.int32)
            qk_scale = tl.load(QkScale + row_index)
            bias_scale = tl.load(BiasScale + row_index)
            dk, dv = _dkdv_step(
                k, v, q_head, do_head, start_m, offs_m, stride_ql, stride_gl, offs_d, stride_qd, stride_gd,
                queries < q_len, dim_ok, table_row + (query_pos[None, :] - keys[:, None]), qk_scale,
                Lse + row_index, Delta + row_index, qk_scale, bias_scale, dk, dv, False, UPCAST, DOT_PRECISION)

    _store_tile(_head_pointer(GradK, batch, kv_head, stride_dkb, stride_dkh), start_n, dk, offs_n, stride_dkl,
                offs_d, stride_dkd, key_ok, dim_ok)
    _store_tile(_head_pointer(GradV, batch, kv_head, stride_dvb, stride_dvh), start_n, dv, offs_n, stride_dvl,
                offs_d, stride_dvd, key_ok, dim_ok)


@_triton_function
def _dkdv_step(k, v, q_head, do_head, start_m, offs_m, stride_ql, stride_gl, offs_d, stride_qd, stride_gd, row_ok,
               dim_ok, prior_pointers, visible_t, lse_pointers, delta_pointers, qk_scale, bias_scale, dk, dv,
               MASKED: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold one block of queries into dk, dv of the key block. Tiles are (keys, queries); prior_pointers address
    the prior table at each distance; visible_t is read only when MASKED."""
    q = _load_tile(q_head, start_m, offs_m, stride_ql, offs_d, stride_qd, row_ok, dim_ok, UPCAST)
    do = _load_tile(do_head, start_m, offs_m, stride_gl, offs_d, stride_gd, row_ok, dim_ok, UPCAST)
    lse = tl.load(lse_pointers, mask=row_ok, other=0.0)
    delta = tl.load(delta_pointers, mask=row_ok, other=0.0)
    qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
    scores_t = qk_t * (qk_scale * LOG2E)[None, :] + tl.load(prior_pointers) * (bias_scale * LOG2E)[None, :]
    # probabilities are <= 1: the clamp keeps a recomputed huge score (negative beta) from overflowing
    p_t = tl.exp2(tl.minimum(scores_t - lse[None, :], 0.0))
    if MASKED:
        p_t = tl.where(visible_t, p_t, 0.0)
    dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])  # d loss / d score
    dk += tl.dot((ds_t * qk_scale[None, :]).to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


@_triton_function
def _attention_backward_dq_kernel(
    Q, K, V, GradOut, GradQ, Lse, Delta, PriorTables, Positions, QkScale, BiasScale, KeyValid, DocIds, DocStart,
    PaddingEnd, RowGrads,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kb, stride_kh, stride_kl, stride_kd,
    stride_vb, stride_vh, stride_vl, stride_vd,
    stride_gb, stride_gh, stride_gl, stride_gd,
    stride_dqb, stride_dqh, stride_dql, stride_dqd,
    num_heads, group_size, q_len, k_len, num_rows, scaling, length_bucket,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_KEY_VALID: tl.constexpr, HAS_DOCS: tl.constexpr, PRIOR_GRADS: tl.constexpr, SSMAX_GRAD: tl.constexpr,
    SSMAX_PRIOR: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dq of BLOCK_M queries, plus per-row partial sums for the parameter gradients (RowGrads, (4, num_rows)):

    [0..2] sum_j dS_ij * d b_ij / d theta_{alpha, beta, mu}  (PriorTables[1..3]; weighted by c_i afterwards)
    [3]    sum_j dS_ij * (q.k * scaling [+ b_ij])              (d loss / d c_i; times ln n_i gives d s_h)
    """
    start_m = tl.program_id(0) * BLOCK_M
    batch_head = tl.program_id(1)
    batch = batch_head // num_heads
    head = batch_head % num_heads
    kv_head = head // group_size

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    queries = start_m + offs_m
    row_ok = queries < q_len
    dim_ok = offs_d < HEAD_DIM
    row_index = tl.cast(batch_head, tl.int64) * q_len + queries
    key_row = tl.cast(batch, tl.int64) * k_len
    k_head = _head_pointer(K, batch, kv_head, stride_kb, stride_kh)
    v_head = _head_pointer(V, batch, kv_head, stride_vb, stride_vh)
    table_row = PriorTables + tl.cast(head, tl.int64) * k_len
    table_stride = tl.cast(num_heads, tl.int64) * k_len  # from the prior table to each derivative table

    q = _load_tile(_head_pointer(Q, batch, head, stride_qb, stride_qh), start_m, offs_m, stride_ql, offs_d,
                   stride_qd, row_ok, dim_ok, UPCAST)  # (BLOCK_M, BLOCK_D)
    do = _load_tile(_head_pointer(GradOut, batch, head, stride_gb, stride_gh), start_m, offs_m, stride_gl, offs_d,
                    stride_gd, row_ok, dim_ok, UPCAST)
    query_pos, qk_scale, bias_scale, query_doc = _load_query_rows(
        Positions, QkScale, BiasScale, DocIds + key_row, row_index, queries, row_ok, k_len, HAS_DOCS)
    lse = tl.load(Lse + row_index, mask=row_ok, other=0.0)
    delta = tl.load(Delta + row_index, mask=row_ok, other=0.0)

    key_start, prefix_tiles, masked_tiles, interior_start, causal_end = _key_schedule(
        Positions, start_m, query_pos, query_doc, row_ok, DocStart + key_row, PaddingEnd + batch, k_len, BLOCK_N,
        HAS_KEY_VALID, HAS_DOCS)
    table_pos = tl.where(row_ok, query_pos, k_len - 1)  # rows past the end read a valid slot, then are dropped
    qk_scale_log2 = qk_scale * LOG2E
    bias_scale_log2 = bias_scale * LOG2E
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    grad_alpha = tl.zeros((BLOCK_M,), tl.float32)
    grad_beta = tl.zeros((BLOCK_M,), tl.float32)
    grad_mu = tl.zeros((BLOCK_M,), tl.float32)
    grad_factor = tl.zeros((BLOCK_M,), tl.float32)
    for tile in range(0, masked_tiles):  # padding, document boundaries, the diagonal
        start_n = _masked_tile_start(tile, key_start, prefix_tiles, causal_end, BLOCK_N)
        keys = start_n + offs_n
        k = _load_tile(k_head, start_n, offs_n, stride_kl, offs_d, stride_kd, keys < k_len, dim_ok, UPCAST)
        v = _load_tile(v_head, start_n, offs_n, stride_vl, offs_d, stride_vd, keys < k_len, dim_ok, UPCAST)
        key_valid, key_doc = _load_key_columns(KeyValid + key_row, DocIds + key_row, keys, k_len, HAS_KEY_VALID,
                                               HAS_DOCS)
        visible = _visible(query_pos[:, None], keys[None, :], key_valid[None, :], query_doc[:, None],
                           key_doc[None, :], HAS_DOCS)
        dq, grad_alpha, grad_beta, grad_mu, grad_factor = _dq_step(
            q, do, k, v, table_row + _distance_index(query_pos[:, None], keys[None, :], k_len), table_stride,
            visible, lse, delta, qk_scale_log2, bias_scale_log2, scaling, dq, grad_alpha, grad_beta, grad_mu, grad_factor,
            True, PRIOR_GRADS, SSMAX_GRAD, SSMAX_PRIOR, DOT_PRECISION)
    for start_n in range(interior_start, causal_end, BLOCK_N):  # every key visible to every query: no mask
        offsets = start_n + offs_n
        k = _load_tile(k_head, start_n, offs_n, stride_kl, offs_d, stride_kd, offsets < k_len, dim_ok, UPCAST)
        v = _load_tile(v_head, start_n, offs_n, stride_vl, offs_d, stride_vd, offsets < k_len, dim_ok, UPCAST)
        dq, grad_alpha, grad_beta, grad_mu, grad_factor = _dq_step(
            q, do, k, v, table_row + (table_pos[:, None] - offsets[None, :]), table_stride,
            lse, lse, delta, qk_scale_log2, bias_scale_log2, scaling, dq, grad_alpha, grad_beta, grad_mu, grad_factor,
            False, PRIOR_GRADS, SSMAX_GRAD, SSMAX_PRIOR, DOT_PRECISION)

    _store_tile(_head_pointer(GradQ, batch, head, stride_dqb, stride_dqh), start_m, dq * qk_scale[:, None], offs_m,
                stride_dql, offs_d, stride_dqd, row_ok, dim_ok)
    if PRIOR_GRADS:
        tl.store(RowGrads + row_index, grad_alpha, mask=row_ok)
        tl.store(RowGrads + num_rows + row_index, grad_beta, mask=row_ok)
        tl.store(RowGrads + 2 * tl.cast(num_rows, tl.int64) + row_index, grad_mu, mask=row_ok)
    if SSMAX_GRAD:
        tl.store(RowGrads + 3 * tl.cast(num_rows, tl.int64) + row_index, grad_factor, mask=row_ok)


@_triton_function
def _dq_step(q, do, k, v, prior_pointers, table_stride, visible, lse, delta, qk_scale, bias_scale, scaling,
             dq, grad_alpha, grad_beta, grad_mu, grad_factor, MASKED: tl.constexpr, PRIOR_GRADS: tl.constexpr,
             SSMAX_GRAD: tl.constexpr, SSMAX_PRIOR: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold one (BLOCK_M, BLOCK_N) key tile into dq and the per-row parameter-gradient sums. qk_scale and
    bias_scale are in log2 units; prior_pointers address the prior table at each score's distance, the derivative
    tables follow at multiples of table_stride; visible is read only when MASKED."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
    prior = tl.load(prior_pointers)
    scores = qk * qk_scale[:, None] + prior * bias_scale[:, None]
    p = tl.exp2(tl.minimum(scores - lse[:, None], 0.0))  # <= 1: a recomputed huge score cannot overflow
    if MASKED:
        p = tl.where(visible, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])  # d loss / d score; exactly 0 where hidden, and the tables are finite
    dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    if PRIOR_GRADS:
        grad_alpha += tl.sum(ds * tl.load(prior_pointers + table_stride), 1)
        grad_beta += tl.sum(ds * tl.load(prior_pointers + 2 * table_stride), 1)
        grad_mu += tl.sum(ds * tl.load(prior_pointers + 3 * table_stride), 1)
    if SSMAX_GRAD:
        logits = qk * scaling
        if SSMAX_PRIOR:
            logits += prior
        grad_factor += tl.sum(ds * logits, 1)
    return dq, grad_alpha, grad_beta, grad_mu, grad_factor


# ----------------------------------------------------------------------------------------------------------
# Split-KV decode
# ----------------------------------------------------------------------------------------------------------


@_triton_function
def _decode_split_kernel(
    Q, K, V, OutPartial, LsePartial, PriorTable, Positions, QkScale, BiasScale, KeyValid, DocIds,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kb, stride_kh, stride_kl, stride_kd,
    stride_vb, stride_vh, stride_vl, stride_vd,
    num_heads, group_size, q_len, k_len, keys_per_split, num_rows,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_KEY_VALID: tl.constexpr, HAS_DOCS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Attention of all queries of one GQA group over one split of the keys: normalized partial output and lse.

    Tile rows are (query head in the group, query) pairs, so each key/value tile is loaded once per group.
    """
    split = tl.program_id(0)
    num_kv_heads = num_heads // group_size
    batch = tl.program_id(1) // num_kv_heads
    kv_head = tl.program_id(1) % num_kv_heads

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < group_size * q_len
    dim_ok = offs_d < HEAD_DIM
    queries = offs_m % q_len
    head = kv_head * group_size + offs_m // q_len  # (BLOCK_M,)
    row_index = (tl.cast(batch, tl.int64) * num_heads + head) * q_len + queries
    key_row = tl.cast(batch, tl.int64) * k_len
    k_head = _head_pointer(K, batch, kv_head, stride_kb, stride_kh)
    v_head = _head_pointer(V, batch, kv_head, stride_vb, stride_vh)

    q_rows = _head_pointer(Q, batch, head, stride_qb, stride_qh) + tl.cast(queries, tl.int64) * stride_ql
    q = tl.load(q_rows[:, None] + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)  # (BLOCK_M, BLOCK_D)
    query_pos, qk_scale, bias_scale, query_doc = _load_query_rows(
        Positions, QkScale, BiasScale, DocIds + key_row, row_index, queries, row_ok, k_len, HAS_DOCS)
    qk_scale = qk_scale * LOG2E
    bias_scale = bias_scale * LOG2E
    table_rows = PriorTable + tl.cast(head, tl.int64) * k_len  # (BLOCK_M,) one table row per tile row

    key_start = split * keys_per_split
    key_end = tl.minimum(tl.minimum(key_start + keys_per_split, tl.max(query_pos, 0) + 1), k_len)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start_n in range(key_start, key_end, BLOCK_N):
        keys = start_n + offs_n
        k = _load_tile(k_head, start_n, offs_n, stride_kl, offs_d, stride_kd, keys < k_len, dim_ok, UPCAST)
        v = _load_tile(v_head, start_n, offs_n, stride_vl, offs_d, stride_vd, keys < k_len, dim_ok, UPCAST)
        key_valid, key_doc = _load_key_columns(KeyValid + key_row, DocIds + key_row, keys, k_len, HAS_KEY_VALID,
                                               HAS_DOCS)

        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        prior = tl.load(table_rows[:, None] + _distance_index(query_pos[:, None], keys[None, :], k_len))
        scores = qk * qk_scale[:, None] + prior * bias_scale[:, None]
        visible = _visible(query_pos[:, None], keys[None, :], key_valid[None, :], query_doc[:, None],
                           key_doc[None, :], HAS_DOCS)
        scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(scores, m_i, l_i, acc, v, DOT_PRECISION)

    out, lse = _finish_softmax(m_i, l_i, acc)  # an empty or fully hidden split gives 0 and -inf
    partial_row = tl.cast(split, tl.int64) * num_rows + row_index
    tl.store(OutPartial + partial_row[:, None] * HEAD_DIM + offs_d[None, :], out,
             mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(LsePartial + partial_row, lse, mask=row_ok)


@_triton_function
def _decode_combine_kernel(
    OutPartial, LsePartial, Out, Lse,
    stride_ob, stride_oh, stride_ol, stride_od,
    num_splits, num_heads, q_len, num_rows,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out = sum_s w_s out_s with w_s = 2^(lse_s - lse), lse = log2 sum_s 2^lse_s: exactly the unsplit softmax."""
    row = tl.program_id(0)
    batch = row // (num_heads * q_len)
    head = (row // q_len) % num_heads
    query = row % q_len

    splits = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    split_ok = splits < num_splits
    dim_ok = offs_d < HEAD_DIM
    partial_row = tl.cast(splits, tl.int64) * num_rows + row

    lse_parts = tl.load(LsePartial + partial_row, mask=split_ok, other=float("-inf"))  # (BLOCK_S,)
    lse_max = tl.max(lse_parts, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse_parts - lse_max)  # 0 for empty splits
    total = tl.sum(weights, 0)
    out_parts = tl.load(OutPartial + partial_row[:, None] * HEAD_DIM + offs_d[None, :],
                        mask=split_ok[:, None] & dim_ok[None, :], other=0.0)  # (BLOCK_S, BLOCK_D)
    total_safe = tl.where(total > 0.0, total, 1.0)
    out = tl.sum(weights[:, None] * out_parts, 0) / total_safe
    lse = tl.where(total > 0.0, lse_max + tl.log2(total_safe), float("-inf"))

    out_row = _head_pointer(Out, batch, head, stride_ob, stride_oh) + tl.cast(query, tl.int64) * stride_ol
    tl.store(out_row + offs_d * stride_od, out.to(Out.dtype.element_ty), mask=dim_ok)
    tl.store(Lse + row, lse)
