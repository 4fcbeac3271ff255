"""flash_attn_varlen_func on the ragged paged kernel (inference) and on the padded flash kernel (training).

Without a gradient to compute, the packed sequences go to the ragged kernel as they lie, their rows and count
rounded up to powers of two so that changing batches reuse a few compiled shapes. Checked here against the
float64 reference (`reference.reference_varlen_attention`), with the kernels' torch ops watched through a
`torch.overrides.TorchFunctionMode`: which op a call reaches, and with what shapes. Rows no sequence owns (past
cu_seqlens_q[-1] in q, past cu_seqlens_k[-1] in k and v) hold NaN: a kernel that reads them into a result fails.
"""

import random

import pytest
import torch
from torch.overrides import TorchFunctionMode
from tpu_kernels.runtime.buckets import key_bucket, token_bucket
from tpu_kernels.testing import assert_matches

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
RAGGED_OP, FLASH_OP = "ragged_paged_attention", "flash_attention"
# The ragged op's arguments end (..., max_q_len, contiguous, window_ring).
MAX_Q_LEN = -3
CONTIGUOUS = -2


class KernelOps(TorchFunctionMode):
    """Records the attention kernels' torch op calls: (op name, each positional argument as a tensor's shape or
    the value itself). With `run=False` the ragged op returns zeros of q's shape instead of running."""

    def __init__(self, run: bool = True):
        super().__init__()
        self.run, self.calls = run, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "").split(".")[0]
        if "attention" in name:
            self.calls.append((name, tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)))
            if name == RAGGED_OP and not self.run:
                return torch.zeros_like(args[0])
        return func(*args, **(kwargs or {}))

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


def packed(q_lengths, kv_lengths, *, q_heads, kv_heads, head_dim, dtype=torch.float32, seed=0, spare_rows=2,
           requires_grad=False):
    """(q, k, v, cu_seqlens_q, cu_seqlens_k): random packed sequences, `spare_rows` rows past the last one in q and
    in k, v (NaN unless a gradient is asked for: the flash path's padding gathers them, masked)."""
    generator = torch.Generator().manual_seed(seed)
    spare = 0.0 if requires_grad else float("nan")

    def rows(lengths, heads):
        real = torch.randn(sum(lengths), heads, head_dim, generator=generator)
        return torch.cat([real, torch.full((spare_rows, heads, head_dim), spare)]).to(dtype)

    q, k, v = rows(q_lengths, q_heads), rows(kv_lengths, kv_heads), rows(kv_lengths, kv_heads)
    cumulative = [torch.tensor([0, *lengths]).cumsum(0).to(torch.int32) for lengths in (q_lengths, kv_lengths)]
    return q, k, v, *cumulative


def _sinks(q_heads, dtype=torch.float32):
    return torch.randn(q_heads, generator=torch.Generator().manual_seed(3)).to(dtype)


