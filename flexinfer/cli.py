"""The `flexinfer` command: generate, chat, bench, serve.

Exit status: 0 on success; 1 when a request failed (its error is printed);
2 for bad input or no memory (one line, `flexinfer: error: ...`). Anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
import time

import vtm
from flexinfer.attention import ATTENTION_BACKENDS
from flexinfer.llm import LLM
from flexinfer.errors import FlexInferError
from flexinfer.model.linear import LINEAR_KINDS
from flexinfer.sampling import SamplingParams
from flexinfer.server.main import add_serve_args, serve

# Errors caused by the user's input or the machine's limits, not by a bug.
_USER_ERRORS = (FlexInferError, vtm.InvalidArgument, vtm.OutOfMemory, vtm.Unavailable)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="'smollm2', a .gguf file or a Hugging Face folder")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--kv-capacity-gib", type=float, default=2.0, help="physical KV memory the pool may use")
    p.add_argument("--backend", default="auto", choices=["auto", "host", "cuda"])
    p.add_argument("--manager", default=None, metavar="unix:PATH",
                   help="use the vtm broker (vtmd) at this address instead of an in-process manager; "
                        "--backend and --kv-capacity-gib are then the broker's")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--linear", default="auto", choices=LINEAR_KINDS,
                   help="projection kernels: auto (timed at load per batch size), onednn (prepacked weights) "
                        "or torch (F.linear) (default: %(default)s)")
    p.add_argument("--attention", default="auto", choices=ATTENTION_BACKENDS,
                   help="attention: kernel (one batched call per layer; auto) or sdpa (per request, the reference)")
    p.add_argument("--threads", default="auto", type=_threads,
                   help="CPU compute threads: auto (measured while decoding) or a number (default: %(default)s)")


def _threads(value: str):
    if value == "auto":
        return value
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a positive number, got {value!r}")
    return count


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def _engine(args) -> LLM:
    manager = None
    if args.manager is not None:
        # Closed by main() after the command: an LLM never closes a manager it was given.
        manager = args.broker = vtm.connect(args.manager, name=f"flexinfer-{args.command}")
    return LLM(args.model, dtype=args.dtype, kv_capacity_bytes=int(args.kv_capacity_gib * (1 << 30)),
               backend=args.backend, max_model_len=args.max_model_len, manager=manager,
               enable_prefix_caching=not args.no_prefix_caching, linear=args.linear,
               attention=args.attention, threads=args.threads)


def _params(args) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed)


def cmd_generate(args) -> int:
    params = _params(args)  # before the model loads: a bad flag fails at once
    llm = _engine(args)
    try:
        for out in llm.generate(args.prompt, params):
            if out.outputs[0].error is not None:
                print(f"flexinfer: error: {out.outputs[0].error}", file=sys.stderr)
                return 1
            m = out.metrics
            print(out.prompt + out.text if args.echo else out.text)
            rate = m.decode_tokens_per_s
            print(f"[{m.output_tokens} tokens, TTFT {m.ttft_s * 1000:.0f} ms"
                  + (f", {rate:.1f} tok/s" if rate else "") + f", finish: {out.finish_reason}]", file=sys.stderr)
    finally:
        llm.close()
    return 0


def cmd_chat(args) -> int:
    params = _params(args)
    llm = _engine(args)
    history: list[dict] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("flexinfer chat: type a message; an empty line or Ctrl-D ends.", file=sys.stderr)
    try:
        while True:
            try:
                line = input("you> ").strip()
            except EOFError:
                break
            if not line:
                break
            history.append({"role": "user", "content": line})
            out = llm.chat(history, params)
            if out.outputs[0].error is not None:  # e.g. the conversation outgrew max_model_len
                print(f"flexinfer: error: {out.outputs[0].error}", file=sys.stderr)
                return 1
            history.append({"role": "assistant", "content": out.text})
            m = out.metrics
            print(f"assistant> {out.text}")
            print(f"  [prompt {m.prompt_tokens} tokens, {m.prefix_hit_tokens} reused from the prefix cache, "
                  f"TTFT {m.ttft_s * 1000:.0f} ms, {m.output_tokens} tokens"
                  + (f" at {m.decode_tokens_per_s:.1f} tok/s" if m.decode_tokens_per_s else "") + "]")
    finally:
        llm.close()
    return 0


def cmd_bench(args) -> int:
    llm = _engine(args)
    try:
        prompts = [f"Write a short story about the number {i}." for i in range(args.batch)]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm up
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        generated = sum(len(o.token_ids) for o in outs)
        print(f"batch {args.batch}: {generated} tokens in {elapsed:.2f} s = {generated / elapsed:.1f} tok/s")
    finally:
        llm.close()
    return 0


def cmd_serve(args) -> int:
    return serve(args, lambda: _engine(args))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flexinfer", description="LLM serving on vtm vTensor KV caches")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete one or more prompts")
    _add_engine_args(g)
    _add_sampling_args(g, 64)
    g.add_argument("--prompt", action="append", required=True, help="may be given several times")
    g.add_argument("--echo", action="store_true", help="print the prompt before the completion")
    g.set_defaults(fn=cmd_generate)
    c = sub.add_parser("chat", help="interactive multi-turn chat showing prefix reuse per turn")
    _add_engine_args(c)
    _add_sampling_args(c, 256)
    c.add_argument("--system", default=None, help="a system message")
    c.set_defaults(fn=cmd_chat)
    b = sub.add_parser("bench", help="decode throughput of a batch")
    _add_engine_args(b)
    b.add_argument("--batch", type=int, default=8)
    b.add_argument("--max-tokens", type=int, default=128)
    b.set_defaults(fn=cmd_bench)
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (docs/server.md)")
    _add_engine_args(s)
    add_serve_args(s)
    s.set_defaults(fn=cmd_serve)
    args = parser.parse_args(argv)
    args.broker = None
    try:
        return args.fn(args)
    except _USER_ERRORS as e:
        print(f"flexinfer: error: {e}", file=sys.stderr)
        return 2
    finally:
        if args.broker is not None:
            args.broker.close()


if __name__ == "__main__":
    sys.exit(main())
