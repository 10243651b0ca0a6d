"""StructuredOutputRequest: one request's grammar matcher. It masks the tokens the grammar forbids at each row the
request samples (build_grammar_bitmask) and advances with every token the request keeps (accept)."""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kvserve.errors import InvalidRequestError

logger = logging.getLogger("kvserve")


class StructuredOutputRequest:
    """A request's matcher, made once its grammar has compiled; n > 1 samples share the grammar, not the matcher."""

    def __init__(self, grammar: Future, deadline: float, timeout_s: float):
        self.grammar = grammar
        self.deadline = deadline
        self.timeout_s = timeout_s
        self._matcher = None

    @property
    def matcher(self):
        """The xgrammar matcher, made on first use (a sample forked from another's prompt starts with its own);
        only used once the grammar has compiled."""
        if self._matcher is None:
            import xgrammar as xgr
            self._matcher = xgr.GrammarMatcher(self.grammar.result())
        return self._matcher

    def is_ready(self, now: float | None = None) -> bool:
        """Whether the grammar has compiled; raises InvalidRequestError if it failed or is past its deadline."""
        if self._matcher is not None:
            return True
        if self.grammar.done():
            return self.matcher is not None   # raises the compile error
        if (time.monotonic() if now is None else now) > self.deadline:
            raise compile_timeout_error(self.timeout_s)
        return False

    def accept(self, token_id: int) -> bool:
        """Advance over a token the request keeps; False (and a warning) if the grammar forbids it. Every sampled
        row is masked by the grammar, so this is a guard: the request stops rather than go on off its grammar."""
        if self.matcher.accept_token(token_id):
            return True
        logger.warning("kvserve: token %d does not fit the request's grammar; the request stops", token_id)
        return False

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its end (a stop token) was accepted."""
        return self.matcher.is_terminated()


def compile_timeout_error(timeout_s: float) -> InvalidRequestError:
    """The error of a request whose grammar has not compiled within grammar_compile_timeout_s."""
    return InvalidRequestError(f"structured_outputs: compiling the grammar took longer than {timeout_s:g} s "
                               "(grammar_compile_timeout_s); simplify the schema", "structured_outputs")


@dataclass
class GrammarBitmask:
    """Allowed tokens of the step's sampled rows: bit t of bitmask[i] allows token t in logits row i."""

    bitmask: torch.Tensor   # [num_rows, ceil(V / 32)] int32, one row per logits row (unconstrained rows all ones)
    rows: list[int]         # the logits rows it constrains


def build_grammar_bitmask(reqs, vocab_size: int) -> GrammarBitmask | None:
    """The bitmask of a step's sampled rows, in the runner's order (per request its last token's row, then one
    per draft); None when no request is constrained, so unconstrained batches pay nothing.

    A draft row is filled with the matcher advanced over the drafts before it, then the matcher is rolled back:
    it only ever advances over tokens the scheduler keeps. Rows after a draft the grammar forbids stay
    unconstrained: that draft is rejected (its row forbids it), so nothing sampled after it is kept."""
    if not any(r.structured_output is not None for r in reqs):
        return None
    import xgrammar as xgr
    num_rows = sum(len(r.spec_token_ids) + 1 for r in reqs)
    bitmask = xgr.allocate_token_bitmask(num_rows, vocab_size)
    rows, row = [], 0
    for req in reqs:
        so = req.structured_output
        if so is not None and not so.is_terminated:
            filled = _fill_rows(so.matcher, bitmask, row, req.spec_token_ids)
            num_short = req.params.min_tokens - req.num_output_tokens   # rows still under min_tokens
            for r in filled[:max(num_short, 0)]:
                _ban_stops(bitmask[r], req.eos_token_ids | req.params.all_stop_token_ids)
            rows += filled
        row += len(req.spec_token_ids) + 1
    return GrammarBitmask(bitmask, rows) if rows else None


def _ban_stops(words: torch.Tensor, stop_ids: set[int]) -> None:
    """min_tokens in a grammar's row: forbid the stop tokens too, unless the grammar allows nothing else (its output
    is complete: the grammar wins, and the request ends short of min_tokens)."""
    banned = words.clone()
    for t in stop_ids:
        if t // 32 < len(banned):
            banned[t // 32] &= ~(torch.tensor(1, dtype=torch.int32) << (t % 32))
    if banned.any():
        words.copy_(banned)


def _fill_rows(matcher, bitmask: torch.Tensor, row: int, drafts: list[int]) -> list[int]:
    matcher.fill_next_token_bitmask(bitmask, row)
    rows, num_accepted = [row], 0
    for j, draft in enumerate(drafts):
        if not matcher.accept_token(draft):
            break
        num_accepted += 1
        if matcher.is_terminated():   # a stop token: nothing after it is kept
            break
        matcher.fill_next_token_bitmask(bitmask, row + j + 1)
        rows.append(row + j + 1)
    if num_accepted:
        matcher.rollback(num_accepted)
    return rows


def apply_grammar_bitmask(logits: torch.Tensor, mask: GrammarBitmask) -> None:
    """Set the forbidden tokens' logits to -inf, in place: our C++ kernel on float32 CPU rows (several times
    xgrammar's CPU kernel over a batch), else xgrammar's (Triton on CUDA)."""
    from kvserve import kernels
    lib = kernels.load() if logits.is_cpu and logits.dtype == torch.float32 and logits.stride(1) == 1 else None
    if lib is not None:
        rows = torch.tensor(mask.rows, dtype=torch.long)
        lib.kvserve_apply_bitmask_f32(logits.data_ptr(), logits.stride(0), mask.bitmask.data_ptr(),
                                      mask.bitmask.stride(0), rows.data_ptr(), len(mask.rows), logits.shape[1])
        return
    import xgrammar as xgr
    bitmask = mask.bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=mask.rows)
