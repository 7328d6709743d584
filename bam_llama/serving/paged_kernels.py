"""Triton kernels of BAM attention over vLLM's paged KV cache (`@triton.jit` code only; paged_triton.py launches
them). Per query head h, a query at absolute position p of its request and the request's keys j <= p:

    s_pj = q_p.k_j * QkScale_p + table[h, T - 1 - p + j] * BiasScale_p      (log2 domain, online softmax)

with QkScale = c_p * scaling and BiasScale = c_p (SSMax scaling the prior), c_p * scaling and 1 (SSMax on q.k only),
or scaling and 1 (no SSMax); c_p = s_h * ln(p + 1) is computed here from the position, the table (one row per head
over distances -(T-1)..0) is built once per layer by the launcher.

The cache is vLLM's (blocks, Hkv, block_size, 2D) per-layer view in any layout (its strides are arguments): a key
j of request r sits in block BlockTable[r, j // block_size] at offset j % block_size, its key in channels [0, D),
its value in [D, 2D).

Kernels:
- `_write_cache_kernel`: the step's keys and values into their slots (slot < 0: padding, skipped).
- `_paged_prefill_kernel`: chunked prefill, any batch. A program takes BLOCK_Q queries of one request and the
  GROUP query heads of one key/value head as the BLOCK_M = BLOCK_Q x GROUP rows of its tiles (each key tile is read
  once per group), and finds its request by a binary search over the device's query_start_loc; the grid is an
  upper bound fixed by the step's sizes. Key tiles wholly visible to every row (below the first query's position)
  run without mask; the diagonal ones with.
- `_paged_decode_kernel`: split-KV decode (one query per request): a program takes one token, one key/value head
  and one of the grid's splits of the request's keys; its normalized partial output and log-sum-exp go to the
  model's `_decode_combine_kernel` (model/triton_kernels_bam.py), which merges the splits exactly.

The softmax steps are the model's (`_online_softmax_step`, `_finish_softmax`). Pointer offsets are int64.
Kernels are wrapped by `triton.jit` on first use, for the TRITON_INTERPRET setting of the call (`activate_kernels`,
as the model's kernels).
"""

from __future__ import annotations  # kernel signatures say `tl.constexpr` before triton is imported

from ..model import triton_kernels_bam as model_kernels
from ..model.triton_kernels_bam import TRITON_AVAILABLE, interpreting

tl = None  # triton.language, set by `activate_kernels`
REUSED = ("_online_softmax_step", "_finish_softmax", "_decode_combine_kernel")  # the model's device code
_FUNCTIONS = {}  # name -> undecorated kernel or device function of this module
_JITTED = {}  # interpret (bool) -> {name: triton.jit(function)}


def _paged_function(function):
    _FUNCTIONS[function.__name__] = function
    return function


def activate_kernels() -> dict:
    """This module's kernels and the model's functions they call, wrapped by `triton.jit` for this call's
    TRITON_INTERPRET setting and put among this module's globals (where kernels find their device functions)."""
    global tl
    model = model_kernels.activate_kernels()  # imports triton; refuses a wrongly imported interpreter
    interpret = interpreting()
    if interpret not in _JITTED:
        _JITTED[interpret] = {name: model_kernels.triton.jit(fn) for name, fn in _FUNCTIONS.items()}
    tl = model_kernels.tl
    constants = {name: getattr(model_kernels, name) for name in model_kernels.KERNEL_CONSTANTS}
    globals().update(constants, **{name: model[name] for name in REUSED}, **_JITTED[interpret])
    return {**_JITTED[interpret], **{name: model[name] for name in REUSED}}


# ----------------------------------------------------------------------------------------------------------
# Device functions
# ----------------------------------------------------------------------------------------------------------


@_paged_function
def _last_start_at_most(QueryStart, target, num_requests, BLOCK_Q: tl.constexpr):
    """The last request r whose start query_start_loc[r] // BLOCK_Q + r is <= target (binary search; requests are
    in order). With BLOCK_Q = 1 and no + r this would be the request of a token; see `_token_request`."""
    low = 0
    high = num_requests
    while low < high:
        middle = (low + high) // 2
        start = tl.load(QueryStart + middle) // BLOCK_Q + middle
        if start <= target:
            low = middle + 1
        else:
            high = middle
    return low - 1


@_paged_function
def _token_request(QueryStart, token, num_requests):
    """The last request r with query_start_loc[r] <= token."""
    low = 0
    high = num_requests
    while low < high:
        middle = (low + high) // 2
        if tl.load(QueryStart + middle) <= token:
            low = middle + 1
        else:
            high = middle
    return low - 1


