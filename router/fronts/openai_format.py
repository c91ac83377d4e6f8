"""OpenAI's response shapes (chat and text completions, whole and streamed
chunks, logprobs, usage) for one request, as the HTTP front writes them."""

from __future__ import annotations

import time

from shoal.proto.logprobs import TokenLogprob
from shoal.proto.messages import GenerateDelta, RequestFinished
from shoal.router.fronts.frontend import Frontend


class ChunkFormat:
    """OpenAI's response shapes for one request."""

    def __init__(self, fe: Frontend, rid: str, chat: bool, want_lp: bool, width: int = 1, model: str | None = None):
        """model: what the response names (the LoRA adapter asked for; default the base model)."""
        self.fe, self.rid, self.chat, self.want_lp = fe, rid, chat, want_lp
        self.model = model or fe.info.model
        self.width = width  # engine requests per prompt (parallel sampling: n, or best_of)
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _tok(self, token_id: int) -> str:
        tok = self.fe.tokenizer
        return tok.decode([token_id], skip_special_tokens=False) if tok is not None else str(token_id)

    def logprobs(self, lps: list[TokenLogprob]) -> dict | None:
        if not self.want_lp:
            return None
        if self.chat:

            def entry(t: int, lp: float) -> dict:
                tok = self._tok(t)
                return {"token": tok, "logprob": lp, "bytes": list(tok.encode())}

            return {
                "content": [
                    dict(entry(lp.token_id, lp.logprob), top_logprobs=[entry(k, v) for k, v in lp.top_logprobs.items()])
                    for lp in lps
                ]
            }
        return {
            "tokens": [self._tok(lp.token_id) for lp in lps],
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self._tok(k): v for k, v in lp.top_logprobs.items()} for lp in lps],
        }

    def chunk(self, i: int, delta, finish_reason, lps) -> dict:
        choice = {"index": i, "finish_reason": finish_reason, "logprobs": lps}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        return {**self._chunk_head(), "choices": [choice]}

    def _chunk_head(self) -> dict:
        """The fields every streamed chunk starts with."""
        obj = self.object + ".chunk" if self.chat else self.object
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def delta(self, i: int, msg: GenerateDelta) -> dict:
        text, finished = msg.text, msg.finished
        lps = self.logprobs(msg.logprobs or [])
        delta = ({"content": text} if text or finished is None else {}) if self.chat else text
        return self.chunk(i, delta, None if finished is None else finished.finish_reason, lps)

    def tool_chunks(self, i: int, msg: GenerateDelta, reply) -> list[dict]:
        """The chunks of one delta read for tool calls by `reply` (a
        tool_replies.ToolReply): text it holds back sends nothing yet; the
        logprobs ride on the first chunk, the finish on the last."""
        finished = msg.finished
        parts = reply.feed(msg.text, finished is not None)
        lps = self.logprobs(msg.logprobs) if msg.logprobs else None
        if lps is not None or (finished is not None and not parts):
            parts = parts or [{}]
        chunks = [self.chunk(i, part, None, lps if k == 0 else None) for k, part in enumerate(parts)]
        if finished is not None:
            chunks[-1]["choices"][0]["finish_reason"] = reply.finish_reason(finished.finish_reason, reply.called)
        return chunks

    def usage(self, finals: list[RequestFinished]) -> dict:
        """finals: every engine request's, in choice order. Each prompt counts
        once, as its first sample saw it (the others share its prefill)."""
        firsts = finals[:: self.width]
        prompt = sum(f.num_prompt_tokens for f in firsts)
        completion = sum(f.num_output_tokens for f in finals)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(f.num_cached_tokens for f in firsts)},
        }

    def usage_chunk(self, finals: list[RequestFinished]) -> dict:
        return {**self._chunk_head(), "choices": [], "usage": self.usage(finals)}

    def whole(self, choices: list[dict], finals: list[RequestFinished] | None = None) -> dict:
        """finals: every engine request's for the usage, when not all are
        among the choices (best_of)."""
        out = []
        for c in choices:
            final = c["final"]
            entry = {"index": c["index"], "finish_reason": final.finish_reason, "logprobs": self.logprobs(c["lps"])}
            if self.chat:
                entry["message"] = {"role": "assistant", "content": c.get("content", c["text"])}
                if c.get("tool_calls"):  # tool_replies.ToolReply.whole's
                    entry["message"]["tool_calls"] = c["tool_calls"]
                    entry["finish_reason"] = c["finish_reason"]
            else:
                entry["text"] = c["text"]
            out.append(entry)
        return {
            "id": self.rid,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": out,
            "usage": self.usage(finals if finals is not None else [c["final"] for c in choices]),
        }


def usage_so_far(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
