"""nanoPD's command line: `python -m nanopd` generates text from a prompt, streaming it as
it comes; `python -m nanopd serve MODEL ...` starts the OpenAI-compatible server
(server.py). Every LLM setting is a flag of its name (setting_flag).
"""

import argparse
import dataclasses
import itertools
import json
import sys
import time
import types
import typing

import torch

from nanopd.cluster import ClusterConfig
from nanopd.config import EngineConfig
from nanopd.llm import LLM
from nanopd.model import PRESETS
from nanopd.request import SamplingParams, encode


def serve_main(argv: list[str]) -> None:
    """`python -m nanopd serve MODEL ...`: the OpenAI-compatible server (server.py) on LLM(MODEL,
    ...), every LLM setting a flag of its name (--max-num-seqs 64, --policy adaptive, --devices
    cuda:0 cuda:1, --sm-split 84 48, --split-menu 84/48 68/64, --speculative-config JSON, ...);
    a setting not given keeps LLM's default."""
    p = argparse.ArgumentParser(prog="python -m nanopd serve", description=serve_main.__doc__)
    p.add_argument("model", help="preset or HF checkpoint folder")
    p.add_argument("--policy", default=None, choices=["collocated", "disaggregated", "adaptive"],
                   help="none: one engine in this process")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="every endpoint but /health wants 'Authorization: Bearer KEY'")
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: MODEL)")
    p.add_argument("--max-pending", type=int, default=4096, help="requests held at once; past it, 503")
    p.add_argument("--drain-s", type=float, default=30.0,
                   help="on SIGTERM, how long requests in flight may finish (then they end with a 503)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="take a request's own chat_template (a Jinja program the server runs); else a 400")
    names = [f for f in dataclasses.fields(EngineConfig) + dataclasses.fields(ClusterConfig)
             if f.name not in ("model", "policy")]
    for f in names:
        setting_flag(p, f)
    args = p.parse_args(argv)
    settings = {f.name: getattr(args, f.name) for f in names if getattr(args, f.name) is not None}
    from nanopd import server
    try:   # the server's settings before the LLM's workers start
        server.check_serving(args.port, args.api_key, args.max_pending, args.drain_s)
        llm = LLM(args.model, policy=args.policy, **settings)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    with llm:
        server.serve(llm, args.host, args.port, args.api_key, args.served_model_name, args.max_pending,
                     args.drain_s, args.trust_request_chat_template)


def json_value(text: str) -> dict:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None


def split_value(text: str) -> tuple[int, int]:
    """An SM split written P/D (prefill SMs / decode SMs)."""
    parts = text.split("/")
    if len(parts) != 2 or not all(x.strip().isdigit() for x in parts):
        raise argparse.ArgumentTypeError(f"a split is P/D, prefill SMs / decode SMs (84/48), got {text!r}")
    return int(parts[0]), int(parts[1])


class AsTuple(argparse.Action):
    """A flag of several values kept as a tuple, as the setting's type has it."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, tuple(values))


def setting_flag(p: argparse.ArgumentParser, f: dataclasses.Field) -> None:
    """A flag for one LLM setting, parsed as its type says: a switch, a number, a string,
    JSON (a dict), several values (a list, a pair), or splits written P/D."""
    union = typing.get_origin(f.type) in (typing.Union, types.UnionType)
    kinds = set(typing.get_args(f.type)) - {type(None)} if union else {f.type}
    flag, pairs = "--" + f.name.replace("_", "-"), [typing.get_args(k) for k in kinds if typing.get_origin(k)]
    if bool in kinds:
        p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
    elif kinds & {int, float} and not pairs:
        p.add_argument(flag, type=float if float in kinds else int, default=None)
    elif dict in kinds:
        p.add_argument(flag, type=json_value, default=None, help="JSON")
    elif pairs and pairs[0][-1] is Ellipsis:   # splits: P/D each
        p.add_argument(flag, nargs="+", default=None, metavar="P/D", action=AsTuple, type=split_value)
    elif pairs and pairs[0][0] is str:   # a list of strings
        p.add_argument(flag, nargs="+", default=None)
    elif pairs:   # a pair of numbers
        p.add_argument(flag, nargs=len(pairs[0]), type=pairs[0][0], default=None, action=AsTuple)
    else:
        p.add_argument(flag, default=None)


def main() -> None:
    if sys.argv[1:2] == ["serve"]:
        return serve_main(sys.argv[2:])
    p = argparse.ArgumentParser(description="nanoPD: generate text, streaming it as it comes",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="qwen3-8b" if torch.cuda.is_available() else "tiny",
                   help="preset (tiny, qwen3-0.6b, qwen3-8b: the real architecture with random weights, so "
                        "the text means nothing; bytes for tokens, ids past 255 shown as ⟨id⟩) or a local HF "
                        "checkpoint folder (Qwen3, Qwen2/Qwen2.5 or Llama); the default is qwen3-8b on "
                        "a GPU, tiny without one")
    p.add_argument("--prompt", default="The quick brown fox", help="the prompt text")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 is greedy (always the most likely token)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the smallest set of this probability")
    p.add_argument("--top-k", type=int, default=-1, help="sample from the k most likely tokens; -1: all")
    p.add_argument("--seed", type=int, default=None, help="the request's random stream (sampling only); "
                   "none: a fresh one")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16; none: bfloat16 on a GPU, "
                   "float32 on a CPU")
    args = p.parse_args()
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed)   # before the model: a bad flag is one line
        llm = LLM(args.model, dtype=args.dtype)
        # its updates as they come (llm.py:Driver), the first once it is submitted and running
        updates = llm.updates([(args.prompt, params)], watch=True)
        start, (_, first) = time.perf_counter(), next(updates)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    engine, prompt_len = llm.engine, len(encode(args.prompt, llm.get_tokenizer()))
    random = " (random weights: the text means nothing)" if args.model in PRESETS else ""
    print(f"{args.model}{random} on {engine.model.device} ({engine.model.dtype}), "
          f"{engine.runner.num_blocks} KV blocks; prompt: {prompt_len} tokens")
    generated = 0
    for _, update in itertools.chain([(0, first)], updates):   # the last has what the others held back
        print(update.text, end="", flush=True)
        generated += len(update.ids)
    elapsed = time.perf_counter() - start
    print(f"\n[{generated} tokens in {elapsed:.2f} s: {generated / elapsed:.1f} tokens/s]")

if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:   # Ctrl-C: one line, and the shell's status for SIGINT
        print("\n[interrupted]", file=sys.stderr)
        raise SystemExit(130) from None
