"""`spmdkit generate`: complete prompts with a trained model, streaming the text as tokens arrive."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spmdkit.cli.args import ArgumentParser, add_cpu_devices, quiet_absl, use_cpu_devices
from spmdkit.errors import SpmdkitError
from spmdkit.plan.limits import check_sizes

PATH_HELP = "a run directory, its checkpoints/ directory (the newest step is used) or a Hugging Face model directory"


def parser() -> ArgumentParser:
    """`spmdkit generate` (its handler is `main`)."""
    p = ArgumentParser(
        prog="spmdkit generate",
        description="Complete prompts with the newest checkpoint of a run or a Hugging Face model directory: prefill, "
        "then a compiled decode loop with a KV cache. One prompt streams its text to stdout as the tokens arrive; "
        "several are decoded as one batch and printed in order. The model's own tokenizer is used (the one saved with "
        "the run, bytes for stdlib-trained runs, or the Hugging Face directory's) and its EOS stops a prompt. "
        "--mesh tensor=N splits every layer's heads and MLP over N devices (lower latency per token); data=N runs "
        "N replicas, each with its share of the prompts (more tokens per second). fsdp is refused: it would "
        "all-gather every weight for every token.",
    )
    add = p.add_argument
    add("path", metavar="PATH", help=PATH_HELP)
    add("--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeat for a batch)")
    add("--prompt-file", action="append", default=[], metavar="F", help="a file whose whole text is one prompt")
    add(
        "--max-new-tokens",
        type=int,
        metavar="N",
        help="new tokens per prompt at most; refused when the context cannot hold them (default: 64, or what fits)",
    )
    add("--temperature", type=float, default=0.8, metavar="T", help="0: greedy; higher: more random (default: 0.8)")
    add("--top-k", type=int, default=0, metavar="K", help="sample from the K most likely tokens (default: 0, off)")
    add("--top-p", type=float, default=0.95, metavar="P", help="nucleus sampling mass in (0, 1] (default: 0.95)")
    add("--seed", type=int, default=0, metavar="S", help="random seed: the same seed gives the same tokens on any mesh")
    add("--mesh", default="", help="inference mesh over tensor and data, e.g. 'tensor=2,data=4' (default: one device)")
    add(
        "--max-len",
        type=int,
        metavar="N",
        help="longest context, prompt + new tokens (default: the run's seq_len or the model's max positions)",
    )
    add(
        "--chat", action="store_true", help="each prompt is a conversation, as JSON: a list of {role, content} "
        "messages (or {\"messages\": [...]}); it is rendered with the model's chat template and its generation "
        "prompt, the reply printed, and a row stops at the template's end-of-turn token or EOS",
    )  # fmt: skip
    add("--chat-template", metavar="FILE", help="--chat: a Jinja chat template to use instead of the model's")
    add("--json", action="store_true", help="one JSON object per prompt per line, with token ids and timing")
    add_cpu_devices(p)
    return p


PROMPT_FILE_LIMIT = 1 << 20  # bytes: far beyond any model's context in text; /dev/zero is not read forever


def _read_prompt(name: str) -> str:
    """The text of a --prompt-file, read up to `PROMPT_FILE_LIMIT` bytes (more is refused)."""
    try:
        with open(name, "rb") as file:
            data = file.read(PROMPT_FILE_LIMIT + 1)
        if len(data) > PROMPT_FILE_LIMIT:
            raise SpmdkitError(
                f"--prompt-file {name} is larger than {PROMPT_FILE_LIMIT // 2**20} MiB, more text than any model's "
                "context holds: pass a shorter prompt"
            )
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise SpmdkitError(f"--prompt-file {name}: cannot read it as UTF-8 text ({error.__class__.__name__})") from None


def _prompts(args: argparse.Namespace) -> list[str]:
    prompts = [*args.prompt, *(_read_prompt(name) for name in args.prompt_file)]
    if not prompts:
        raise SpmdkitError("no prompt given: pass --prompt TEXT or --prompt-file F")
    if "" in prompts:
        raise SpmdkitError(f"prompt {prompts.index('') + 1} is empty: give it some text")
    return prompts


def check_source(args: argparse.Namespace) -> None:
    """--mesh and PATH (of `generate` and `eval`), before anything loads."""
    from spmdkit.inference.loading import check_mesh_spec

    if args.mesh:
        check_mesh_spec(args.mesh)
    if not Path(args.path).expanduser().exists():
        raise SpmdkitError(f"{args.path} does not exist: pass {PATH_HELP}")


def _new_tokens(args: argparse.Namespace, model: Any, prompts: list[Any]) -> int:
    """--max-new-tokens, checked against the context: a number given that cannot fit is refused; the default (64)
    is cut to what fits."""
    context = model.generator.max_len
    longest = max(len(model.encode(p)) for p in prompts)
    room = context - longest
    if args.max_new_tokens is None or room < 1:
        return max(1, min(64, room))  # a prompt that fills the context is refused by the generator, naming it
    if args.max_new_tokens > room:
        raise SpmdkitError(
            f"--max-new-tokens {args.max_new_tokens} does not fit: the longest prompt has {longest} tokens and the "
            f"model's context is {context} (--max-len): pass at most {room}"
        )
    return args.max_new_tokens


def _conversation(prompt: str, n: int) -> list[dict[str, Any]]:
    """Prompt `n` (1-based) of `generate --chat`, read as a conversation."""
    from spmdkit.data.prepare.chat import check_messages

    try:
        value = json.loads(prompt)
    except json.JSONDecodeError as error:
        raise SpmdkitError(f"--chat: prompt {n} is not JSON ({error.msg} at column {error.colno})") from None
    value = value.get("messages") if isinstance(value, dict) else value
    messages = check_messages(value, "messages")
    if isinstance(messages, str):
        raise SpmdkitError(f"--chat: prompt {n}: {messages}: pass a list of {{role, content}} messages")
    return messages


def _chat_prompts(args: argparse.Namespace, model: Any, prompts: list[str]) -> tuple[list[list[int]], list[int]]:
    """(the token ids of each conversation rendered with the generation prompt, the end-of-turn ids)."""
    from spmdkit.data.prepare.chat import ChatError, ChatRenderer, load_chat_template
    from spmdkit.interop import find_tokenizer_dir

    directory = find_tokenizer_dir(args.path)
    if directory is None and not args.chat_template:
        raise SpmdkitError(f"{args.path} has no tokenizer directory and so no chat template: pass --chat-template FILE")
    renderer = ChatRenderer(load_chat_template(directory, args.chat_template), model.tokenizer)
    ids = []
    for n, prompt in enumerate(prompts, start=1):
        try:
            ids.append(renderer.prompt_ids(_conversation(prompt, n)))
        except ChatError as error:
            raise SpmdkitError(f"--chat: prompt {n}: {error}") from None
    return ids, renderer.end_of_turn_ids()


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(list(argv))
    prompts = _prompts(args)
    if args.chat_template and not args.chat:
        raise SpmdkitError("--chat-template is for conversations: add --chat")
    if args.chat:
        for n, prompt in enumerate(prompts, start=1):
            _conversation(prompt, n)  # each a conversation, before anything loads
    quiet_absl()
    from spmdkit.inference.sampling import Sampling

    Sampling(args.max_new_tokens or 64, args.temperature, args.top_k, args.top_p, args.seed)  # the flags, checked
    if args.max_len is not None and args.max_len < 2:
        raise SpmdkitError(f"--max-len {args.max_len} must be at least 2")
    check_sizes({"--max-len": args.max_len})  # --max-new-tokens is checked against the context
    check_source(args)
    use_cpu_devices(args.cpu_devices)
    from spmdkit.inference.api import TextGenerator
    from spmdkit.inference.loading import inference_mesh

    mesh = inference_mesh(args.mesh)
    model = TextGenerator.load(args.path, mesh=mesh, max_len=args.max_len)
    if model.tokenizer is None:
        raise SpmdkitError(
            f"{args.path} has no tokenizer (trained on token ids, or saved without one): it cannot take text prompts"
        )
    inputs, stop = _chat_prompts(args, model, prompts) if args.chat else (prompts, [])
    sampling = Sampling(_new_tokens(args, model, inputs), args.temperature, args.top_k, args.top_p, args.seed)
    stream = not args.json and len(prompts) == 1
    if stream and not args.chat:  # a chat prints the reply only
        print(prompts[0], end="", flush=True)

    def show(row: int, text: str) -> None:
        print(text, end="", flush=True)

    completions = model.generate(inputs, sampling, on_text=show if stream else None, stop_tokens=stop)
    for prompt, completion in zip(prompts, completions, strict=True):
        if args.json:
            print(json.dumps({"prompt": prompt, **dataclasses.asdict(completion)}), flush=True)
        elif stream:
            print()
        else:
            print(f"{'' if args.chat else prompt}{completion.text}\n", flush=True)
    return 0
