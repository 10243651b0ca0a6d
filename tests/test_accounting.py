"""Per-request accounting (enable_request_accounting): prompt tokens computed and cached, KV block-seconds, and
time queued, in prefill and in decode, per request, as the engine saw them; the server's usage carries them."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.entrypoints.openai.protocol import AccountedUsage, UsageInfo
from kvserve.entrypoints.openai.serving_common import usage
from kvserve.outputs import RequestOutput

PROMPT = {"prompt_token_ids": list(range(100, 170))}   # 70 tokens: 4 full blocks of 16


def _accounts(llm, prompts, max_tokens=8):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.metrics["accounting"] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_accounts_count_computed_and_cached_prompt_tokens_and_held_blocks():
    import time
    llm = LLM(enable_request_accounting=True)
    time.sleep(0.5)   # idle time is nobody's
    start = time.monotonic()
    [first] = _accounts(llm, [PROMPT])
    elapsed = time.monotonic() - start
    assert first["prompt_tokens_computed"] == 70 and first["prompt_tokens_cached"] == 0
    assert 0 < first["kv_block_seconds"] <= 5 * elapsed   # at most 5 blocks (70 + 8 tokens) the whole time
    assert all(first[k] is not None and first[k] >= 0 for k in ("queue_seconds", "prefill_seconds",
                                                                  "decode_seconds"))
    [again] = _accounts(llm, [PROMPT])   # the prefix cache serves 4 blocks
    assert again["prompt_tokens_cached"] == 64 and again["prompt_tokens_computed"] == 6
    assert "accounting" not in LLM().generate(PROMPT, use_tqdm=False)[0].metrics   # off by default


def test_a_preempted_request_is_charged_its_recomputed_prompt():
    llm = LLM(enable_request_accounting=True, enable_prefix_caching=False, num_kv_blocks=12, max_num_seqs=2)
    prompts = [{"prompt_token_ids": list(range(200 + 50 * i, 280 + 50 * i))} for i in range(2)]   # 80 tokens
    accounts = _accounts(llm, prompts, max_tokens=24)
    assert llm.llm_engine.scheduler.stats().num_preemptions > 0
    assert max(a["prompt_tokens_computed"] for a in accounts) > 80


def test_usage_carries_the_accounts_only_when_there_are_some():
    def out(accounting=None):
        metrics = {"accounting": accounting} if accounting else {}
        return RequestOutput("r", None, [1, 2, 3], None, [], True, metrics=metrics)
    plain = usage([out()], 5)
    assert type(plain) is UsageInfo and "kvserve_accounting" not in plain.model_dump()
    a = {"prompt_tokens_computed": 3, "prompt_tokens_cached": 0, "kv_block_seconds": 0.5, "queue_seconds": 0.1,
         "prefill_seconds": 0.2, "decode_seconds": None}
    b = {**a, "kv_block_seconds": 1.0, "queue_seconds": 0.3, "decode_seconds": 2.0}
    merged = usage([out(a), out(b)], 5)
    assert isinstance(merged, AccountedUsage)
    assert merged.kvserve_accounting == pytest.approx({"prompt_tokens_computed": 6, "prompt_tokens_cached": 0,
                                                       "kv_block_seconds": 1.5, "queue_seconds": 0.3,
                                                       "prefill_seconds": 0.2, "decode_seconds": 2.0})