# q lengths, kv lengths, q_heads, kv_heads, head_dim, dtype, flash-attn options, the reference's options for them
CASES = {
    # Continuous batching's step: a prefill, a chunk of a prompt against its cache, decodes.
    "mixed-prefill-chunk-decode": ([13, 4, 1, 1], [13, 30, 9, 1], 4, 2, 64, torch.float32,
                                   dict(causal=True), dict(causal=True)),
    "one-token-requests-gqa8": ([1, 1, 1, 1, 1], [1, 7, 33, 2, 16], 8, 1, 128, torch.float32,
                                dict(causal=True), dict(causal=True)),
    "gqa3-chunks": ([4, 1, 2], [9, 1, 6], 6, 2, 64, torch.float32, dict(causal=True), dict(causal=True)),
    # Keys without queries (a sequence of no query rows), odd lengths, more queries than keys (rows that see none).
    "empty-q-odd-lengths": ([3, 0, 7, 6], [5, 11, 7, 3], 2, 2, 64, torch.float32,
                            dict(causal=True), dict(causal=True)),
    # transformers' sliding window (w - 1, w - 1) with causal, and GPT-OSS's sinks.
    "window-sinks": ([1, 9, 1], [40, 9, 3], 4, 2, 64, torch.float32,
                     dict(causal=True, window_size=(5, 5), s_aux=True),
                     dict(causal=True, sliding_window=6, sinks=True)),
    "noncausal-left-window-learnable-sink": ([5, 2], [12, 2], 2, 1, 64, torch.float32,
                                             dict(window_size=(3, -1), learnable_sink=True),
                                             dict(causal=False, sliding_window=4, sinks=True)),
    "softcap-scale-bf16": ([6, 2], [9, 2], 8, 1, 64, torch.bfloat16,
                           dict(softcap=3.0, softmax_scale=0.3), dict(causal=False, softcap=3.0, scale=0.3)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_inference_runs_the_ragged_kernel_and_matches_the_reference(kernel, case):
    q_lengths, kv_lengths, q_heads, kv_heads, head_dim, dtype, options, expected_options = CASES[case]
    q, k, v, cu_q, cu_k = packed(q_lengths, kv_lengths, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                                 dtype=dtype, seed=len(case))
    options, expected_options = dict(options), dict(expected_options)
    for name in ("s_aux", "learnable_sink"):
        if options.get(name):
            options[name] = expected_options["sinks"] = _sinks(q_heads, dtype)
    with KernelOps() as ops:
        out = kernel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(q_lengths), max(kv_lengths), **options)
    assert ops.names() == [RAGGED_OP]
    assert out.shape == q.shape and out.dtype == dtype
    expected = kernel.reference.reference_varlen_attention(q, k, v, cu_q, cu_k, **expected_options)
    assert_matches(out, expected, TOLERANCE[dtype])  # exactly zero past the last sequence


def test_shapes_reaching_the_ragged_kernel_are_rounded_and_padding_is_inert(kernel):
    """q and k rows, the sequences (int64 cumulative lengths, tensor maxima) and the query bound as the kernel gets
    them; the result equals the unpadded sequences' reference."""
    q, k, v, cu_q, cu_k = packed([17, 1, 1], [17, 40, 2], q_heads=2, kv_heads=1, head_dim=64, seed=21, spare_rows=0)
    with KernelOps() as ops:
        out = kernel.flash_attn_varlen_func(q, k, v, cu_q.long(), cu_k.long(), torch.tensor(17), torch.tensor(40),
                                            causal=True)
    ((name, arguments),) = ops.calls
    assert name == RAGGED_OP
    # 19 query rows, 59 key rows (one page of the keys as they are) and 3 sequences as 32, 128 and 16 (the fewest
    # the kernel is handed): the keys' lengths and their first rows, the page table of that page.
    assert arguments[:6] == ((32, 2, 64), (1, 128, 1, 64), (1, 128, 1, 64), (17,), (16,), (16, 1))
    assert arguments[CONTIGUOUS] is True
    assert arguments[MAX_Q_LEN] == 32  # 17 rounded up
    assert_matches(out, kernel.reference.reference_varlen_attention(q, k, v, cu_q, cu_k), 1e-5)


def test_a_decode_batch_tells_the_kernel_one_query_per_sequence(kernel):
    q, k, v, cu_q, cu_k = packed([1, 1, 1], [9, 1, 4], q_heads=4, kv_heads=2, head_dim=64, seed=22)
    with KernelOps() as ops, torch.no_grad():
        out = kernel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, 9, causal=True)
    assert ops.calls[0][1][MAX_Q_LEN] == 1
    assert_matches(out, kernel.reference.reference_varlen_attention(q, k, v, cu_q, cu_k), 1e-5)


@pytest.mark.parametrize("q_lengths, kv_lengths", [([], []), ([0, 0], [3, 4]), ([2, 1], [0, 0])],
                         ids=["no-sequence", "no-query", "no-key"])
def test_nothing_to_attend_gives_zeros_without_a_kernel(kernel, q_lengths, kv_lengths):
    q, k, v, cu_q, cu_k = packed(q_lengths, kv_lengths, q_heads=2, kv_heads=1, head_dim=64, seed=23, spare_rows=0)
    with KernelOps() as ops:
        out = kernel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(q_lengths, default=0),
                                            max(kv_lengths, default=0), causal=True)
    assert ops.calls == [] and out.shape == q.shape and not out.any()


def test_q_k_v_that_do_not_fit_are_refused_naming_them(kernel):
    """Heads, head_dim and dtypes are checked before either kernel's path, in flash-attn's names."""
    q, k, v, cu_q, cu_k = packed([2, 1], [3, 1], q_heads=4, kv_heads=2, head_dim=64, seed=27, spare_rows=0)
    cases = [
        (dict(k=k[..., :32], v=v[..., :32]), ValueError, "q and k must have the same head_dim"),
        (dict(k=k.repeat(1, 2, 1)[:, :3], v=v.repeat(1, 2, 1)[:, :3]), ValueError, "multiple of the number"),
        (dict(v=v.to(torch.bfloat16), k=k.to(torch.bfloat16)), TypeError, "q, k and v must share one dtype"),
        (dict(q=q.double()), TypeError, "q must be float32 or bfloat16"),
    ]
    for change, error, message in cases:
        arguments = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=2, max_seqlen_k=3)
        with pytest.raises(error, match=message):
            kernel.flash_attn_varlen_func(**(arguments | change))


