"""One vLLM instance (offline ``LLM``, CPU build) driven by JSON lines: the party that ``bench vllm`` and the
``vllm`` tests start, in the interpreter where vLLM is installed (``python -m tensorwire.bench.vllm_instance``).

    python -m tensorwire.bench.vllm_instance make-model DIR --seed 0     # a tiny random-weights Llama
    python -m tensorwire.bench.vllm_instance serve --model DIR --role consumer --connector tensorwire ...

``serve`` prints ``{"ready": ...}`` once the engine is up, then answers one JSON line per request line on stdin:
``{"op": "generate", "prompts": [[ids]], "params": [kv_transfer_params | null], "max_tokens": n}`` ->
``{"outputs": [{"tokens", "logprobs", "kv_transfer_params", "finish_reason"}], "wall_s"}``; ``{"op": "stats"}``
-> the connector's ``get_kv_connector_stats`` observations since the last ``stats`` (``{"stats": {key: [..]}}``);
``{"op": "exit"}``. The connectors are recorded by thin subclasses that write what the connector itself reports
to a file (``TENSORWIRE_VLLM_STATS``) and change nothing else: the same figure for TensorwireConnector and
vLLM's NixlConnector. Imports vLLM: nothing else in tensorwire imports this module.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from typing import Any

__all__ = ["make_model", "main", "take_stats", "transfer_config"]

STATS_ENV = "TENSORWIRE_VLLM_STATS"  # where the recording connectors append their observations
TINY_LLAMA = {  # hidden 256, 2 layers, 2 KV heads of 64: KV blocks of 16 KiB per layer per 32 tokens in float32
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}


def make_model(directory: str, seed: int) -> None:
    """Write the tiny Llama with random weights drawn from ``seed`` to ``directory`` (3.4 MB)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(directory)


def _record(stats: Any) -> Any:
    if stats is not None and os.environ.get(STATS_ENV):
        with open(os.environ[STATS_ENV], "a") as f:
            f.write(json.dumps(stats.data) + "\n")
    return stats


@functools.cache
def _recording(base: type) -> type:
    return type(f"Recording{base.__name__}", (base,), {
        "get_kv_connector_stats": lambda self: _record(base.get_kv_connector_stats(self)),
        "__module__": __name__})


def __getattr__(name: str) -> Any:  # vLLM looks the recording connectors up by name in this module
    if name == "RecordingTensorwireConnector":
        from tensorwire.integrations.vllm import TensorwireConnector

        return _recording(TensorwireConnector)
    if name == "RecordingNixlConnector":
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

        return _recording(NixlConnector)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def transfer_config(role: str, connector: str, policy: str, **extra: Any) -> dict[str, Any]:
    """The ``KVTransferConfig`` fields of a recording connector: ``role`` ``producer`` or ``consumer``; ``extra``
    TensorwireConnector's ``kv_connector_extra_config`` (directory, name, timeout_s, hold_s)."""
    if connector == "nixl":
        name, extra = "RecordingNixlConnector", {"num_threads": 0}  # vLLM's default of 4 saturates 2 cores
    else:
        name = "RecordingTensorwireConnector"
    return {"kv_connector": name, "kv_connector_module_path": __name__, "kv_buffer_device": "cpu",
            "kv_role": {"producer": "kv_producer", "consumer": "kv_consumer"}[role], "kv_connector_extra_config": extra,
            "kv_load_failure_policy": policy}


def _transfer_config(args: argparse.Namespace) -> Any:
    from vllm.config import KVTransferConfig

    if args.role == "plain":
        return None
    return KVTransferConfig(**transfer_config(args.role, args.connector, args.policy, directory=args.directory,
                                              name=args.name, timeout_s=args.timeout, hold_s=args.hold))


def _generate(llm: Any, request: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    params = [SamplingParams(temperature=0, ignore_eos=True, detokenize=False, logprobs=1,
                             max_tokens=request.get("max_tokens", 8),
                             extra_args={"kv_transfer_params": p} if p else None)
              for p in request.get("params") or [None] * len(prompts)]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall_s = time.perf_counter() - started
    answers = []
    for out in outputs:
        completion = out.outputs[0]
        logprobs = [lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs or [])]
        answers.append({"tokens": list(completion.token_ids), "logprobs": logprobs,
                        "kv_transfer_params": out.kv_transfer_params, "finish_reason": completion.finish_reason})
    return {"outputs": answers, "wall_s": wall_s}


def take_stats(path: str | None) -> dict[str, list]:
    """What the recording connector wrote to ``path`` since the last call, merged (key -> observations); the file
    is emptied."""
    merged: dict[str, list] = {}
    if path and os.path.exists(path):
        with open(path) as f:
            lines = f.readlines()
        os.truncate(path, 0)
        for line in lines:
            for key, values in json.loads(line).items():
                merged.setdefault(key, []).extend(values if isinstance(values, list) else [values])
    return merged


def _stats() -> dict[str, Any]:
    return {"stats": take_stats(os.environ.get(STATS_ENV))}


def serve(args: argparse.Namespace) -> None:
    from vllm import LLM

    started = time.perf_counter()
    llm = LLM(model=args.model, dtype="float32", skip_tokenizer_init=True, load_format="auto", enforce_eager=True,
              block_size=args.block_size, max_model_len=2048, kv_cache_memory_bytes=args.kv_mb << 20, seed=0,
              tensor_parallel_size=args.tp, kv_transfer_config=_transfer_config(args))
    print(json.dumps({"ready": True, "startup_s": time.perf_counter() - started}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "exit":
            break
        answer = _generate(llm, request) if request["op"] == "generate" else _stats()
        print(json.dumps(answer), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tensorwire.bench.vllm_instance")
    commands = parser.add_subparsers(dest="command", required=True)
    model = commands.add_parser("make-model")
    model.add_argument("directory")
    model.add_argument("--seed", type=int, default=0)
    run = commands.add_parser("serve")
    run.add_argument("--model", required=True)
    run.add_argument("--role", choices=("plain", "producer", "consumer"), required=True)
    run.add_argument("--connector", choices=("tensorwire", "nixl"), default="tensorwire")
    run.add_argument("--directory")
    run.add_argument("--name")
    run.add_argument("--policy", choices=("recompute", "fail"), default="recompute")
    run.add_argument("--block-size", type=int, default=96)
    run.add_argument("--kv-mb", type=int, default=128)
    run.add_argument("--timeout", type=float, default=30.0)
    run.add_argument("--hold", type=float, default=120.0)
    run.add_argument("--tp", type=int, default=1, help="tensor-parallel size (workers of one instance)")
    args = parser.parse_args(argv)
    if args.command == "make-model":
        make_model(args.directory, args.seed)
    else:
        serve(args)


if __name__ == "__main__":
    main()
