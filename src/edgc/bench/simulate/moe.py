"""`edgc simulate --moe NAME`: the traffic of one training step of a mixture-of-experts
model per GPU, of each kind, uncompressed and with edgc's low-rank compression, and how
long each takes on its link.

Three kinds of traffic (docs/moe.md):

- the dense parameters' gradient, all-reduced over every data-parallel GPU;
- the experts' gradient, all-reduced over the expert-data-parallel group (the GPUs holding
  the same experts: dp / ep of them);
- the tokens' all-to-all: each MoE layer sends every token's hidden state to the GPUs
  holding its k experts and back, and the backward pass does the same with the
  gradients, 4 * T * k * C * (ep - 1) / ep values a layer (T tokens a GPU, C the width),
  none of it compressed by edgc.

The models are public configurations (MoE_MODELS); the layout and the network are those of
a cluster file (the paper's 64 x H100 by default), with the EP group inside a node, on
NVLink (`nvlink` bytes/s a GPU), or across nodes. Gradients compressed at rank r cost
(m + n) * r values a matrix in the int8 wire's bytes (a byte a value and a bfloat16 scale a
block of 32: edgc.comm.wire.wire_bytes), ring all-reduced like the rest. Activations travel in bf16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from edgc.bench.simulate.cluster import ClusterSpec
from edgc.bench.simulate.model import ring_allreduce_time
from edgc.comm.wire import wire_bytes

__all__ = ["MOE_MODELS", "MoEModel", "MoETraffic", "format_moe", "moe_traffic"]

@dataclass(frozen=True)
class MoEModel:
    """The shapes a mixture of experts synchronises (SwiGLU experts: three matrices each)."""

    name: str
    layers: int
    width: int  # C
    heads: int
    kv_heads: int
    vocab: int
    experts: int  # routed experts a MoE layer
    top_k: int
    expert_width: int  # F of one routed expert
    shared_experts: int = 0  # experts every token goes to (dense, in every MoE layer)
    dense_layers: int = 0  # leading layers with a dense MLP instead of experts
    dense_width: int = 0  # that MLP's width

    def attention(self) -> list[tuple[int, int]]:
        """One layer's attention matrices: q, k, v and the output projection."""
        head = self.width // self.heads
        kv = self.kv_heads * head
        return [(self.width, self.width), (kv, self.width), (kv, self.width), (self.width, self.width)]

    def dense_matrices(self) -> list[tuple[int, int]]:
        """Every matrix all-reduced over all data-parallel GPUs: embeddings, attention,
        routers, shared experts and the leading dense MLPs."""
        out = [(self.vocab, self.width), (self.vocab, self.width)]  # token embedding and (untied) head
        for layer in range(self.layers):
            out += self.attention()
            if layer < self.dense_layers:
                out += [(self.dense_width, self.width)] * 2 + [(self.width, self.dense_width)]
            else:
                out.append((self.experts, self.width))  # the router
                out += ([(self.expert_width, self.width)] * 2 + [(self.width, self.expert_width)]) * \
                    self.shared_experts
        return out

    def dense_vectors(self) -> int:
        """Elements of the norms (two a layer and the final one)."""
        return (2 * self.layers + 1) * self.width

    def expert_matrices(self, ep: int) -> list[tuple[int, int]]:
        """The routed experts' matrices one GPU holds (E / ep a layer)."""
        one = [(self.expert_width, self.width)] * 2 + [(self.width, self.expert_width)]
        return one * (self.experts // ep) * (self.layers - self.dense_layers)

    @property
    def params(self) -> int:
        return sum(m * n for m, n in self.dense_matrices() + self.expert_matrices(1)) + self.dense_vectors()


#: Public configurations: Mixtral 8x7B (few large experts) and DeepSeekMoE 16B (many small
#: ones, two shared, the first layer dense).
MOE_MODELS: dict[str, MoEModel] = {
    "mixtral-8x7b": MoEModel("mixtral-8x7b", layers=32, width=4096, heads=32, kv_heads=8, vocab=32000, experts=8,
                             top_k=2, expert_width=14336),
    "deepseek-moe-16b": MoEModel("deepseek-moe-16b", layers=28, width=2048, heads=16, kv_heads=16, vocab=102400,
                                 experts=64, top_k=6, expert_width=1408, shared_experts=2, dense_layers=1,
                                 dense_width=10944),
}


@dataclass(frozen=True)
class MoETraffic:
    """One step's traffic of one GPU, per kind: bytes sent and seconds on its link."""

    model: MoEModel
    cluster: str
    dp: int
    ep: int
    tokens: int  # a GPU's tokens a step
    rank: int
    rows: list[tuple[str, str, float, float, float, float]]  # (kind, link, bytes none, bytes edgc, s none, s edgc)

    def bottleneck(self, compressed: bool) -> str:
        """The kind of traffic that takes longest, uncompressed or compressed."""
        at = 5 if compressed else 4
        return max(self.rows, key=lambda r: r[at])[0]


def _ring(nbytes: float, n: int, bandwidth: float, latency: float) -> tuple[float, float]:
    """(bytes one GPU sends, seconds: edgc.bench.simulate.model.ring_allreduce_time) of a ring
    all-reduce of `nbytes` over n GPUs."""
    return 2 * (n - 1) / n * nbytes, ring_allreduce_time(nbytes, n, bandwidth, latency)


def _low_rank(matrices: list[tuple[int, int]], rank: int) -> int:
    """Values a set of matrices sends at `rank` (min(m, n) caps it; a matrix that would not
    shrink is sent whole)."""
    total = 0
    for m, n in matrices:
        r = min(rank, m, n)
        total += min((m + n) * r, m * n)
    return total


def moe_traffic(model: MoEModel, cluster: ClusterSpec, *, ep: int, tokens: int, rank: int = 32,
                nvlink: float = 450e9, grad_bytes: int = 2, act_bytes: int = 2) -> MoETraffic:
    """A step's traffic per GPU of `model` trained data-parallel on the cluster's GPUs (its
    tensor and pipeline layout set aside), the experts split over `ep` GPUs (inside a node
    when ep <= gpus_per_node), each GPU with `tokens` tokens, compressed at `rank`."""
    dp = cluster.gpus
    if ep < 1 or dp % ep or model.experts % ep:
        raise ValueError(f"ep({ep}) must divide the {dp} GPUs and the model's {model.experts} experts")
    share = cluster.link_sharing or cluster.gpus_per_node
    per_gpu = cluster.bandwidth / share  # (each GPU's share of its node's inter-node link)
    rows = []
    dense_vals = sum(m * n for m, n in model.dense_matrices()) + model.dense_vectors()
    # (compressed: the factors and the vectors sent whole, in the int8 wire's bytes, edgc.comm.wire)
    dense_low = wire_bytes(_low_rank(model.dense_matrices(), rank) + model.dense_vectors(), grad_bytes, "int8")
    expert_low = wire_bytes(_low_rank(model.expert_matrices(ep), rank), grad_bytes, "int8")
    for kind, vals, low, n in (
        ("dense gradient", dense_vals, dense_low, dp),
        ("expert gradient", sum(m * n for m, n in model.expert_matrices(ep)), expert_low, dp // ep),
    ):
        b0, s0 = _ring(vals * grad_bytes, n, per_gpu, cluster.latency)
        b1, s1 = _ring(low, n, per_gpu, cluster.latency)
        rows.append((kind, f"inter-node, ring of {n}", b0, b1, s0, s1))
    moe_layers = model.layers - model.dense_layers
    a2a = 4 * tokens * model.top_k * model.width * act_bytes * (ep - 1) / ep * moe_layers
    inside = ep <= cluster.gpus_per_node
    link = nvlink if inside else per_gpu
    rows.append(("token all-to-all", f"{'NVLink' if inside else 'inter-node'}, {ep} GPUs", a2a, a2a, a2a / link,
                 a2a / link))
    return MoETraffic(model, cluster.name, dp, ep, tokens, rank, rows)


def format_moe(traffic: list[MoETraffic]) -> str:
    """The markdown report of `edgc simulate --moe`."""
    out = []
    for t in traffic:
        out.append(f"## {t.model.name} ({t.model.params / 1e9:.1f}B parameters), {t.dp} GPUs of {t.cluster}, "
                   f"ep {t.ep}, {t.tokens:,} tokens a GPU a step\n")
        out.append(f"| traffic | link | MB uncompressed | MB at rank {t.rank}, int8 | ms uncompressed | "
                   f"ms at rank {t.rank} |")
        out.append("|---|---|---:|---:|---:|---:|")
        for kind, link, b0, b1, s0, s1 in t.rows:
            out.append(f"| {kind} | {link} | {b0 / 1e6:,.1f} | {b1 / 1e6:,.1f} | {s0 * 1e3:,.1f} | {s1 * 1e3:,.1f} |")
        before, after = t.bottleneck(False), t.bottleneck(True)
        out.append(f"\nThe longest uncompressed: the {before}; with edgc at rank {t.rank}: the {after}.\n")
    return "\n".join(out)


def check_tokens(tokens: int) -> int:
    if tokens < 1 or not math.isfinite(tokens):
        raise ValueError(f"--moe-tokens must be positive, got {tokens}")
    return tokens
