"""BERT encoders (BertModel checkpoints: sentence-transformers' all-MiniLM-L6-v2 and its kind), served for pooling:
bidirectional attention within each sequence, post-norm layers, learned absolute positions.

An encoder keeps no KV cache: every sequence runs whole in one step (the engine schedules it so), the step's
sequences packed back to back as for a decoder. Each layer's attention is one SDPA call over the step's sequences
padded to the longest, keys past a sequence's end masked. The modules keep transformers' names, so a checkpoint
loads by name.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.errors import ModelLoadError
from kvserve.model.layers import Linear, VocabEmbedding, load_packed_weights, prepack_linears
from kvserve.model.model_config import ModelConfig
from kvserve.module import InferenceModule

_IGNORED = ("pooler.", "embeddings.position_ids", "cls.")


class LayerNorm(InferenceModule):
    """torch's layer norm with loaded parameters."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class DenseNorm(InferenceModule):
    """LayerNorm(x W^T + b + residual): the output of BERT's attention and of its MLP."""

    def __init__(self, in_features: int, out_features: int, eps: float):
        super().__init__()
        self.dense = Linear(in_features, out_features, bias=True)
        self.LayerNorm = LayerNorm(out_features, eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class SelfAttention(InferenceModule):
    def __init__(self, hidden: int):
        super().__init__()
        self.query = Linear(hidden, hidden, bias=True)
        self.key = Linear(hidden, hidden, bias=True)
        self.value = Linear(hidden, hidden, bias=True)


class Attention(InferenceModule):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self = SelfAttention(cfg.hidden_size)
        self.output = DenseNorm(cfg.hidden_size, cfg.hidden_size, cfg.layer_norm_eps)
        self.num_heads = cfg.num_attention_heads

    def forward(self, x: torch.Tensor, pad: PaddedBatch) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]: each sequence's tokens attend to all of its tokens."""
        heads, dim = self.num_heads, x.shape[-1] // self.num_heads
        q, k, v = (pad.to_batch(proj(x)).view(pad.batch, pad.length, heads, dim).transpose(1, 2)
                   for proj in (self.self.query, self.self.key, self.self.value))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=pad.key_mask)
        return self.output(pad.from_batch(out.transpose(1, 2).reshape(pad.batch, pad.length, -1)), x)


class Layer(InferenceModule):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.intermediate = Intermediate(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.output = DenseNorm(cfg.intermediate_size, cfg.hidden_size, cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, pad: PaddedBatch) -> torch.Tensor:
        x = self.attention(x, pad)
        return self.output(self.intermediate(x), x)


class Intermediate(InferenceModule):
    def __init__(self, hidden: int, size: int, act: str):
        super().__init__()
        if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ModelLoadError(f"BERT hidden_act {act!r} is not supported (gelu, gelu_new, gelu_pytorch_tanh)")
        self.dense = Linear(hidden, size, bias=True)
        self.approximate = "none" if act == "gelu" else "tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x), approximate=self.approximate)


class Embeddings(InferenceModule):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.word_embeddings = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = VocabEmbedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = VocabEmbedding(max(cfg.type_vocab_size, 1), cfg.hidden_size)
        self.LayerNorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # one segment: token type 0 everywhere (what sentence-transformers sends for single sentences)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)


class PaddedBatch:
    """The step's packed sequences as a padded [B, L] batch and back; key_mask hides the padding."""

    def __init__(self, query_lens, device: torch.device):
        lens = torch.as_tensor(query_lens, dtype=torch.long)
        self.batch, self.length = len(lens), int(lens.max())
        valid = torch.arange(self.length).unsqueeze(0) < lens.unsqueeze(1)   # [B, L]
        self.rows = valid.reshape(-1).nonzero().squeeze(1).to(device)   # packed row t -> its padded slot
        self.key_mask = valid[:, None, None, :].to(device)   # [B, 1, 1, L]
        self.single = self.batch == 1

    def to_batch(self, x: torch.Tensor) -> torch.Tensor:
        if self.single:
            return x.unsqueeze(0)
        out = x.new_zeros(self.batch * self.length, x.shape[-1])
        out[self.rows] = x
        return out.view(self.batch, self.length, -1)

    def from_batch(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(self.batch * self.length, -1)[self.rows] if not self.single else x[0]


class BertModel(InferenceModule):
    """A BERT encoder: input ids and positions of whole sequences -> their last hidden states."""

    is_encoder = True
    packed_modules: dict[str, tuple[str, str]] = {}

    @classmethod
    def checkpoint_weights(cls, weights: Iterable[tuple[str, torch.Tensor]],
                           cfg: ModelConfig) -> Iterable[tuple[str, torch.Tensor]]:
        """transformers' names, without the `bert.` of task checkpoints; the pooler and task heads left out."""
        for name, tensor in weights:
            name = name.removeprefix("bert.")
            if not name.startswith(_IGNORED):
                yield name, tensor

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = Embeddings(cfg)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.layers = list(self.encoder.layer)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata) -> torch.Tensor:
        """input_ids, positions [T] over the step's whole sequences -> hidden states [T, hidden]."""
        pad = PaddedBatch(attn_metadata.query_lens, input_ids.device)
        x = self.embeddings(input_ids, positions)
        for layer in self.layers:
            x = layer(x, pad)
        return x

    def prepack(self, release: bool = False) -> int:
        """Pack the linears' weights for the CPU's matmuls, as a decoder's (prepack_linears)."""
        return prepack_linears(self, release=release)[0]

    def compute_logits(self, hidden: torch.Tensor, cut: bool = False) -> torch.Tensor:
        raise ModelLoadError("a BERT encoder has no language-model head: it embeds (pooling) only")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy transformers-named tensors into the parameters; unknown or missing names raise ModelLoadError."""
        load_packed_weights(self, weights, self.packed_modules, lambda name: False)
