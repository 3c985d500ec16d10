"""The router's tokenizer, from `RouterSettings.tokenizer`.

- a directory (or tokenizer.json): the model's own tokenizer and chat template, in process;
- "approx": the text estimate (prefix-stable pseudo tokens) for fleets without a tokenizer;
- "remote": the fleet's own `POST /tokenize`, asking the routable replicas of the configured
  `served_model` in turn (with several models, every prompt is tokenized by that model's
  replicas: a tokenizer per model is not configurable yet): a replica
  that cannot be reached is skipped; a replica that answers with an error (a bad template input)
  ends the attempt, since every replica would answer the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import httpx

from controlplane.errors import NoReadyReplicaError
from controlplane.tokenization import (
    Message,
    PromptTokenizer,
    RemoteTokenizer,
    TokenizationError,
    Tokenized,
    open_tokenizer,
)
from router.fleet.live_fleet import LiveFleet


class FleetTokenizer:
    """`/tokenize` on whichever replica is routable."""

    mode: ClassVar[str] = "remote"

    def __init__(self, fleet: LiveFleet, model: str) -> None:
        self.fleet = fleet
        self.model = model

    def _remotes(self) -> list[RemoteTokenizer]:
        """The routable replicas serving this tokenizer's model (several models: never one
        whose /tokenize would refuse the model name)."""
        group = self.fleet.groups.get(self.model)
        out = []
        for state in self.fleet.snapshot().routable():
            if group is not None and state.replica_id not in group.members:
                continue
            rep = self.fleet.get(state.replica_id)
            out.append(RemoteTokenizer(rep.url, model=self.model, client=rep.client))
        return out

    async def _each(self, call: Any) -> Tokenized:
        remotes = self._remotes()
        if not remotes:
            raise NoReadyReplicaError("no ready replica to tokenize the prompt")
        last: Exception | None = None
        for remote in remotes:
            try:
                result: Tokenized = await call(remote)
                return result
            except TokenizationError as exc:
                if isinstance(exc.__cause__, httpx.HTTPError):
                    last = exc
                    continue
                raise
        raise NoReadyReplicaError(f"no replica could tokenize the prompt: {last}")

    async def tokenize(
        self, prompt: str | Sequence[int], *, add_special_tokens: bool = True
    ) -> Tokenized:
        if not isinstance(prompt, str):
            return Tokenized(tuple(int(t) for t in prompt), exact=True)
        return await self._each(lambda r: r.tokenize(prompt, add_special_tokens=add_special_tokens))

    async def tokenize_chat(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> Tokenized:
        return await self._each(
            lambda r: r.tokenize_chat(
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
                tools=tools,
            )
        )

    async def aclose(self) -> None:
        return None  # the clients belong to the fleet


def router_tokenizer(source: str, fleet: LiveFleet, model: str) -> PromptTokenizer:
    if source == "remote":
        return FleetTokenizer(fleet, model)
    return open_tokenizer(source, model=model)
