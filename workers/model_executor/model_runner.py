"""Owns the model and its KV cache; turns a scheduled batch into one flat
forward pass and samples the next tokens. It only computes: the scheduler
applies what a step did to the sequences.

Under tensor parallelism every rank runs one of these over its own slice
of the model and cache; only rank 0 gets logits and samples.
"""

from __future__ import annotations

import torch

from shoal.workers.model_executor.layers.attention import (
    AttentionMetadata,
    DecodeGroup,
    GatherWorkspace,
    PrefillChunk,
    TritonAttentionMetadata,
    set_forward_context,
)
from shoal.workers.model_executor.layers.parallel_state import num_local_kv_heads
from shoal.workers.model_executor.layers.sampler import Sampler
from shoal.workers.model_executor.models.llama import LlamaForCausalLM
from shoal.workers.model_executor.sampling_metadata_builder import build_sampling_metadata
from shoal.workers.core.outputs import ModelRunnerOutput
from shoal.workers.core.scheduler import SchedulerOutput
from shoal.workers.core.sequence import Sequence


DEFAULT_CPU_KV_BYTES = 2 << 30


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, eos_token_ids: list[int],
                 attention_backend: str):  # fmt: skip
        self.model = model
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids  # banned before min_tokens
        cfg = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        kv_heads = model.attention_layers()[0].num_kv_heads  # this rank's
        shape = (2, cfg.num_hidden_layers, num_blocks, block_size, kv_heads, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        # On the CPU in float32, decodes read the paged cache through the
        # compiled kernel when it builds; the torch path is the fallback.
        if attention_backend not in ("auto", "torch", "cpu_kernel", "triton"):
            raise ValueError(f"attention_backend must be auto, torch, cpu_kernel or triton; got {attention_backend!r}")
        self.triton_kernel = None
        # On CUDA, "auto" is the Triton kernel: torch's masked SDPA there builds
        # a new cuDNN plan for every new shape.
        if attention_backend == "triton" or (attention_backend == "auto" and self.device.type == "cuda"):
            from shoal.workers.model_executor.layers import triton_attention

            self.triton_kernel = triton_attention.load(self.device, block_size)
        self.decode_kernel = None
        if attention_backend in ("auto", "cpu_kernel") and self.device.type == "cpu" and self.dtype == torch.float32:
            from shoal.workers.model_executor.layers import cpu_decode_kernel

            self.decode_kernel = cpu_decode_kernel.load()
        if attention_backend == "cpu_kernel" and self.decode_kernel is None:
            raise RuntimeError("attention_backend='cpu_kernel' needs a CPU, float32 and a C++ compiler")
        workspace = GatherWorkspace()
        for i, attn in enumerate(model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
            attn.workspace = workspace
            attn.decode_kernel = self.decode_kernel
            attn.triton_kernel = self.triton_kernel
        self.sampler = Sampler()

    @staticmethod
    def kv_bytes_per_block(cfg, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
        """One block's keys and values on one rank."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        kv_heads = num_local_kv_heads(cfg.num_key_value_heads, tp_size)
        return 2 * cfg.num_hidden_layers * block_size * kv_heads * cfg.head_dim * itemsize

    @staticmethod
    def kv_budget_bytes(args, device: torch.device) -> int:
        """This rank's KV budget: as asked, else 90% of free GPU memory (after
        the weights are loaded) or a fixed amount of RAM."""
        if args.kv_cache_memory_bytes is not None:
            return args.kv_cache_memory_bytes
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0] * 0.9)
        return DEFAULT_CPU_KV_BYTES

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[pos // bs] * bs + pos % bs for pos in range(start, end)]

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step: the sequences due a token and what was sampled for
        them, in order."""
        seqs, logits = self.execute_model(sched.scheduled)
        if not seqs:
            return ModelRunnerOutput([], [], [])
        metadata = build_sampling_metadata(seqs, self.eos_token_ids, self.model.config.vocab_size, self.device)
        out = self.sampler(logits, metadata)
        return ModelRunnerOutput(seqs, out.sampled_token_ids, out.logprobs)

    @torch.inference_mode()
    def execute_model(self, scheduled: list) -> tuple[list, torch.Tensor | None]:
        """The forward pass of one step over (sequence, new tokens) pairs;
        a sequence is anything with token_ids, num_computed_tokens and
        block_table. Returns the sequences due a token and their logits
        (None on ranks other than 0)."""
        # Decodes first, longest context first, so the attention backend can
        # batch them in a few groups of similar length.
        decodes = sorted(((s, n) for s, n in scheduled if n == 1), key=lambda x: -x[0].num_computed_tokens)
        prefills = [(s, n) for s, n in scheduled if n > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        logits_indices: list[int] = []
        sample_seqs: list[Sequence] = []
        chunks: list[PrefillChunk] = []
        for seq, n in decodes + prefills:
            start, ctx_len = seq.num_computed_tokens, seq.num_computed_tokens + n
            q_start = len(input_ids)
            input_ids.extend(seq.token_ids[start:ctx_len])
            positions.extend(range(start, ctx_len))
            slot_mapping.extend(self._slots(seq, start, ctx_len))
            if n > 1 and self.triton_kernel is None:
                table = None
                if start > 0:
                    table = torch.tensor(seq.block_table[: -(-ctx_len // self.block_size)], device=self.device)
                chunks.append(PrefillChunk(q_start, q_start + n, ctx_len, table))
            if SchedulerOutput.due_token(seq, n):
                logits_indices.append(len(input_ids) - 1)
                sample_seqs.append(seq)

        slots = torch.tensor(slot_mapping, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(slot_mapping=slots, prefills=chunks)
        if self.triton_kernel is not None:
            meta.triton = self._triton_metadata(decodes + prefills)
        elif decodes:
            # The kernel reads each context at its own length: no padding, one group.
            meta.decodes = self._decode_groups([s for s, _ in decodes], 1.0 if self.decode_kernel else 0.25)

        with set_forward_context(meta):
            logits = self.model(
                torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device),
                torch.tensor(logits_indices, dtype=torch.long, device=self.device),
            )
        return sample_seqs, logits

    def _decode_groups(self, seqs: list[Sequence], max_waste: float) -> list[DecodeGroup]:
        """Split decodes (sorted longest first) into groups, starting a new
        one when padding to the group's longest would waste over max_waste
        of the keys read. Each group has padded block tables and the mask
        that hides the padding."""
        bs = self.block_size
        groups, start = [], 0
        while start < len(seqs):
            longest = seqs[start].num_computed_tokens + 1
            end, total = start, 0
            while end < len(seqs):
                n = seqs[end].num_computed_tokens + 1
                if total + n < (1 - max_waste) * longest * (end - start + 1):
                    break
                total += n
                end += 1
            group = seqs[start:end]
            max_blocks = -(-max(s.num_computed_tokens + 1 for s in group) // bs)
            tables = self._padded_block_tables(group, max_blocks)
            lens = torch.tensor([s.num_computed_tokens + 1 for s in group], dtype=torch.long, device=self.device)
            mask = None
            if self.decode_kernel is None:
                mask = (torch.arange(max_blocks * bs, device=self.device).unsqueeze(0) < lens.unsqueeze(1))[:, None, None]
            groups.append(DecodeGroup(start, end, tables, lens, mask))
            start = end
        return groups

    def _padded_block_tables(self, seqs: list[Sequence], max_blocks: int) -> torch.Tensor:
        """[len(seqs), max_blocks]: each sequence's first blocks, padded with 0."""
        rows = [s.block_table[:max_blocks] for s in seqs]
        padded = [r + [0] * (max_blocks - len(r)) for r in rows]
        return torch.tensor(padded, dtype=torch.long, device=self.device)

    def _triton_metadata(self, scheduled: list) -> TritonAttentionMetadata:
        """One row per (sequence, new tokens) pair, in the flat batch's order."""
        seq_lens = [s.num_computed_tokens + n for s, n in scheduled]
        max_blocks = -(-max(seq_lens) // self.block_size)
        query_start_loc = [0]
        for _, n in scheduled:
            query_start_loc.append(query_start_loc[-1] + n)
        return TritonAttentionMetadata(
            block_tables=self._padded_block_tables([s for s, _ in scheduled], max_blocks),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=self.device),
            max_query_len=max(n for _, n in scheduled),
        )
