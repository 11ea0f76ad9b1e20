"""The recurrent layers' torch references (`TorchOps`, the exact path): the gated delta rule's and Mamba2's scan's
chunked forms (prefill) against their recurrences (decode), and both against transformers' own torch
implementations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpullama.ops.torch_ops import (
    _expand_heads,
    _l2norm,
    chunked_delta_rule,
    chunked_ssm_scan,
    recurrent_delta_rule,
    recurrent_ssm_scan,
)


def delta_inputs(n: int, hk: int, hv: int, dk: int, dv: int, seed: int = 0):
    """Random rows of one sequence, as the decoder hands them over: q, k ``[n, hk, dk]``, v ``[n, hv, dv]``, decay
    (log space, <= 0) and beta ``[n, hv]``, an initial state ``[hv, dk, dv]``."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n, hk, dk, generator=g), torch.randn(n, hk, dk, generator=g)
    v = torch.randn(n, hv, dv, generator=g)
    decay = -F.softplus(torch.randn(n, hv, generator=g))
    beta = torch.sigmoid(torch.randn(n, hv, generator=g))
    return q, k, v, decay, beta, torch.randn(hv, dk, dv, generator=g) * 0.3


def normalized(q: torch.Tensor, k: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as the rule reads them: L2-normalized, q scaled by dk^-0.5, each value head's key head."""
    return _expand_heads(_l2norm(q) * q.shape[-1] ** -0.5, heads), _expand_heads(_l2norm(k), heads)


@pytest.mark.parametrize("n", [1, 63, 64, 150])
def test_chunked_form_equals_the_recurrence(n: int) -> None:
    """Over chunks of 64 (a partial last one, exactly one, several, a single row), from a non-zero state: the
    outputs and the final state of the chunked form equal the row-by-row recurrence within float32 rounding."""
    q, k, v, decay, beta, state = delta_inputs(n, 2, 4, 16, 24)
    q, k = normalized(q, k, 4)
    out, new_state = chunked_delta_rule(q, k, v, decay, beta, state)
    want, want_state = recurrent_delta_rule(q, k, v, decay, beta, state[None])
    assert (out - want).abs().max() < 2e-5 * want.abs().max()
    assert (new_state - want_state[0]).abs().max() < 2e-5 * want_state.abs().max()


def test_both_forms_equal_transformers() -> None:
    """transformers' `torch_chunk_gated_delta_rule` and `torch_recurrent_gated_delta_rule` (Qwen3.5's, with its
    L2 norm in the kernel) on the same rows (one key head a value head: their grouped order and the converter's
    tiled one then agree) give our outputs and final state."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    q, k, v, decay, beta, state = delta_inputs(100, 4, 4, 16, 16, seed=1)
    qn, kn = normalized(q, k, 4)
    out, new_state = chunked_delta_rule(qn, kn, v, decay, beta, state)
    step_out, step_state = recurrent_delta_rule(qn, kn, v, decay, beta, state[None])
    for reference, got, got_state in ((hf.torch_chunk_gated_delta_rule, out, new_state),
                                      (hf.torch_recurrent_gated_delta_rule, step_out, step_state[0])):
        want, want_state = reference(q[None], k[None], v[None], g=decay[None], beta=beta[None],
                                     initial_state=state[None], output_final_state=True,
                                     use_qk_l2norm_in_kernel=True)
        assert (got - want[0]).abs().max() < 2e-5 * want.abs().max()
        assert (got_state - want_state[0]).abs().max() < 2e-5 * want_state.abs().max()


def ssm_inputs(n: int, heads: int, groups: int, p: int, state_size: int, seed: int = 0):
    """Random rows of one sequence, as the decoder hands them to Mamba2's scan: x ``[n, heads, p]``, dt ``[n,
    heads]`` (after softplus), a ``[heads]`` (negative), b and c ``[n, groups, state_size]``, an initial state
    ``[heads, state_size, p]``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, p, generator=g)
    dt = F.softplus(torch.randn(n, heads, generator=g))
    a = -torch.exp(torch.randn(heads, generator=g))
    b, c = torch.randn(n, groups, state_size, generator=g), torch.randn(n, groups, state_size, generator=g)
    return x, dt, a, b, c, torch.randn(heads, state_size, p, generator=g) * 0.3


@pytest.mark.parametrize("n", [1, 63, 64, 150])
def test_chunked_ssm_scan_equals_the_recurrence(n: int) -> None:
    """Mamba2's scan over chunks of 64 (a partial last one, exactly one, several, a single row), from a non-zero
    state: the chunked form's outputs and final state equal the row-by-row recurrence within float32 rounding."""
    x, dt, a, b, c, state = ssm_inputs(n, 4, 2, 24, 16)
    b, c = b.repeat_interleave(2, dim=1), c.repeat_interleave(2, dim=1)
    out, new_state = chunked_ssm_scan(x, dt, a, b, c, state)
    want, want_state = recurrent_ssm_scan(x, dt, a, b, c, state[None])
    assert (out - want).abs().max() < 2e-5 * want.abs().max()
    assert (new_state - want_state[0]).abs().max() < 2e-5 * want_state.abs().max()


def test_ssm_scan_equals_transformers() -> None:
    """transformers' Mamba2 torch scans (GraniteMoeHybrid's `mamba2_chunk_scan` for prefill, from an initial
    state, and `mamba2_selective_state_update` for one decode step; 2 groups for 4 heads: its repeat_interleave
    order) give `TorchOps.ssm_scan`'s outputs and final states (theirs ``[heads, P, N]``, ours ``[heads, N, P]``)."""
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as hf

    from gpullama.ops import TorchOps
    from tests.kernel_tests.test_cpu_native import make_meta

    x, dt, a, b, c, state = ssm_inputs(101, 4, 2, 24, 16, seed=1)
    ops = TorchOps(torch.device("cpu"))
    states = torch.stack([torch.zeros_like(state), state])  # slot 1: the sequence's, after 5 earlier rows
    out = ops.ssm_scan(x[:100], dt[:100], a, b[:100], c[:100], states, make_meta([105], [100], slots=[1]))
    want, want_state = hf.mamba2_chunk_scan(x[None, :100], dt[None, :100], a, b[None, :100], c[None, :100],
                                            chunk_size=32, initial_states=state.transpose(-1, -2)[None],
                                            return_final_states=True)
    assert (out - want[0]).abs().max() < 2e-5 * want.abs().max()
    assert (states[1] - want_state[0].transpose(-1, -2)).abs().max() < 2e-5 * want_state.abs().max()
    step = ops.ssm_scan(x[100:], dt[100:], a, b[100:], c[100:], states, make_meta([106], [1], slots=[1]))
    hf_state = want_state.clone()
    want = hf.mamba2_selective_state_update(hf_state, x[100:], dt[100:, :, None].expand(-1, -1, 24),
                                            a[:, None, None].expand(-1, 24, 16), b[100:], c[100:])
    assert (step - want).abs().max() < 2e-5 * want.abs().max()
    assert (states[1] - hf_state[0].transpose(-1, -2)).abs().max() < 2e-5 * hf_state.abs().max()
