"""`spmdkit data`: prepare a dataset from text (tokenize, pack into shards), inspect it, verify it."""

from __future__ import annotations

import argparse

from spmdkit.cli import SUMMARIES
from spmdkit.cli.args import CommandGroup, Subcommands, flag_values

HELP = SUMMARIES["data"]


def _prepare(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="text files, directories (recursive, --glob), JSONL (.jsonl/.json), Parquet, a `datasets` save_to_disk "
        "directory, json:GLOB | parquet:GLOB | text:GLOB (datasets.load_dataset on local files), or 'stdlib'",
    )
    p.add_argument(
        "--tokenizer",
        required=True,
        metavar="T",
        help="a Hugging Face tokenizer.json or a directory holding one, 'bytes' (the byte vocabulary), or bpe:N "
        "(train a byte-level BPE of N ids on the inputs, saved as OUT/tokenizer.json)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="new directory for the prepared dataset")
    p.add_argument("--glob", default="*", help="files to take from a directory, recursively (default: all)")
    p.add_argument(
        "--text-key", default="", metavar="KEY", help="JSON key / column holding the text (default: text; with "
        "--chat: messages, the conversations)",
    )  # fmt: skip
    p.add_argument(
        "--chat", action="store_true", help="the records are conversations (lists of role/content messages): "
        "render each with the tokenizer directory's chat template and store a loss mask scoring only the assistant "
        "turns (supervised fine-tuning data)",
    )  # fmt: skip
    p.add_argument(
        "--chat-template", metavar="FILE", help="--chat: a Jinja chat template to use instead of the tokenizer "
        "directory's (chat_template.jinja, or tokenizer_config.json's chat_template)",
    )  # fmt: skip
    p.add_argument(
        "--seq-len", type=int, default=0, metavar="N", help="--chat: the training --seq-len; a longer conversation "
        "is cut to N tokens or dropped (--chat-overflow), and counted",
    )  # fmt: skip
    p.add_argument(
        "--chat-overflow", default="truncate", choices=("truncate", "drop"), help="--chat: what to do with a "
        "conversation longer than --seq-len (default truncate)",
    )  # fmt: skip
    p.add_argument("--split", default="train", help="split of a datasets DatasetDict or load_dataset input")
    p.add_argument("--skip-bad", action="store_true", help="count and skip bad records instead of stopping")
    p.add_argument(
        "--dtype", default="auto", choices=("auto", "uint16", "uint32"), help="token dtype (auto: uint16 if it fits)"
    )
    p.add_argument("--shard-tokens", type=int, default=1 << 28, metavar="N", help="tokens per shard at most")
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        metavar="N",
        help="tokenizer processes (default 0: one per CPU core); the output is the same for any N",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _directory(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", metavar="DIR", help="a prepared dataset")


def run_prepare(args: argparse.Namespace) -> int:
    from spmdkit.data.prepare import PrepareOptions, prepare

    names = (
        "tokenizer", "out", "glob", "text_key", "split", "skip_bad", "dtype", "shard_tokens", "workers", "chat",
        "chat_template", "seq_len", "chat_overflow",
    )  # fmt: skip
    options = PrepareOptions(inputs=tuple(args.inputs), progress=not args.no_progress, **flag_values(args, *names))
    prepare(options)
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    from spmdkit.data.store import PreparedDataset

    meta = PreparedDataset(args.directory).meta
    tok = meta["tokenizer"]
    summary = "\n".join(
        [
            f"documents   {meta['documents']:,}",
            f"tokens      {meta['tokens']:,} ({meta['dtype']}, {len(meta['shards'])} shard(s), largest id "
            f"{meta.get('max_token_id', 'not recorded')})",
            f"text        {meta['bytes']:,} bytes ({meta['tokens'] / max(meta['bytes'], 1):.3f} tokens/byte)",
            f"tokenizer   {tok['name']}: {tok['vocab_size']:,} ids (model vocab {tok['model_vocab_size']:,}), "
            f"bos {tok['bos_id']}, eos {tok['eos_id']}, sha256 {tok['sha256'][:16]}",
            f"content     sha256 {meta['content_sha256']}",
            f"skipped     {sum(meta.get('skipped', {}).values()):,} bad records",
        ]
        + _chat_lines(meta.get("chat"))
    )
    print(summary)
    return 0


def _chat_lines(chat: dict | None) -> list[str]:
    if not chat:
        return []
    return [
        f"chat        loss mask: {chat['scored_tokens']:,} assistant tokens scored ({chat['mask_rule']}); "
        f"--seq-len {chat['max_tokens']} ({chat['overflow']}): {chat['truncated']:,} truncated, {chat['dropped']:,} "
        f"dropped; {chat['unscored']:,} without an assistant token dropped"
    ]


def run_verify(args: argparse.Namespace) -> int:
    from spmdkit.data.store import PreparedDataset

    meta = PreparedDataset(args.directory).verify()
    chunks = sum(len(s.get("chunks", ())) for s in meta["shards"])
    checked = f", {chunks} chunk checksum(s)" if "chunk_tokens" in meta else " (no chunk checksums: an older dataset)"
    print(f"{args.directory}: ok, {len(meta['shards'])} shard(s){checked} and the index match dataset.json")
    return 0


SUBCOMMANDS: Subcommands = {
    "prepare": ("tokenize text into a prepared dataset: shards, document index, dataset.json", _prepare, run_prepare),
    "inspect": ("what a prepared dataset holds (quick checks of its files)", _directory, run_inspect),
    "verify": ("read every file of a prepared dataset and check its hashes", _directory, run_verify),
}


GROUP = CommandGroup("spmdkit data", HELP, SUBCOMMANDS)
parser, subcommand_parser, parse, main = GROUP.parser, GROUP.subcommand_parser, GROUP.parse, GROUP.main
