"""use_beam_search on /v1/completions and /v1/chat/completions (vLLM's extra fields): n beams of beam search
(kvserve/entrypoints/beam_search.py) as the request's n choices, best first; not streamed."""
from __future__ import annotations

from kvserve.entrypoints.beam_search import MAX_BEAM_WIDTH, BeamSearchParams
from kvserve.entrypoints.openai.errors import BadRequestError
from kvserve.entrypoints.openai.protocol import SamplingFields, UsageInfo
from kvserve.entrypoints.openai.serving_common import OpenAIServing, PromptInput
from kvserve.outputs import RequestOutput


def check_beam_search(req: SamplingFields, constrained: bool) -> None:
    """What beam search does not combine with: streaming, constrained outputs, sampling."""
    if req.stream:
        raise BadRequestError("use_beam_search answers with every beam at once: it cannot be streamed",
                              "use_beam_search", "unsupported_parameter")
    if constrained:
        raise BadRequestError("use_beam_search does not run with constrained outputs (response_format, tools, "
                              "structured_outputs)", "use_beam_search", "unsupported_parameter")
    if not 1 <= req.n <= MAX_BEAM_WIDTH:
        raise BadRequestError(f"use_beam_search: n is the beam width, at most {MAX_BEAM_WIDTH}; got {req.n}", "n",
                              "invalid_value")
    unsupported = [name for name, off in (("stop", req.stop is None), ("stop_token_ids", not req.stop_token_ids),
                                          ("logit_bias", not req.logit_bias), ("min_tokens", not req.min_tokens),
                                          ("presence_penalty", not req.presence_penalty),
                                          ("frequency_penalty", not req.frequency_penalty),
                                          ("repetition_penalty", req.repetition_penalty in (None, 1.0)),
                                          ("logprobs", not getattr(req, "logprobs", None)),
                                          ("echo", not getattr(req, "echo", False)),
                                          ("allowed_token_ids", req.allowed_token_ids is None),
                                          ("bad_words", not req.bad_words),
                                          ("truncate_prompt_tokens", req.truncate_prompt_tokens is None),
                                          ("stream_options", req.stream_options is None)) if not off]
    if unsupported:
        raise BadRequestError(f"use_beam_search does not run with {unsupported[0]}", unsupported[0],
                              "unsupported_parameter")
    if req.temperature not in (None, 0, 0.0):
        raise BadRequestError("use_beam_search ranks by the model's own logprobs: leave temperature out or 0",
                              "temperature", "invalid_value")


async def beam_search(serving: OpenAIServing, request_id: str, prompts: list[PromptInput], req: SamplingFields,
                      max_tokens: int | None) -> list[RequestOutput]:
    """Each prompt's beam search in the engine (max_tokens None: up to the context's end); its output holds the
    best req.n sequences, best first."""
    longest = max(len(p.token_ids) for p in prompts)
    params = BeamSearchParams(beam_width=req.n, ignore_eos=req.ignore_eos, length_penalty=req.length_penalty,
                              max_tokens=serving.max_model_len - longest if max_tokens is None else max_tokens)
    streams = await serving.add_prompts(request_id, prompts, [None] * len(prompts), req, beam_search=params)
    results: list[RequestOutput | None] = [None] * len(prompts)
    async for i, out in serving.outputs(streams):
        results[i] = out
    return results


def beam_choices(prompts: list[PromptInput], results: list[RequestOutput]):
    """(index, text, finish_reason) of every beam, prompt by prompt, and the usage of the whole."""
    beams = [o for out in results for o in out.outputs]
    choices = [(i, o.text, o.finish_reason) for i, o in enumerate(beams)]
    completion = sum(len(o.token_ids) for o in beams)
    num_prompt = sum(len(p.token_ids) for p in prompts)
    return choices, UsageInfo(prompt_tokens=num_prompt, completion_tokens=completion,
                              total_tokens=num_prompt + completion)
