"""What the speculative decoding tests share: a float32 engine, outputs as token ids, greedy parameters, a
configuration that cuts drafts, chunks prompts and preempts requests, and a draft model made of a tiny target's
first layer with random prompts for that pair."""
import torch

from kvserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
GREEDY_30 = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)   # the tiny pair's (conftest.py)
# small steps and a small pool: budgets cut drafts, prompts run in chunks, requests are preempted; every prompt
# runs twice (the second time from the prefix cache). The reference's block size: the attention kernels sum each
# KV block's share in turn, so another block size rounds differently and may flip a near-tie
STRESS = dict(max_num_batched_tokens=24, num_kv_blocks=12, block_size=16, max_num_seqs=4)


def make_llm(spec=None, **kwargs):
    return LLM(dtype="float32", speculative_config=spec, **kwargs)


def tokens(outputs):
    return [[o.token_ids for o in out.outputs] for out in outputs]


def save_first_layer_draft(target_dir, draft_dir) -> None:
    """Save, as a draft model, the saved target's first layer (with its embeddings, final norm and head)."""
    from transformers import AutoModelForCausalLM
    draft = AutoModelForCausalLM.from_pretrained(target_dir)
    draft.model.layers = draft.model.layers[:1]
    draft.config.num_hidden_layers = 1
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:1]
    draft.save_pretrained(draft_dir)


def tiny_prompts(n=6):
    """n prompts of 8, 17, 26, ... random token ids below 96 (the tiny pair's vocabulary), the same every call."""
    g = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(3, 96, (int(8 + 9 * i),), generator=g).tolist()} for i in range(n)]
