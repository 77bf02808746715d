"""The offline API: ``LLM().generate(prompts, params)`` and ``LLM().chat(messages, params)``."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any

from pagedattn.config import EngineConfig, describe_options
from pagedattn.engine.embedding import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    embedding_params,
    embedding_salt,
    finish_embedding,
    pooled_of,
)
from pagedattn.engine.llm_engine import EngineStats, LLMEngine
from pagedattn.engine.outputs import RequestOutput
from pagedattn.lora.request import LoRARequest
from pagedattn.sampling_params import BeamSearchParams, SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text or token ids) or many -> a list of prompts."""
    if isinstance(prompts, str) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]
    return list(prompts)


class LLM:
    """Batch generation on the paged engine; every call runs the engine until its requests end."""

    def __init__(
        self, model: str | os.PathLike | None = None, *, verbose: bool = False, **options: Any
    ) -> None:
        """Load ``model`` and allocate its paged KV cache.

        ``model``: an HF folder, a .gguf file, a packaged model name, or None for the default
        (SmolLM2-135M-Instruct). ``verbose``: print the KV cache allocated. ``options``: engine
        options by name, with their defaults (pagedattn.config holds them; an unknown name
        raises ConfigError):

        {options}
        """
        config = EngineConfig.from_kwargs(model=model, **options)
        self.engine = LLMEngine(config, verbose=verbose)
        self._counter = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs come back in prompt order.

        ``lora_request``: one adapter for all prompts, or one (or None) per prompt."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(
                f"got {len(params)} sampling params for {len(prompts)} prompts: pass one, or one "
                "per prompt"
            )
        loras = (
            [lora_request] * len(prompts)
            if lora_request is None or isinstance(lora_request, LoRARequest)
            else list(lora_request)
        )
        if len(loras) != len(prompts):
            raise ValueError(
                f"got {len(loras)} LoRA requests for {len(prompts)} prompts: pass one, or one "
                "per prompt"
            )
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                req_id = str(next(self._counter))
                self.engine.add_request(
                    req_id,
                    prompt,
                    p,
                    priority=0 if priority is None else priority[i],
                    lora_request=loras[i],
                )
                ids.append(req_id)
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate a reply.

        ``tools``: OpenAI-style function tools (``{"type": "function", "function": {...}}``),
        rendered by the template's own tool support, or for a template without it in the generic
        tool prompt (pagedattn.chat_template.GENERIC_TOOL_PROMPT); messages may carry
        ``tool_calls`` and ``role: "tool"`` results. The reply is the model's raw text, as
        vLLM's ``LLM.chat`` returns it. ``chat_template_kwargs``: extra template variables."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if tools is None and not chat_template_kwargs:
            texts = [
                self.engine.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
                for conv in conversations
            ]
        else:
            texts = [
                self._render_with_tools(conv, tools, add_generation_prompt, chat_template_kwargs)
                for conv in conversations
            ]
        # NOTE: the template already holds the special tokens; encoding must not add a second BOS.
        ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        outputs = self.generate(ids, sampling_params, use_tqdm=use_tqdm)
        for out, text in zip(outputs, texts, strict=True):
            out.prompt = text
        return outputs

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        pooling: str = "last",
        normalize: bool = True,
        dimensions: int | None = None,
        use_tqdm: bool = False,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (text or token ids): the served model's final hidden states
        pooled ("last" token or "mean"), L2-normalised unless ``normalize=False``, cut to
        ``dimensions`` first if given. Batched by the scheduler like generation, on the same
        model (pagedattn.engine.embedding)."""
        params = embedding_params(pooling)
        ids = []
        try:
            for prompt in _as_prompt_list(prompts):
                req_id = str(next(self._counter))
                salt = embedding_salt(pooling, None)
                self.engine.add_request(req_id, prompt, params, cache_salt=salt)
                ids.append(req_id)
        except Exception:
            self.engine.abort_request(ids)
            raise
        return [
            EmbeddingRequestOutput(
                out.request_id,
                out.prompt_token_ids,
                EmbeddingOutput(
                    finish_embedding(pooled_of(out), normalize=normalize, dimensions=dimensions)
                ),
            )
            for out in self._run(ids, use_tqdm)
        ]

    def _render_with_tools(
        self,
        conversation: Sequence[Message],
        tools: list[dict] | None,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None,
    ) -> str:
        from pagedattn.chat_template import template_supports_tools, tool_conversation

        native = template_supports_tools(getattr(self.tokenizer, "chat_template", None))
        messages = tool_conversation(conversation, tools, native)
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools if native else None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **(template_kwargs or {}),
        )

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams):
        """Beam search per prompt; beams share blocks by fork and diverge by copy-on-write."""
        return [self.engine.beam_search(p, params) for p in _as_prompt_list(prompts)]

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter now (generate also loads one on first use)."""
        self.engine.loras.add(lora_request)

    def remove_lora(self, name: str) -> None:
        """Unload an adapter; its cached KV blocks are dropped."""
        self.engine.loras.remove(name)

    def list_loras(self) -> list[LoRARequest]:
        """The loaded adapters."""
        return self.engine.loras.list()

    def get_stats(self) -> EngineStats:
        """KV usage, prefix-cache hit rate, preemptions and fragmentation so far."""
        return self.engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block that no request holds; False if some are in use."""
        return self.engine.reset_prefix_cache()

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(request_ids), desc="generate", unit="req")
        while pending:
            for out in self.engine.step():
                if out.finished and out.request_id in pending:
                    finished[out.request_id] = out
                    pending.discard(out.request_id)
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [finished[r] for r in request_ids]


# NOTE: the option list is generated from pagedattn.config, so help(LLM) shows every default
# without writing it a second time.
LLM.__init__.__doc__ = LLM.__init__.__doc__.replace(
    "{options}", describe_options(indent=" " * 8).lstrip()
)