@_paged_function
def _row_scales(SsmaxScale, head, position, scaling, HAS_SSMAX: tl.constexpr, SSMAX_PRIOR: tl.constexpr):
    """(QkScale, BiasScale) of each row, in log2 units."""
    qk_scale = scaling + position * 0.0
    bias_scale = 1.0 + position * 0.0
    if HAS_SSMAX:
        factor = tl.load(SsmaxScale + head) * tl.log((position + 1).to(tl.float32))
        qk_scale = qk_scale * factor
        if SSMAX_PRIOR:
            bias_scale = factor
    return qk_scale * LOG2E, bias_scale * LOG2E


@_paged_function
def _load_cells(Cache, block_row, keys, key_ok, kv_head, stride_cb, stride_ch, stride_cn, block_size, dims,
                dim_ok, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr):
    """Keys and values (BLOCK_N, BLOCK_D) of a request's keys `keys`, through its row of the block table."""
    blocks = tl.load(block_row + keys // block_size, mask=key_ok, other=0).to(tl.int64)
    cells = Cache + blocks * stride_cb + kv_head * stride_ch + (keys % block_size).to(tl.int64) * stride_cn
    mask = key_ok[:, None] & dim_ok[None, :]
    k = tl.load(cells[:, None] + dims[None, :], mask=mask, other=0.0)
    v = tl.load(cells[:, None] + HEAD_DIM + dims[None, :], mask=mask, other=0.0)
    if UPCAST:  # fp32 inputs, or the interpreter (whose bf16 arithmetic is wrong)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@_paged_function
def _attend_tile(q, k, v, table_rows, keys, visible, qk_scale, bias_scale, m_i, l_i, acc,
                 MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold one key tile into the rows' running softmax. table_rows: each row's pointer to the prior of key 0;
    `visible` is read only when MASKED (unmasked tiles are wholly visible to every row)."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
    if MASKED:
        prior = tl.load(table_rows[:, None] + keys[None, :], mask=visible, other=0.0)
        scores = tl.where(visible, qk * qk_scale[:, None] + prior * bias_scale[:, None], float("-inf"))
    else:
        prior = tl.load(table_rows[:, None] + keys[None, :])
        scores = qk * qk_scale[:, None] + prior * bias_scale[:, None]
    return _online_softmax_step(scores, m_i, l_i, acc, v, DOT_PRECISION)


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


@_paged_function
def _write_cache_kernel(Key, Value, Cache, Slots, stride_kt, stride_vt, stride_cb, stride_ch, stride_cn, block_size,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (tokens, Hkv): token t's key and value of one head into cache slot Slots[t] (skipped if < 0)."""
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    slot = tl.load(Slots + token).to(tl.int64)
    if slot >= 0:
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        source = tl.cast(token, tl.int64) * stride_kt + kv_head * HEAD_DIM + dims
        k = tl.load(Key + source, mask=dim_ok)
        v = tl.load(Value + tl.cast(token, tl.int64) * stride_vt + kv_head * HEAD_DIM + dims, mask=dim_ok)
        cell = Cache + (slot // block_size) * stride_cb + kv_head * stride_ch + (slot % block_size) * stride_cn
        tl.store(cell + dims, k.to(Cache.dtype.element_ty), mask=dim_ok)
        tl.store(cell + HEAD_DIM + dims, v.to(Cache.dtype.element_ty), mask=dim_ok)


@_paged_function
def _paged_prefill_kernel(
    Q, Out, Cache, BlockTable, QueryStart, SeqLens, PriorTable, SsmaxScale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ch, stride_cn, stride_bt,
    num_requests, group_size, table_len, block_size, scaling,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_SSMAX: tl.constexpr, SSMAX_PRIOR: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (T // BLOCK_Q + R, Hkv): BLOCK_Q queries of one request x the GROUP query heads of one key/value head
    (GROUP: the group padded to a power of two) against the request's keys up to the tile's last position."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    request = _last_start_at_most(QueryStart, tile, num_requests, BLOCK_Q)
    query_start = tl.load(QueryStart + request)
    query_len = tl.load(QueryStart + request + 1) - query_start
    first_query = (tile - (query_start // BLOCK_Q + request)) * BLOCK_Q
    if first_query < query_len:  # the grid is an upper bound on the tiles: the others have nothing to do
        seq_len = tl.load(SeqLens + request)
        context = seq_len - query_len  # positions before this step's queries (cached, prefix hits included)

        rows = tl.arange(0, BLOCK_Q * GROUP)
        query_index = first_query + rows // GROUP
        in_group = rows % GROUP
        row_ok = (query_index < query_len) & (in_group < group_size)
        query_index = tl.minimum(query_index, query_len - 1)  # rows past the end read a valid query, then are dropped
        head = kv_head * group_size + tl.minimum(in_group, group_size - 1)
        position = context + query_index
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        tokens = (query_start + query_index).to(tl.int64)

        q = tl.load(Q + tokens[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        qk_scale, bias_scale = _row_scales(SsmaxScale, head, position, scaling, HAS_SSMAX, SSMAX_PRIOR)
        table_rows = PriorTable + head.to(tl.int64) * table_len + (table_len - 1 - position)  # + j: prior of key j
        block_row = BlockTable + tl.cast(request, tl.int64) * stride_bt

        m_i = tl.full((BLOCK_Q * GROUP,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_Q * GROUP,), tl.float32)
        acc = tl.zeros((BLOCK_Q * GROUP, BLOCK_D), tl.float32)
        offsets = tl.arange(0, BLOCK_N)
        interior_end = ((context + first_query + 1) // BLOCK_N) * BLOCK_N  # keys every row of the tile sees
        for start in range(0, interior_end, BLOCK_N):
            keys = start + offsets
            k, v = _load_cells(Cache, block_row, keys, keys < interior_end, kv_head, stride_cb, stride_ch, stride_cn,
                               block_size, dims, dim_ok, HEAD_DIM, UPCAST)
            m_i, l_i, acc = _attend_tile(q, k, v, table_rows, keys, row_ok, qk_scale, bias_scale, m_i, l_i, acc,
                                         False, DOT_PRECISION)
        key_end = context + tl.minimum(first_query + BLOCK_Q, query_len)  # one past the tile's last position
        for start in range(interior_end, key_end, BLOCK_N):  # the diagonal
            keys = start + offsets
            key_ok = keys < key_end
            k, v = _load_cells(Cache, block_row, keys, key_ok, kv_head, stride_cb, stride_ch, stride_cn, block_size,
                               dims, dim_ok, HEAD_DIM, UPCAST)
            visible = (keys[None, :] <= position[:, None]) & key_ok[None, :]
            m_i, l_i, acc = _attend_tile(q, k, v, table_rows, keys, visible, qk_scale, bias_scale, m_i, l_i, acc,
                                         True, DOT_PRECISION)
        out, lse = _finish_softmax(m_i, l_i, acc)
        tl.store(Out + tokens[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@_paged_function
def _paged_decode_kernel(
    Q, OutPartial, LsePartial, Cache, BlockTable, QueryStart, SeqLens, PriorTable, SsmaxScale,
    stride_qt, stride_qh, stride_cb, stride_ch, stride_cn, stride_bt,
    num_requests, num_tokens, num_heads, group_size, table_len, block_size, scaling,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SSMAX: tl.constexpr, SSMAX_PRIOR: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid (T, Hkv, splits), every request one query (at position seq_len - 1): the query heads of one key/value
    head as the ROWS rows of the tiles (ROWS >= 16 for tl.dot, the extra ones idle) over one split of the request's keys. Writes the
    normalized partial output and log2-sum-exp2 of row (split, head * T + token); a token of no request (padding)
    and an empty split write 0 and -inf."""
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    request = _token_request(QueryStart, token, num_requests)
    real = token < tl.load(QueryStart + num_requests)
    seq_len = tl.where(real, tl.load(SeqLens + request), 0)
    position = tl.maximum(seq_len - 1, 0)

    rows = tl.arange(0, ROWS)
    row_ok = rows < group_size
    head = kv_head * group_size + tl.minimum(rows, group_size - 1)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    query_ok = rows < tl.where(real, group_size, 0)  # a padding token has no query to read
    q = tl.load(Q + tl.cast(token, tl.int64) * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=query_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    qk_scale, bias_scale = _row_scales(SsmaxScale, head, position + rows * 0, scaling, HAS_SSMAX, SSMAX_PRIOR)
    table_rows = PriorTable + head.to(tl.int64) * table_len + (table_len - 1 - position)
    block_row = BlockTable + tl.cast(request, tl.int64) * stride_bt

    per_split = tl.cdiv(tl.cdiv(seq_len, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    key_start = split * per_split
    key_end = tl.minimum(key_start + per_split, seq_len)
    m_i = tl.full((ROWS,), float("-inf"), tl.float32)
    l_i = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, BLOCK_D), tl.float32)
    offsets = tl.arange(0, BLOCK_N)
    for start in range(key_start, key_end, BLOCK_N):
        keys = start + offsets
        key_ok = keys < key_end
        k, v = _load_cells(Cache, block_row, keys, key_ok, kv_head, stride_cb, stride_ch, stride_cn, block_size,
                           dims, dim_ok, HEAD_DIM, UPCAST)
        visible = row_ok[:, None] & key_ok[None, :]
        m_i, l_i, acc = _attend_tile(q, k, v, table_rows, keys, visible, qk_scale, bias_scale, m_i, l_i, acc,
                                     True, DOT_PRECISION)
    out, lse = _finish_softmax(m_i, l_i, acc)
    partial_row = tl.cast(split, tl.int64) * num_heads * num_tokens + head.to(tl.int64) * num_tokens + token
    tl.store(OutPartial + partial_row[:, None] * HEAD_DIM + dims[None, :], out, mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(LsePartial + partial_row, lse, mask=row_ok)
