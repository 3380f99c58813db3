"""A GPT-2 language model in one readable file.

Follows karpathy/nanoGPT's `model.py` and OpenAI's GPT-2: learned token and position
embeddings, pre-LayerNorm transformer blocks (causal self-attention, then a 4x GELU MLP),
a final LayerNorm and a language-model head whose weight is tied to the token embedding.

There is no distributed code here. Data parallelism wraps the plain module, and the
pieces a pipeline split needs are separate attributes: `wte`/`wpe` (embeddings), `h`
(an `nn.ModuleList` of blocks), `ln_f` (final norm) and `lm_head`.

With `n_expert` > 0 every block's MLP is a mixture of routed experts (edgc.models.moe).

Shapes in comments: B batch, T sequence length, C = n_embd, nh = n_head,
hs = C // nh (head size), V = vocab_size.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from edgc.models.moe import MoE, expert_width

logger = logging.getLogger(__name__)

__all__ = ["GPT", "GPTConfig", "PRESETS", "build_model"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT-2 model. Frozen so that `PRESETS` cannot be changed by accident;
    derive a variant with `dataclasses.replace`."""

    n_layer: int
    """Number of transformer blocks."""

    n_head: int
    """Attention heads per block; must divide `n_embd`."""

    n_embd: int
    """Hidden size C (width of the residual stream)."""

    vocab_size: int
    """Number of token ids the embedding and head cover."""

    block_size: int
    """Longest sequence the position embedding covers."""

    dropout: float = 0.0
    """Dropout after embeddings, attention weights, and each residual branch (0 disables)."""

    bias: bool = True
    """Biases in Linear layers and LayerNorms, as in GPT-2."""

    n_expert: int = 0
    """Routed experts in place of every block's MLP (edgc.models.moe); 0: the dense MLP."""

    top_k: int = 2
    """Experts each token goes to (with n_expert > 0)."""

    expert_width: int | None = None
    """An expert's hidden width; None: 4 * n_embd / top_k (rounded up to a multiple of 8), so
    a token's active MLP parameters match the dense block's."""

    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss added to the training loss (with n_expert > 0)."""

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd must be a multiple of n_head: "
                f"n_embd({self.n_embd}) % n_head({self.n_head}) = {self.n_embd % self.n_head}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")
        if self.n_expert < 0 or (self.n_expert and not 1 <= self.top_k <= self.n_expert):
            raise ValueError(f"GPTConfig needs n_expert >= 0 and, with experts, 1 <= top_k <= n_expert; got "
                             f"n_expert={self.n_expert}, top_k={self.top_k}")
        if self.expert_width is not None and self.expert_width <= 0:
            raise ValueError(f"GPTConfig.expert_width must be positive, got {self.expert_width}")
        if self.aux_loss_coef < 0:
            raise ValueError(f"GPTConfig.aux_loss_coef must be >= 0, got {self.aux_loss_coef}")


# The GPT-2 sizes from Radford et al. 2019 (124M, 345M), and the 2.5B and 12.1B sizes the
# EDGC paper trains. "tiny" is for CPU runs and tests; its vocab_size matches the default
# locally trained BPE (edgc.data.tokenizer.train_bpe_tokenizer, vocab_size=2048) and is
# normally overridden with the tokenizer's real vocab size.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=4, n_head=4, n_embd=128, vocab_size=2048, block_size=128),
    # "small": ~11M parameters, the largest that trains at a useful pace on a 2-core CPU;
    # its 384-wide matrices compress like real GPT-2 layers do (rank 32 keeps ~10%).
    "small": GPTConfig(n_layer=6, n_head=6, n_embd=384, vocab_size=2048, block_size=256),
    # mixtures of experts (edgc.models.moe): 8 experts, each token to 2 of them, in every block
    "tiny-moe": GPTConfig(n_layer=4, n_head=4, n_embd=128, vocab_size=2048, block_size=128, n_expert=8),
    "small-moe": GPTConfig(n_layer=6, n_head=6, n_embd=384, vocab_size=2048, block_size=256, n_expert=8),
    "gpt2-124m": GPTConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024),
    "gpt2-345m": GPTConfig(n_layer=24, n_head=16, n_embd=1024, vocab_size=50257, block_size=1024),
    "gpt2-2.5b": GPTConfig(n_layer=52, n_head=24, n_embd=1920, vocab_size=50257, block_size=1024),
    "gpt2-12.1b": GPTConfig(n_layer=76, n_head=28, n_embd=3584, vocab_size=50257, block_size=1024),
}


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t attends to positions <= t only."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        # query, key and value projections for all heads in one matmul
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        # output projection; a residual projection, so _init_weights scales it down
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.is_residual_projection = True  # type: ignore[assignment]  # a bool flag, not a Tensor or Module
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # The head count is read off c_attn's output, not the config: under tensor
        # parallelism (edgc.train.tensor_parallel) c_attn holds q, k and v of this rank's
        # heads only, and nh below is that local count.
        q, k, v = self.c_attn(x).chunk(3, dim=2)  # 3 x (B, T, nh * hs)
        hs = self.n_embd // self.n_head
        q = q.view(B, T, -1, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, -1, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, -1, hs).transpose(1, 2)  # (B, nh, T, hs)
        # softmax(q k^T / sqrt(hs) + causal mask) v, fused where the backend allows
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, T, nh * hs): heads side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network: C -> 4C -> GELU -> C."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        # GPT-2 uses the tanh approximation of GELU
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.is_residual_projection = True  # type: ignore[assignment]  # a bool flag, not a Tensor or Module
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gelu(self.c_fc(x))  # (B, T, 4C)
        return self.dropout(self.c_proj(x))  # (B, T, C)


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        width = expert_width(config.n_embd, config.top_k, config.expert_width)
        self.mlp: nn.Module = MLP(config) if not config.n_expert else MoE(
            config.n_embd, config.n_expert, config.top_k, width, config.bias, config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))  # (B, T, C)
        return x


class GPT(nn.Module):
    """GPT-2 language model.

    Every parameter takes part in every forward pass (with or without targets), so
    DistributedDataParallel needs no `find_unused_parameters`.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embedding
        self.wpe = nn.Embedding(config.block_size, config.n_embd)  # position embedding
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying (Press & Wolf 2017, as in GPT-2): the head reuses the token embedding
        # matrix, so it is one Parameter and `parameters()` yields it once. A pipeline split
        # that puts wte and lm_head on different stages has to untie or sync them itself.
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2 init: N(0, 0.02) for Linear and Embedding weights, zero biases, and
        N(0, 0.02 / sqrt(2 * n_layer)) for the projections that write into the residual
        stream (two per block), so the residual's variance does not grow with depth."""
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "is_residual_projection", False):
                std = 0.02 / math.sqrt(2 * self.config.n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, MoE):
            module.init_weights(0.02, 0.02 / math.sqrt(2 * self.config.n_layer))
        # nn.LayerNorm already starts at weight 1, bias 0

    def num_parameters(self, exclude_position_embedding: bool = False) -> int:
        """Returns the number of parameters, counting the tied embedding/head weight once.
        With `exclude_position_embedding`, leaves out `wpe` (nanoGPT's "non-embedding"
        count; the token embedding stays in because the head uses it)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_position_embedding:
            n -= self.wpe.weight.numel()
        return n

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs the model on token ids `idx` of shape (B, T), T <= block_size.

        Returns (logits, loss): logits (B, T, V) for the token after each position, and the
        mean cross-entropy against `targets` (B, T) as a scalar, or None without targets.
        Target positions equal to -1 are ignored. With experts, in training, the loss also
        holds the load-balancing term (aux_loss_coef times its sum over the blocks), and
        each MoE counts its assignments (MoE.load); otherwise it changes nothing.
        """
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds block_size {self.config.block_size}"
            )
        pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C) + (T, C) -> (B, T, C)
        for block in self.h:
            x = block(x)  # (B, T, C)
        x = self.ln_f(x)  # (B, T, C)
        logits = self.lm_head(x)  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.view(B * T, -1), targets.reshape(B * T), ignore_index=-1
            )
            if self.training and self.config.n_expert and self.config.aux_loss_coef:
                aux = [b.mlp.aux_loss for b in self.h if isinstance(b.mlp, MoE) and b.mlp.aux_loss is not None]
                if aux:  # (the load-balancing loss: training only; evaluation reports the LM loss)
                    loss = loss + self.config.aux_loss_coef * torch.stack(aux).sum().to(loss.dtype)
        return logits, loss


def build_model(
    preset: str,
    vocab_size: int | None = None,
    block_size: int | None = None,
    device: str | torch.device = "cpu",
) -> GPT:
    """Builds a freshly initialised GPT from a named preset (see `PRESETS`).

    `vocab_size` and `block_size` override the preset's values. On `device="meta"` no
    memory is allocated: the model has the real parameter shapes (e.g. for planning
    gradient compression of gpt2-12.1b) but no values, and building it is instant.
    Raises ValueError for an unknown preset.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; known presets: {', '.join(PRESETS)}")
    config = PRESETS[preset]
    if vocab_size is not None:
        config = dataclasses.replace(config, vocab_size=vocab_size)
    if block_size is not None:
        config = dataclasses.replace(config, block_size=block_size)
    # Constructing under the device context creates every parameter there directly,
    # with no CPU copy first; on "meta" the init calls are no-ops.
    with torch.device(device):
        model = GPT(config)
    logger.info(
        "built %s on %s: %s (%.2fM parameters)",
        preset, device, config, model.num_parameters() / 1e6,
    )
    return model
