"""The linears of every decoder layer by role (kvserve/model/decoder.py builds them under these names): the
projections each packs, and how tensor parallelism splits it. The weight loaders (CausalLM.packed_modules), LoRA
(kvserve/lora), tensor parallelism (kvserve/distributed/plan.py) and the fused C++ stack (fused.py) read this
declaration instead of naming the linears themselves."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Projection:
    """One checkpoint projection inside a decoder linear."""
    checkpoint: str      # its HF name in the Llama layout (q_proj; checkpoint_weights renames a family's others)
    shard: str | None    # its shard in the fused linear (MergedLinear), None where the linear is this one alone
    split: str           # tensor parallelism: "q"/"kv" its heads' rows, "inter" rows, "o"/"down" input columns


@dataclass(frozen=True)
class LinearRole:
    """One linear of every decoder layer, by role: where it sits, the projections it packs, how it is split."""
    block: str           # the layer's submodule that holds it (self_attn, mlp)
    name: str            # its module name there
    projections: tuple[Projection, ...]
    row_parallel: bool   # tensor parallelism: the ranks' partial outputs are summed (column-parallel otherwise)

    def of(self, layer):
        """This linear (a Linear module) of a DecoderLayer."""
        return getattr(getattr(layer, self.block), self.name)

    def held_by(self, layer) -> bool:
        """Whether the layer has this linear (an MoE layer's MLP has experts instead: kvserve/model/moe.py)."""
        return hasattr(getattr(layer, self.block), self.name)


def roles_of(layers) -> tuple[LinearRole, ...]:
    """The declared linears that every one of these layers has."""
    return tuple(r for r in DECODER_LINEARS if all(r.held_by(layer) for layer in layers))


# the decoder's linears, in the fused stack's order (layers.cpp LayerDesc): the weight loaders (packed_modules),
# LoRA (kvserve/lora), tensor parallelism (kvserve/distributed/plan.py) and the fused stack read these
DECODER_LINEARS = (
    LinearRole("self_attn", "qkv_proj", (Projection("q_proj", "q", "q"), Projection("k_proj", "k", "kv"),
                                         Projection("v_proj", "v", "kv")), row_parallel=False),
    LinearRole("self_attn", "o_proj", (Projection("o_proj", None, "o"),), row_parallel=True),
    LinearRole("mlp", "gate_up_proj", (Projection("gate_proj", "gate", "inter"), Projection("up_proj", "up", "inter")),
               row_parallel=False),
    LinearRole("mlp", "down_proj", (Projection("down_proj", None, "down"),), row_parallel=True),
)

