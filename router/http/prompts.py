"""Prompts and sequences of one request: the cap on a completions batch, and what it reserves.

A `/v1/completions` request may carry a batch of prompts (a list of strings, or a list of token
id lists); vLLM runs each as its own sequence, `n` (or `best_of`) times. So:

    prompt_count(body)   1 for a chat request, a single string or a single token id list;
                         len(prompt) for a batch (counted without copying a prompt)
    sequences(body)      prompt_count x max(n, best_of): what `max_tokens` is reserved for, by
                         the quota (`relay.reserve_quota`) and the fair queue's ticket
                         (`RoutingRequest.sequences`)
    check_prompt_count   more than `limits.max_prompts_per_request` prompts: 400 (param
                         `prompt`), checked first in `relay.serve_request` (either lane),
                         before anything is tokenized, reserved or queued, so a 100,000-prompt
                         body costs its JSON parse and no more
    quota_prompt_tokens  the prompt tokens a quota reserves: the tokenizer's count when it is
                         exact; with the approximate tokenizer an upper bound of what the replica
                         will report (`controlplane.token_bound`: UTF-8 bytes of the text, of each
                         message's JSON, plus `quota.approx_template_tokens`), so that the usage
                         settled never outgrows the reservation (routing keeps the estimate)

The prompts' tokens are all counted by `RouterCore.build` (the batch's first prompt is routed,
the others add to `prompt_tokens`), so a reservation holds every prompt plus every sequence's
output.
"""

from __future__ import annotations

from controlplane.errors import TooManyPromptsError
from controlplane.token_bound import chat_bound, prompt_bound
from router.config import LimitsConfig
from router.http.lean import OpenAIRequest


def prompt_count(req: OpenAIRequest) -> int:
    """1 for a chat request; the prompts of a completions request (a batch may hold several)."""
    return len(req.prompts) if req.prompts is not None else 1


def sequences(req: OpenAIRequest) -> int:
    """Sequences the request makes a replica run: prompts x max(n, best_of)."""
    return req.sequences_per_prompt * prompt_count(req)


def check_prompt_count(limits: LimitsConfig, req: OpenAIRequest) -> None:
    n = prompt_count(req)
    if n > limits.max_prompts_per_request:
        raise TooManyPromptsError(
            f"the request carries {n} prompts; this router accepts at most "
            f"{limits.max_prompts_per_request} per request"
        )


def quota_prompt_tokens(
    tokenizer_mode: str, template_tokens: int, req: OpenAIRequest, estimate: int
) -> int:
    """Prompt tokens to reserve: `estimate` (the router's count) unless the tokenizer is the
    approximate one, then at least the bound of `controlplane.token_bound`."""
    if tokenizer_mode != "approx":
        return estimate
    if req.messages is not None:
        bound = chat_bound(
            req.messages,
            overhead=template_tokens,
            tools=req.tools,
            chat_template_kwargs=req.chat_template_kwargs,
        )
    else:
        bound = sum(prompt_bound(x) for x in req.prompts or ())
    return max(estimate, bound)


__all__ = ["check_prompt_count", "prompt_count", "quota_prompt_tokens", "sequences"]
