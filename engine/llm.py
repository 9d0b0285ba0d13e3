"""Offline API: `LLM(model=DIR, **engine_args).generate(prompts, params)`."""
from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.tokenizer import load_tokenizer
from engine.types import FinishReason, SamplingParams, TokenLogprobs

logger = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # params.prompt_logprobs: [None, token 1, ...]
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache


class LLM:
    def __init__(self, model: str | None = None, **engine_args) -> None:
        config = EngineConfig(**engine_args) if model is None else EngineConfig(model=str(model), **engine_args)
        self.engine = EngineCore(config)
        self.tokenizer = load_tokenizer(config.model)

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("params: need one SamplingParams per prompt")
        token_prompts = [self._encode(p) for p in prompts]
        for ids, p in zip(token_prompts, params_list):  # validate all before submitting any
            self.engine.validate_prompt(ids, p)
        outputs: dict[str, RequestOutput] = {}
        order = []
        for ids, p in zip(token_prompts, params_list):
            req_id = self.engine.add_request(ids, p)
            outputs[req_id] = RequestOutput(req_id, ids, logprobs=[] if p.logprobs is not None else None)
            order.append(req_id)
        while self.engine.has_unfinished():
            for update in self.engine.step():
                out = outputs.get(update.req_id)
                if out is None:
                    continue
                out.token_ids.extend(update.new_token_ids)
                if out.logprobs is not None:
                    out.logprobs.extend(update.new_logprobs)
                if update.prompt_logprobs is not None:
                    out.prompt_logprobs = [None, *update.prompt_logprobs]
                if update.num_cached_tokens is not None:
                    out.num_cached_tokens = update.num_cached_tokens
                if update.finish_reason:
                    out.finish_reason = update.finish_reason
        if self.tokenizer is not None:
            for out in outputs.values():
                out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return [outputs[r] for r in order]

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if not isinstance(prompt, list):
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        return prompt

    def shutdown(self) -> None:
        self.engine = None  # type: ignore[assignment]
        gc.collect()
