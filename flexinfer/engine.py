"""LLM: the user-facing engine. Loads a model, owns its KV cache space on a
vtm manager (its own, or one shared with other engines), and runs the
scheduler's steps until every request is done."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

import vtm
from flexinfer.attention import KernelAttention, make_attention
from flexinfer.errors import InvalidArgument
from flexinfer.kv_cache import KVCache
from flexinfer.model.linear import resolve_linear_kind
from flexinfer.model.llama import ForwardBatch, LlamaModel
from flexinfer.model.loader import load_model
from flexinfer.sampling import SamplingParams, sample
from flexinfer.scheduler import Scheduler
from flexinfer.sequence import RequestMetrics, Sequence
from flexinfer.threads import ThreadTuner

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    metrics: RequestMetrics
    error: Exception | None = None


@dataclass
class RequestOutput:
    """One request's result. `text`, `token_ids`, `metrics` are those of its first sample."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def metrics(self) -> RequestMetrics:
        return self.outputs[0].metrics

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


class LLM:
    def __init__(self, model: str, dtype: str = "float32", kv_capacity_bytes: int = 2 << 30,
                 manager: vtm.Manager | None = None, backend: str = "auto", device: str | None = None,
                 max_num_seqs: int = 32, max_model_len: int | None = None, max_batch_tokens: int = 1024,
                 enable_prefix_caching: bool = True, attention: str = "auto", chunk_bytes: int = 2 << 20,
                 workers: int = 1, namespace: str | None = None, layer_groups: int = 1,
                 linear: str = "auto", threads: int | str = "auto", cuda_graphs: bool | None = None):
        if dtype not in _DTYPES:
            raise InvalidArgument(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        for name, value in (("max_num_seqs", max_num_seqs), ("max_batch_tokens", max_batch_tokens)):
            if value < 1:
                raise InvalidArgument(f"{name} must be >= 1, got {value}")
        if threads != "auto" and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise InvalidArgument(f"threads must be 'auto' or a positive int, got {threads!r}")
        self.dtype = _DTYPES[dtype]
        self._own_manager = manager is None
        if manager is None:
            manager = vtm.Manager(backend=backend, capacity_bytes=kv_capacity_bytes, chunk_bytes=chunk_bytes,
                                  workers=workers, prealloc_chunks=4)
        self.manager = manager
        self.kv_cache = None
        self.graphs = None
        self._sink = []
        try:
            if device is None:
                device = "cuda" if manager.backend == "cuda" else "cpu"
            self.device = torch.device(device)
            if (self.device.type == "cuda") != (manager.backend == "cuda"):
                raise InvalidArgument(f"device {device} does not match the vtm backend {manager.backend}")
            if self.device.type == "cpu" and self.dtype == torch.float16:
                raise InvalidArgument("float16 is supported on CUDA only; use float32 or bfloat16 on CPU")
            # Every cheap check before the weights load.
            linear = resolve_linear_kind(linear, self.device, self.dtype)
            self.attention = make_attention(attention, self.device)
            # Decode as CUDA graph replays: on by default where the batched kernels run on CUDA.
            if cuda_graphs is None:
                cuda_graphs = self.device.type == "cuda" and isinstance(self.attention, KernelAttention)
            if cuda_graphs and (self.device.type != "cuda" or not isinstance(self.attention, KernelAttention)):
                raise InvalidArgument("cuda_graphs needs a CUDA device and attention='kernel' (or 'auto')")
            loaded = load_model(model, self.dtype)
            self.config = loaded.config
            self.tokenizer = loaded.tokenizer
            self.model = LlamaModel(loaded.config, loaded.weights, self.dtype, self.device, linear=linear,
                                    consume_weights=True)
            del loaded
            self.max_model_len = min(max_model_len or self.config.max_position_embeddings,
                                     self.config.max_position_embeddings)
            # With graphs, one more slot: the sink that padding rows write into.
            self.kv_cache = KVCache(manager, self.config, self.dtype, self.max_model_len,
                                    max_num_seqs + (1 if cuda_graphs else 0),
                                    namespace=namespace or f"{model}:{dtype}", layer_groups=layer_groups)
            if cuda_graphs:
                from flexinfer.cuda_graphs import DecodeGraphs

                self._sink = self.kv_cache.create(1)
                self.graphs = DecodeGraphs(self.model, self.kv_cache, self.attention, max_num_seqs,
                                           [vt.slot for vt in self._sink])
            self.scheduler = Scheduler(self.kv_cache, max_num_seqs, max_batch_tokens, enable_prefix_caching)
            # CPU threads: measured while decoding ("auto", see threads.py) or fixed.
            self.thread_tuner = None
            if self.device.type == "cpu":
                self.thread_tuner = (ThreadTuner() if threads == "auto"
                                     else ThreadTuner(max_threads=threads, adaptive=False))
        except BaseException:
            # A failed constructor leaves nothing behind: no space on a shared
            # manager, no manager of its own.
            if self.kv_cache is not None:
                self.kv_cache.release(self._sink)
                self.kv_cache.close()
            if self._own_manager:
                manager.close()
            raise
        self._ids = itertools.count()

    # -- public API -----------------------------------------------------

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | None = None, priorities: list[int] | None = None) -> list[RequestOutput]:
        """Complete each prompt (a string or a list of token ids)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidArgument("one SamplingParams per prompt, or a single one for all")
        outputs: list[RequestOutput] = []
        seqs: list[Sequence] = []
        for index, (prompt, p) in enumerate(zip(prompts, params)):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            outputs.append(RequestOutput(prompt if isinstance(prompt, str) else None, ids))
            leader = None
            for sample_index in range(p.n):
                seq = Sequence(next(self._ids), index, sample_index, ids, p,
                               priorities[index] if priorities else 0, self.config.eos_token_ids)
                seq.leader = leader
                leader = leader or seq
                seqs.append(seq)
                self._validate(seq)
        for seq in seqs:
            if seq.error is None:
                self.scheduler.add(seq)
        show = use_tqdm if use_tqdm is not None else len(seqs) > 1
        with tqdm(total=len(seqs), desc="generate", disable=not show, unit="seq") as bar:
            done = sum(seq.error is not None for seq in seqs)
            bar.update(done)
            while self.scheduler.has_work():
                self.step()
                now_done = sum(s.finish_reason is not None for s in seqs)
                bar.update(now_done - done)
                done = now_done
        self.scheduler.drain()
        for seq in seqs:
            text = self._text(seq)
            outputs[seq.request_index].outputs.append(
                CompletionOutput(text, list(seq.output_ids), seq.finish_reason, seq.metrics, seq.error))
        return outputs

    def chat(self, conversations, sampling_params: SamplingParams | None = None, **kwargs):
        """Apply the chat template and generate. One conversation (a list of
        messages) gives one RequestOutput; a list of conversations, a list.
        Earlier turns are mapped from the prefix cache, not recomputed."""
        single = bool(conversations) and isinstance(conversations[0], dict)
        convs = [conversations] if single else conversations
        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(c, add_generation_prompt=True),
                                         add_special_tokens=False) for c in convs]
        outs = self.generate(prompts, sampling_params or SamplingParams(max_tokens=256, temperature=0.0), **kwargs)
        return outs[0] if single else outs

    def close(self) -> None:
        """Release the KV space (and the manager, when this engine made it)."""
        if self.thread_tuner is not None:
            self.thread_tuner.close()
        self.graphs = None
        self.kv_cache.release(self._sink)
        self._sink = []
        self.kv_cache.close()
        if self._own_manager:
            self.manager.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- one step -------------------------------------------------------

    def step(self) -> None:
        plan = self.scheduler.schedule()
        if not plan:
            return
        ids = []
        for seq, n in plan:
            ids.extend(seq.tokens_between(seq.num_cached, seq.num_cached + n))
        decode_batch = len(plan) if all(n == 1 for _, n in plan) else None
        if self.thread_tuner is not None:
            self.thread_tuner.before_step(decode_batch)
        started = time.perf_counter()
        if self.graphs is not None and decode_batch and self.graphs.bucket_for(decode_batch):
            logits = self.graphs.run(ids, [seq.slots for seq, _ in plan], [seq.num_cached for seq, _ in plan])
        else:
            batch = ForwardBatch.build([seq.slots for seq, _ in plan], [seq.num_cached for seq, _ in plan],
                                       [n for _, n in plan], self.device)
            input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
            logits = self.model.forward(input_ids, batch, self.kv_cache, self.attention)
        if self.thread_tuner is not None:
            self.thread_tuner.after_step(decode_batch, time.perf_counter() - started)
        ready_rows, ready = [], []
        for row, (seq, n) in enumerate(plan):
            seq.num_cached += n
            if seq.num_cached == seq.num_tokens:  # not in the middle of a chunked prompt
                if not seq.prompt_recorded:
                    self.scheduler.after_prefill(seq)
                ready_rows.append(row)
                ready.append(seq)
        if not ready:
            return
        rows = logits[ready_rows] if len(ready_rows) < len(plan) else logits
        params = [s.params for s in ready]
        # Greedy rows are chosen where the logits are; only sampled ones come to the host.
        if not all(p.greedy for p in params):
            rows = rows.cpu()
        tokens = sample(rows, params, [s.generator for s in ready])
        now = time.perf_counter()
        for seq, token in zip(ready, tokens):
            seq.output_ids.append(token)
            seq.metrics.output_tokens = len(seq.output_ids)
            if seq.metrics.first_token_s is None:
                seq.metrics.first_token_s = now
            reason = self._stop_reason(seq, token)
            if reason is not None:
                seq.metrics.finish_s = now
                self.scheduler.finish(seq, reason)

    # -- helpers --------------------------------------------------------

    def _validate(self, seq: Sequence) -> None:
        total = len(seq.prompt_ids) + seq.params.max_tokens
        problem = None
        if not seq.prompt_ids:
            problem = "the prompt is empty"
        elif total > self.max_model_len:
            problem = (f"prompt ({len(seq.prompt_ids)} tokens) + max_tokens ({seq.params.max_tokens}) exceeds "
                       f"max_model_len {self.max_model_len}")
        elif max(seq.prompt_ids) >= self.config.vocab_size or min(seq.prompt_ids) < 0:
            problem = "a prompt token id is outside the vocabulary"
        if problem:
            seq.error = InvalidArgument(problem)
            seq.finish_reason = "error"

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        if token in seq.stop_ids:
            return "stop"
        if seq.params.stop:
            # Decode only what the new token adds (constant cost per step).
            new_text, seq.prefix_offset, seq.read_offset = self.tokenizer.decode_incremental(
                seq.output_ids, seq.prefix_offset, seq.read_offset)
            seq.text += new_text
            if any(s in seq.text for s in seq.params.stop):
                return "stop"
        if len(seq.output_ids) >= seq.params.max_tokens:
            return "length"
        return None

    def _text(self, seq: Sequence) -> str:
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        for stop in seq.params.stop:
            cut = text.find(stop)
            if cut >= 0:
                text = text[:cut]
        return text