@pytest.mark.slow
def test_a_gradient_takes_the_padded_flash_path_and_backprops(kernel):
    """With q, k, v and the sinks requiring grad the flash kernel runs (and its backward); the same call without
    grad mode runs the ragged kernel and gives the same output."""
    q, k, v, cu_q, cu_k = packed([5, 1, 3], [5, 8, 11], q_heads=4, kv_heads=2, head_dim=64, seed=24,
                                 requires_grad=True)
    sinks = _sinks(4)
    for tensor in (q, k, v, sinks):
        tensor.requires_grad_(True)
    with KernelOps() as ops:
        out = kernel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 11, causal=True, window_size=(4, 4), s_aux=sinks)
    # The flash op's gradient form (its forward, saving what the backward needs).
    assert ops.names() == [f"{FLASH_OP}_vjp_forward"], ops.names()
    expected = kernel.reference.reference_varlen_attention(q.detach(), k.detach(), v.detach(), cu_q, cu_k,
                                                           sliding_window=5, sinks=sinks.detach())
    assert_matches(out.detach(), expected, 1e-5)
    out.square().sum().backward()
    for tensor in (q, k, v, sinks):
        assert tensor.grad is not None and tensor.grad.abs().sum() > 0
    with KernelOps() as ops, torch.no_grad():
        inference = kernel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 11, causal=True, window_size=(4, 4),
                                                  s_aux=sinks)
    assert ops.names() == [RAGGED_OP]
    assert_matches(inference, out.detach().double(), 1e-5)


def serving_steps(requests: int, seed: int, *, max_tokens: int = 64, max_requests: int = 8):
    """(q lengths, kv lengths) of each step of a continuous batching run, as transformers' scheduler makes them:
    requests with prompts of 1 to 300 tokens and 8 to 64 new tokens join as others finish; a step takes at most
    `max_requests` requests and `max_tokens` query tokens, prompts in chunks against their cache, decodes one row
    over theirs."""
    rng = random.Random(seed)
    waiting = [dict(prompt=rng.randint(1, 300), new=rng.randint(8, 64), read=0, made=0) for _ in range(requests)]
    running, steps = [], []
    while waiting or running:
        running += [waiting.pop(0) for _ in range(min(len(waiting), max_requests - len(running)))]
        budget, q_lengths, kv_lengths = max_tokens, [], []
        for request in running[:max_tokens]:
            if request["read"] < request["prompt"]:
                chunk = min(budget, request["prompt"] - request["read"])
                request["read"] += chunk
                q_lengths.append(chunk)
                kv_lengths.append(request["read"])
            else:
                chunk, request["made"] = 1, request["made"] + 1
                q_lengths.append(1)
                kv_lengths.append(request["prompt"] + request["made"])
            budget -= chunk
            if budget == 0:
                break
        steps.append((q_lengths, kv_lengths))
        running = [request for request in running if request["made"] < request["new"]]
    return steps


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def test_a_serving_run_compiles_few_kernel_shapes(kernel):
    """A continuous batching run of 30 requests (200 steps, each of its own composition) reaches the
    ragged op (not run here) with few distinct argument lists: each one a compilation of the kernel."""
    steps = serving_steps(30, seed=25)
    generator = torch.Generator().manual_seed(26)
    queries = torch.randn(64, 2, 64, generator=generator)
    keys = torch.randn(sum(max(kv) for _, kv in steps), 1, 64, generator=generator)
    with KernelOps(run=False) as ops, torch.no_grad():
        for q_lengths, kv_lengths in steps:
            q, k = queries[: sum(q_lengths)], keys[: sum(kv_lengths)]
            cu_q, cu_k = (torch.tensor([0, *n]).cumsum(0).to(torch.int32) for n in (q_lengths, kv_lengths))
            kernel.flash_attn_varlen_func(q, k, k, cu_q, cu_k, max(q_lengths), max(kv_lengths), causal=True)
    assert ops.names() == [RAGGED_OP] * len(steps)
    shapes = {arguments for _, arguments in ops.calls}
    compositions = {(sum(q), sum(kv), len(q), max(q)) for q, kv in steps}
    for arguments in shapes:
        (q_rows, _, _), (_, k_rows, _, _), _, (cu_rows,) = arguments[:4]
        bound = arguments[MAX_Q_LEN]
        assert q_rows == token_bucket(q_rows) and k_rows == key_bucket(k_rows), arguments
        assert _is_power_of_two(cu_rows - 1) and bound in (1, token_bucket(bound)), arguments
    # q rows 16, 32 or 64; k rows key buckets of 128 to 2048; 16 sequences; a query bound of 1, 16, 32 or 64; few
    # combinations (the key buckets grow by half octaves: a few more than powers of two would give).
    assert len(compositions) == len(steps) > 190 and len(shapes) <= 20, (len(compositions), sorted(shapes))
