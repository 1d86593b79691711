"""The mixture-of-experts MLP of sparse layers (``ModelArch.moe``) in torch.

As transformers' Mixtral / Qwen2-MoE / Qwen3-MoE sparse blocks compute it: router logits in the
activation type, softmax in float32, the top k (renormalised over the k when
``MoE.norm_topk_prob``), the routing weights cast to the activation type, and
sum_k w_k * down_k(act(gate_k(h)) * up_k(h)); Qwen2-MoE adds sigmoid(h @ shared_gate) * the
shared expert.

Only the routed experts are computed and read: the N*k (token, expert) routes are sorted by
expert and the experts run as grouped GEMMs over their own rows (``F.grouped_mm`` with the
groups' end offsets; an expert without rows is skipped). No host synchronisation and no Python
loop over experts in the traced forward, so it stays one graph. The grouped GEMM is a custom op
(``inferflow::grouped_mm``), as the paged attention is: Inductor's shape function of
``grouped_mm`` admits bfloat16 only (CUDA's kernel) while the CPU kernel computes every type.
On CUDA, types other than bfloat16 gather each route's expert and run a batched matmul instead
(no host sync, so CUDA graphs capture it; it copies the weights it reads).

On CPU in float32 (oneDNN present) each expert's weights are instead prepacked for oneDNN at
load, as Inductor's freezing prepacks a dense layer's, and ``inferflow::expert_linear`` runs one
packed GEMM per expert that has rows (a host loop inside the op, over the group ends). A batch of
32 tokens gives each of 8 experts ~8 rows, where MKL's unpacked GEMM runs at half the speed of
the packed one (measured, 2 cores: 8 x (8, 512) @ (512, 1024) + (8, 512) @ (512, 512): 3.5 ms
grouped_mm, 2.1 ms packed); ``benchmarks/moe_decode.py`` has the model-level figures.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from inferflow.models.checkpoint import LayerWeights
from inferflow.models.family import MoE


def _param(array: np.ndarray, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.from_numpy(np.ascontiguousarray(array)).to(device, dtype), requires_grad=False)


class SparseMoE(nn.Module):
    """One sparse layer's router (H, E), experts stacked as gate|up (E, H, 2I) and down
    (E, I, H) (on CPU in float32: each expert's (out, in) weights packed for oneDNN), and the
    shared expert where the family has one."""

    def __init__(self, moe: MoE, w: LayerWeights, dtype: torch.dtype, device: torch.device,
                 act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.act = act  # the experts' (and the shared expert's) activation
        self.num_experts, self.top_k, self.normalize = moe.num_experts, moe.top_k, moe.norm_topk_prob
        self.router = _param(w.router, dtype, device)
        experts = [w.expert(e) for e in range(moe.num_experts)]  # gate (H, I), up (H, I), down (I, H)
        gate_up = np.stack([np.concatenate([g, u], axis=1) for g, u, _ in experts])  # (E, H, 2I)
        down = np.stack([d for _, _, d in experts])  # (E, I, H)
        del experts
        # CPU float32: per expert, the (out, in) weights in oneDNN's packed layout instead of
        # the stacks (which other devices and types read)
        self.w_gate_up: nn.Parameter | None = None
        self.w_down: nn.Parameter | None = None
        self.packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        if device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available():
            self.packed = ([_packed(_param(m.T, dtype, device)) for m in gate_up],
                           [_packed(_param(m.T, dtype, device)) for m in down])
        else:
            self.w_gate_up, self.w_down = _param(gate_up, dtype, device), _param(down, dtype, device)
        self.shared: tuple[nn.Parameter, nn.Parameter, nn.Parameter] | None = None
        if moe.shared_expert:
            gate, up, down, shared_gate = w.shared_expert()
            self.shared_gate_up = _param(np.concatenate([gate, up], axis=1), dtype, device)  # (H, 2Is)
            self.shared_down = _param(down, dtype, device)  # (Is, H)
            self.shared_gate = _param(shared_gate, dtype, device)  # (H, 1)
            self.shared = (self.shared_gate_up, self.shared_down, self.shared_gate)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, H) -> routing weights (N, k) in h's type and expert ids (N, k)."""
        probs = torch.softmax((h @ self.router).float(), dim=-1)  # (N, E)
        top, index = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(h.dtype), index

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The normed MLP input (N, H) -> the MLP output (N, H) (the residual is the caller's)."""
        act, (weights, index) = self.act, self.route(h)
        experts = index.reshape(-1)  # (R,) R = N * k routes, token-major
        order = torch.argsort(experts, stable=True)  # routes grouped by expert
        routed = experts[order]  # (R,) the expert of each sorted route, ascending
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=h.device)
        counts.scatter_add_(0, routed.to(torch.int32), torch.ones_like(routed, dtype=torch.int32))
        ends = torch.cumsum(counts, 0, dtype=torch.int32)  # (E,) where each expert's rows end
        tokens = order // self.top_k  # the token of each sorted route
        if self.packed is not None:
            gate, up = expert_linear(h[tokens], ends, self.packed[0]).chunk(2, dim=-1)  # (R, I) each
            y = expert_linear(act(gate) * up, ends, self.packed[1])  # (R, H)
        else:
            assert self.w_gate_up is not None and self.w_down is not None
            gate, up = grouped_mm(h[tokens], self.w_gate_up, ends, routed).chunk(2, dim=-1)
            y = grouped_mm(act(gate) * up, self.w_down, ends, routed)
        out = torch.zeros_like(h).index_add_(0, tokens, y * weights.reshape(-1)[order, None])
        if self.shared is not None:
            gate_up, down, shared_gate = self.shared
            gate, up = (h @ gate_up).chunk(2, dim=-1)
            out = out + torch.sigmoid(h @ shared_gate) * ((act(gate) * up) @ down)
        return out


@torch.library.custom_op("inferflow::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` (R, K) grouped by expert times their expert's ``w`` (E, K, N) -> (R, N):
    expert e's rows end at ``ends[e]`` (int32, ascending); ``routed`` (R,) names each row's."""
    if x.device.type == "cpu" or x.dtype == torch.bfloat16:
        return F.grouped_mm(x, w, offs=ends)
    return torch.bmm(x[:, None], w[routed])[:, 0]


@grouped_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[2]))


def _packed(w: torch.Tensor) -> torch.Tensor:
    """A (out, in) weight in oneDNN's packed layout (what Inductor's freezing makes of one)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous())


@torch.library.custom_op("inferflow::expert_linear", mutates_args=())
def expert_linear(x: torch.Tensor, ends: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """CPU: rows of ``x`` (R, K) grouped by expert (expert e's end at ``ends[e]``) times their
    expert's oneDNN-packed (N, K) weight -> (R, N); experts without rows are not touched."""
    bounds = [0, *ends.tolist()]
    return torch.cat([torch.ops.mkldnn._linear_pointwise(x[a:b], w, None, "none", [None], "")
                      for a, b, w in zip(bounds[:-1], bounds[1:], weights, strict=True) if b > a])


@expert_linear.register_fake
def _(x: torch.Tensor, ends: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    return x.new_empty((x.shape[0], weights[0].shape[0]))
