"""Structured outputs: grammars compiled off the engine thread (manager), a matcher per request that masks the
logits of each step (request)."""
from kvserve.structured_output.manager import StructuredOutputManager
from kvserve.structured_output.request import GrammarBitmask, StructuredOutputRequest, build_grammar_bitmask

__all__ = ["GrammarBitmask", "StructuredOutputManager", "StructuredOutputRequest", "build_grammar_bitmask"]
