"""A small GPT-style byte-level language model: the built-in trainer's model, nanoGPT in miniature.

It reads top-down: config, attention, MLP, block, the model, then the helpers the trainer needs (loss, the
export of the config into the final checkpoint, the split into DiLoCo fragments). It exists so a DiLoCo run
trains something real, with no download, on any machine: the vocabulary is the 256 byte values.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
from torch.nn import functional as F

#: Bytes are the vocabulary, so every machine has the same one and no tokenizer file is needed.
VOCAB_SIZE = 256


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model. Exported as JSON into the final checkpoint, so ``collect`` can rebuild it."""

    block_size: int = 64  # context length in bytes
    vocab_size: int = VOCAB_SIZE
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    dropout: float = 0.0  # 0 keeps replicas' forward passes deterministic and the tiny model unregularised

    def __post_init__(self) -> None:
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head}): "
                "each head gets n_embd // n_head channels"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> GPTConfig:
        """Rebuild from ``to_json``; unknown keys are ignored so older readers survive newer writers."""
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only itself and the past."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        # One projection for query, key and value of all heads: one matmul instead of three.
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim): heads become a batch dimension.
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # The fused kernel applies the causal mask itself, so the model holds no mask buffer (nothing but
        # parameters crosses the store).
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    """Position-wise feed-forward with the usual 4x expansion."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: residual stream + attention, then + MLP."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embeddings, ``n_layer`` blocks, final norm, linear head over the 256 bytes.

    No weight tying between the embedding and the head (nanoGPT ties them): with a 256-entry vocabulary it
    saves almost nothing, and untied weights serialise to safetensors without shared-storage special cases.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        # Residual projections get a smaller init so the residual stream's variance does not grow with depth,
        # per the GPT-2 paper.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``(B, T, vocab)`` and, when ``targets`` is given, the mean next-byte cross-entropy."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_model(config: GPTConfig, *, seed: int, device: str | torch.device = "cpu") -> GPT:
    """A freshly initialised model that depends only on ``config`` and ``seed``.

    DiLoCo needs every replica to start from the same weights; building them from a common seed avoids a
    broadcast. The global RNG is left as it was, so what ran before cannot change the weights. The lock makes
    that hold for ranks run as threads of one process too (tests do that): they would otherwise reseed and draw
    from the one global RNG at the same time and start from different weights.
    """
    with _GLOBAL_RNG, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(config)
    return model.to(device)


#: Serialises the reseed-and-draw of ``build_model`` across threads.
_GLOBAL_RNG = threading.Lock()


def split_fragments(model: GPT, n: int) -> list[nn.Module]:
    """Split ``model`` into ``n`` contiguous fragments for Streaming DiLoCo, covering every parameter once.

    The units, in forward order, are: embeddings, each block, final norm + head. Contiguous groups of units
    become one fragment each (an ``nn.ModuleList`` view: parameters are shared with ``model``, not copied).
    """
    units: list[nn.Module] = [
        nn.ModuleList([model.transformer.wte, model.transformer.wpe]),
        *model.transformer.h,
        nn.ModuleList([model.transformer.ln_f, model.lm_head]),
    ]
    if not 1 <= n <= len(units):
        raise ValueError(
            f"fragments must be between 1 and {len(units)} (n_layer + 2) for this model, got {n}"
        )
    if n == 1:
        return [model]
    # Spread the units as evenly as possible: the first (len % n) fragments get one extra.
    per, extra = divmod(len(units), n)
    out: list[nn.Module] = []
    start = 0
    for i in range(n):
        size = per + (1 if i < extra else 0)
        out.append(nn.ModuleList(units[start : start + size]))
        start += size
    return out
