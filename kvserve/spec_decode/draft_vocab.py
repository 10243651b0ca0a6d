"""A draft model's cut vocabulary (speculative_config draft_vocab_size): what each request drafts from.

A request drafts among the first N token ids (the cut output matrix, CausalLM.cut_lm_head) and its own
tokens past them: those of its prompt and of its output so far (row_logits). A BPE vocabulary puts its frequent
tokens first, and what lies past them in a code or English answer is mostly copied: an identifier of the prompt, a
code fence the answer opened, the chat template's end token. While the output keeps bringing tokens past the cut
that the request had not had (text in a script the cut leaves out), the request drafts from the whole vocabulary.

    ids:    | 0 ............ N-1 | N ...................................... V-1 |
    cut:    | every request      | the request's own: prompt's and output's   |
    whole:  | while its output has had is_whole()'s share of new ones          |
"""
from __future__ import annotations

import math

import torch

FULL_VOCAB_MIN, FULL_VOCAB_SHARE = 2, 32   # is_whole's rule


class DraftVocab:
    """One request's tokens past the cut: `own`, the ids of its prompt and output past it; `num_new`, how many of
    its output tokens were past it and not yet its own when they came; `num_seen`, the output tokens counted."""

    __slots__ = ("own", "num_new", "num_seen")

    def __init__(self, prompt_ids: list[int], cut: int):
        self.own = {t for t in prompt_ids if t >= cut}
        self.num_new = self.num_seen = 0

    def update(self, output_ids: list[int], cut: int) -> None:
        """Count the output tokens not counted yet."""
        for t in output_ids[self.num_seen:]:
            if t >= cut and t not in self.own:
                self.own.add(t)
                self.num_new += 1
        self.num_seen = len(output_ids)

    def is_whole(self) -> bool:
        """Whether the request drafts from the whole vocabulary: while FULL_VOCAB_MIN of its output tokens at least,
        and 1 in FULL_VOCAB_SHARE of them, were new past the cut (the cut draft could propose none of them)."""
        return self.num_new >= FULL_VOCAB_MIN and self.num_new * FULL_VOCAB_SHARE >= self.num_seen


def request_vocab(req, cut: int) -> DraftVocab:
    """`req`'s DraftVocab, brought up to date with its output (counted again from its prompt when the output was
    cut back, as tokens past a stop string are dropped)."""
    vocab = req.draft_vocab
    if vocab is None or vocab.num_seen > len(req.output_token_ids):
        vocab = req.draft_vocab = DraftVocab(req.prompt_token_ids, cut)
    vocab.update(req.output_token_ids, cut)
    return vocab


def own_ids(vocabs: list[DraftVocab | None]) -> tuple[int, ...]:
    """The ids past the cut that any of these requests may draft, ascending (row_logits' rows)."""
    return tuple(sorted(set().union(*(v.own for v in vocabs if v is not None))))


def draft_logits(model, hidden: torch.Tensor, vocabs: list[DraftVocab | None],
                 own: tuple[int, ...] | None = None) -> torch.Tensor:
    """The draft model's float32 logits for its rows: row j from the whole output matrix where vocabs[j] is None,
    else from the cut one and the rows of vocabs[j].own, -inf elsewhere ([rows, N] when no row has more than the
    cut, else [rows, vocabulary]). own: own_ids of these rows or more (a proposal's, the same for all its draft
    steps as their rows drop out, so that row_logits' matrix is built once); by default these rows'."""
    cut_rows = [j for j, v in enumerate(vocabs) if v is not None]
    if not cut_rows:
        return model.compute_logits(hidden)
    has_own = any(vocabs[j].own for j in cut_rows)
    if len(cut_rows) == len(vocabs) and not has_own:
        return model.compute_logits(hidden, cut=True)
    cut_index = _index(cut_rows, hidden)
    part_hidden = hidden if len(cut_rows) == len(vocabs) else hidden[cut_index]
    part = model.compute_logits(part_hidden, cut=True)
    logits = part.new_full((len(vocabs), model.config.vocab_size), -math.inf)
    logits[cut_index, :part.shape[1]] = part
    if has_own:
        own = own_ids(vocabs) if own is None else own
        extra = model.row_logits(part_hidden, own)
        if any(len(vocabs[j].own) < len(own) for j in cut_rows):   # each row proposes only its request's own
            column = {t: c for c, t in enumerate(own)}
            mine = torch.zeros(extra.shape, dtype=torch.bool)
            for r, j in enumerate(cut_rows):
                if vocabs[j].own:
                    mine[r, [column[t] for t in vocabs[j].own]] = True
            extra.masked_fill_(~mine.to(extra.device), -math.inf)
        logits[cut_index[:, None], _index(list(own), hidden)[None, :]] = extra
    if len(cut_rows) < len(vocabs):
        whole_index = _index([j for j, v in enumerate(vocabs) if v is None], hidden)
        logits[whole_index] = model.compute_logits(hidden[whole_index])
    return logits


def _index(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)
