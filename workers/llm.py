"""The offline front: LLM(model).generate(prompts, params)."""

from __future__ import annotations

import itertools

from shoal.proto.lora.request import LoRARequest
from shoal.proto.messages import GenerateRequest
from shoal.proto.sampling_params import SamplingParams
from shoal.workers.core.outputs import CompletionOutput
from shoal.workers.engine_args import EngineArgs
from shoal.workers.llm_engine import LLMEngine


class LLM:
    """Batch generation on one engine. `LLM()` loads the default model;
    `LLM(model, tensor_parallel_size=K)` splits it across K ranks (Ray
    actors; a local Ray cluster is started if none is connected). Call
    shutdown() (or use it as a context manager) to stop them."""

    def __init__(self, model: str | None = None, **engine_args):
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self._ids = itertools.count()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks and free their resources."""
        self.engine.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[CompletionOutput]:
        """One output per prompt, in order. A prompt is a string or a list of
        token ids; `params` is one SamplingParams for all or one per prompt;
        `lora_request` one adapter for all, or one per prompt (None: the
        base model). Every prompt and adapter is validated before any runs."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        engine = self.engine
        encoded = [engine.tokenize(p) for p in prompts]
        for ids, sp, lora in zip(encoded, params, loras):
            engine.validate(ids, sp)
            if lora is not None:
                engine.register_lora(lora)
        outputs: dict[str, CompletionOutput] = {}
        for ids, sp, lora in zip(encoded, params, loras):
            rid = f"llm-{next(self._ids)}"
            lora_name = None if lora is None else lora.lora_name
            engine.add_request(GenerateRequest(rid, ids, sp, lora_name=lora_name))
            outputs[rid] = CompletionOutput(rid, ids)
        while any(o.finish_reason is None for o in outputs.values()):
            for delta in engine.step():
                outputs[delta.request_id].add(delta)
        return list(outputs.values())
