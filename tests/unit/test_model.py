"""GPT-2 model: forward pass against a by-hand reference, causality, weight tying, presets."""

from __future__ import annotations

import math

import pytest
import torch

from edgc.models import GPT, PRESETS, GPTConfig, build_model

SMALL = GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=37, block_size=8)


@pytest.fixture(autouse=True)
def _seeded_rng():
    """Each test gets a seeded global RNG (model init uses it) and leaves the caller's
    RNG state as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        yield


def expected_num_parameters(c: GPTConfig) -> int:
    """GPT-2's parameter count with the head tied to the token embedding."""
    C = c.n_embd
    per_block = (
        2 * 2 * C  # ln_1, ln_2 (weight, bias)
        + 3 * C * C + 3 * C  # c_attn
        + C * C + C  # attn.c_proj
        + 4 * C * C + 4 * C  # c_fc
        + 4 * C * C + C  # mlp.c_proj
    )
    return c.vocab_size * C + c.block_size * C + c.n_layer * per_block + 2 * C  # + ln_f


def reference_forward(
    model: GPT, idx: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's computation redone with elementary tensor ops from its weights: no
    nn.functional, no fused attention."""
    c = model.config
    B, T = idx.shape
    hs = c.n_embd // c.n_head

    def layer_norm(x, ln):
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)  # biased, as LayerNorm uses
        return (x - mean) / torch.sqrt(var + ln.eps) * ln.weight + ln.bias

    def linear(x, lin):
        return x @ lin.weight.T + lin.bias

    def gelu_tanh(x):
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    x = model.wte.weight[idx] + model.wpe.weight[torch.arange(T)]
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    for block in model.h:
        a = layer_norm(x, block.ln_1)
        q, k, v = linear(a, block.attn.c_attn).split(c.n_embd, dim=2)
        q, k, v = (t.view(B, T, c.n_head, hs).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
        scores = scores.masked_fill(future, float("-inf"))
        weights = torch.exp(scores - scores.amax(-1, keepdim=True))
        weights = weights / weights.sum(-1, keepdim=True)
        y = (weights @ v).transpose(1, 2).reshape(B, T, c.n_embd)
        x = x + linear(y, block.attn.c_proj)
        m = gelu_tanh(linear(layer_norm(x, block.ln_2), block.mlp.c_fc))
        x = x + linear(m, block.mlp.c_proj)
    x = layer_norm(x, model.ln_f)
    logits = x @ model.wte.weight.T
    log_probs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    keep = targets != -1
    nll = -log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return logits, nll[keep].sum() / keep.sum()


def test_forward_matches_reference_in_float64():
    model = GPT(SMALL).double()
    # LayerNorms start at weight 1, bias 0 and Linear biases at 0; perturb them so the
    # reference has to apply every one correctly
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln" in name:
                p.add_(0.1 * torch.randn_like(p))
    idx = torch.randint(0, SMALL.vocab_size, (3, SMALL.block_size))
    targets = torch.randint(0, SMALL.vocab_size, (3, SMALL.block_size))
    targets[0, :3] = -1  # ignored positions

    logits, loss = model(idx, targets)
    ref_logits, ref_loss = reference_forward(model, idx, targets)

    assert logits.shape == (3, SMALL.block_size, SMALL.vocab_size)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-12)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-12)


def test_no_targets_gives_no_loss():
    model = GPT(SMALL)
    logits, loss = model(torch.zeros(2, 5, dtype=torch.long))
    assert logits.shape == (2, 5, SMALL.vocab_size)
    assert loss is None


def test_future_tokens_do_not_change_earlier_logits():
    model = GPT(SMALL).double()
    idx = torch.randint(0, SMALL.vocab_size, (2, SMALL.block_size))
    t = 5
    changed = idx.clone()
    changed[:, t] = (changed[:, t] + 1) % SMALL.vocab_size
    logits, _ = model(idx)
    logits_changed, _ = model(changed)
    torch.testing.assert_close(logits_changed[:, :t], logits[:, :t], rtol=0, atol=1e-12)
    # the changed position itself must see its new token
    assert not torch.allclose(logits_changed[:, t], logits[:, t])


def test_every_parameter_gets_a_gradient():
    """DistributedDataParallel without find_unused_parameters needs this."""
    model = GPT(SMALL)
    idx = torch.randint(0, SMALL.vocab_size, (2, SMALL.block_size))
    _, loss = model(idx, idx)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []


def test_head_is_tied_to_token_embedding_and_counted_once():
    model = GPT(SMALL)
    assert model.lm_head.weight is model.wte.weight
    params = list(model.parameters())
    assert len({id(p) for p in params}) == len(params)
    assert "lm_head.weight" not in dict(model.named_parameters())
    assert model.num_parameters() == sum(p.numel() for p in params)
    assert model.num_parameters() == expected_num_parameters(SMALL)
    assert (
        model.num_parameters(exclude_position_embedding=True)
        == expected_num_parameters(SMALL) - SMALL.block_size * SMALL.n_embd
    )


def test_gpt2_init():
    model = build_model("tiny")
    L = model.config.n_layer
    residual = model.h[0].mlp.c_proj.weight  # 128 x 512 entries
    other = model.h[0].mlp.c_fc.weight
    assert residual.std().item() == pytest.approx(0.02 / math.sqrt(2 * L), rel=0.05)
    assert other.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.count_nonzero(model.h[0].attn.c_attn.bias) == 0


@pytest.mark.parametrize(
    ("preset", "billions"),
    [("gpt2-124m", 0.124), ("gpt2-345m", 0.345), ("gpt2-2.5b", 2.5), ("gpt2-12.1b", 12.1)],
)
def test_meta_presets_have_real_shapes_and_sizes(preset, billions):
    model = build_model(preset, device="meta")
    config = PRESETS[preset]
    assert all(p.is_meta for p in model.parameters())
    n = model.num_parameters()
    assert n == expected_num_parameters(config)
    # Tied counts: 124.4M, 354.8M, 2.400B, 11.902B. The two large names match the count
    # with an untied head (2.497B, 12.082B), hence the loose tolerance.
    assert n == pytest.approx(billions * 1e9, rel=0.05)
    C = config.n_embd
    assert model.h[0].attn.c_attn.weight.shape == (3 * C, C)
    assert model.wte.weight.shape == (config.vocab_size, C)


def test_build_model_overrides_and_validation():
    model = build_model("tiny", vocab_size=300, block_size=16)
    assert model.config.vocab_size == 300 and model.config.block_size == 16
    assert PRESETS["tiny"].vocab_size != 300  # the preset itself is unchanged
    with pytest.raises(ValueError, match="sequence length 17 exceeds block_size 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ValueError, match="gpt2-huge") as info:
        build_model("gpt2-huge")
    for name in PRESETS:
        assert name in str(info.value)


def test_config_rejects_heads_that_do_not_divide_width():
    with pytest.raises(ValueError, match=r"n_embd\(10\) % n_head\(4\) = 2"):
        GPTConfig(n_layer=1, n_head=4, n_embd=10, vocab_size=5, block_size=4)
