"""The plain-PyTorch references as backends (any mask, any dtype, fwd and bwd, with lse)."""

from __future__ import annotations

from longca_triton.reference import chunked_attention, naive_attention

from .base import Backend, Problem, register


class NaiveReference(Backend):
    name = "reference"
    description = "naive PyTorch attention (materialised scores), any mask; memory O(S^2)"

    def supports(self, problem: Problem):
        cells = problem.batch * problem.heads_q * problem.seqlen_q * problem.seqlen_k
        if cells > 2**31:
            return False, f"materialises {cells:.2e} scores; use reference-chunked"
        return True, ""

    def attention(self, q, k, v, mask, softmax_scale=None, return_lse=False):
        return naive_attention(q, k, v, mask, softmax_scale, return_lse)


class ChunkedReference(Backend):
    name = "reference-chunked"
    description = "chunked online-softmax PyTorch attention, any mask; memory O(S·D)"

    def attention(self, q, k, v, mask, softmax_scale=None, return_lse=False):
        return chunked_attention(q, k, v, mask, softmax_scale, return_lse)


register(NaiveReference())
register(ChunkedReference())
