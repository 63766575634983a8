"""Chat data for supervised fine-tuning (`data prepare --chat`), judged by transformers: the released chat templates
of Llama 3.3, Qwen 3 and Gemma 2 (tests/chat_templates, sources in SOURCES.md) with tiny BPE tokenizers written
by `tokenizers` and saved by transformers render to exactly `apply_chat_template(..., tokenize=True)`'s ids; a
template with `{% generation %}` blocks gives exactly transformers' `return_assistant_tokens_mask`; the span rule
(templates without such blocks) scores the hand-checked characters; the prepared dataset's rows carry the mask,
and one SFT step on one device has transformers' loss with labels -100 outside the assistant tokens."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import tokenizers
import transformers
from fixtures import run_cli
from hf_reference import save_model
from support import run_spmdkit
from tokenizers import decoders, models, pre_tokenizers, trainers

from spmdkit.data.config import DataConfig
from spmdkit.data.prepare.chat import ChatRenderer, load_chat_template
from spmdkit.data.store import PreparedDataset
from spmdkit.data.stream import make_data
from spmdkit.data.tokenizer import load_tokenizer
from spmdkit.train.reporting.metrics import read_metrics

TEMPLATES = Path(__file__).parent / "chat_templates"
# family: (template, bos, eos, special tokens, plain added tokens), as the released tokenizers have them
FAMILIES = {
    "llama3": (
        "meta-llama-Llama-3.3-70B-Instruct", "<|begin_of_text|>", "<|eot_id|>",
        ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>", "<|end_of_text|>"], [],
    ),
    "qwen3": (
        "Qwen-Qwen3-0.6B", None, "<|im_end|>", ["<|im_start|>", "<|endoftext|>"],
        ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
    ),
    "gemma2": ("google-gemma-2-2b-it", "<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>", "<pad>"], []),
    "gemma2-generation": ("gemma-2-generation", "<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>", "<pad>"], []),
}  # fmt: skip
WORDS = "hello there how are you today fine thanks what is the capital of france paris weather sunny rain".split()
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TURNS = [
    {"role": "user", "content": "Hello there"},
    {"role": "assistant", "content": "I am fine, thanks."},
    {"role": "user", "content": " What is the capital of France?\n"},
    {"role": "assistant", "content": " Paris is the capital. "},
]
TOOLS = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL]},
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny."},
]


def _make_tokenizer(directory: Path, family: str) -> Path:
    """A byte-level BPE of ~400 ids with the family's specials, saved by transformers with the family's template."""
    template, bos, eos, specials, plain = FAMILIES[family]
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    texts = [" ".join(WORDS), "You are a helpful assistant. Let me check. It is sunny.", json.dumps(CALL)] * 4
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    names = [t for t in (bos, eos, *specials) if t]
    hf.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=names, initial_alphabet=alphabet))
    hf.add_tokens(plain)
    transformers.PreTrainedTokenizerFast(tokenizer_object=hf, bos_token=bos, eos_token=eos).save_pretrained(directory)
    (directory / "chat_template.jinja").write_bytes((TEMPLATES / f"{template}.jinja").read_bytes())
    return directory


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return {family: _make_tokenizer(root / family, family) for family in FAMILIES}


def _ours(directory: Path) -> ChatRenderer:
    return ChatRenderer(load_chat_template(directory), load_tokenizer(directory))


def _conversations(family: str) -> list[list[dict]]:
    gemma = family.startswith("gemma")  # no system role, no tool role
    thought = [*TURNS[:3], dict(TURNS[3], thinking="France: Paris.")]  # reasoning, under a name to alias
    return [TURNS] if gemma else [[SYSTEM, *TURNS], TURNS, [SYSTEM, *TOOLS], thought]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rendered_ids_are_apply_chat_template_ids(tokenizer_dirs, family):
    ours = _ours(tokenizer_dirs[family])
    theirs = transformers.AutoTokenizer.from_pretrained(tokenizer_dirs[family])
    for messages in _conversations(family):
        _, ids, mask = ours.encode(messages)
        expected = theirs.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        assert ids.tolist() == list(expected)
        assert len(mask) == len(ids) and 0 < mask.sum() < len(ids)


def test_generation_blocks_give_transformers_assistant_mask(tokenizer_dirs):
    directory = tokenizer_dirs["gemma2-generation"]
    ours, theirs = _ours(directory), transformers.AutoTokenizer.from_pretrained(directory)
    assert ours.has_generation
    for messages in (TURNS, TURNS[:2], [TURNS[0], {"role": "assistant", "content": "hello " * 30}]):
        _, ids, mask = ours.encode(messages)
        out = theirs.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids.tolist() == list(out["input_ids"]) and mask.tolist() == list(out["assistant_masks"])


def _scored_text(renderer: ChatRenderer, directory: Path, messages: list[dict]) -> str:
    """The scored tokens decoded, one '|' between runs of them."""
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    _, ids, mask = renderer.encode(messages)
    runs, current = [], []
    for token, scored in zip(ids.tolist(), mask.tolist(), strict=True):
        if scored:
            current.append(token)
        elif current:
            runs.append(theirs.decode(current))
            current = []
    return "|".join([*runs, theirs.decode(current)] if current else runs)


def test_the_span_rule_scores_assistant_content_through_the_end_of_turn(tokenizer_dirs):
    """Hand-checked: each assistant content as rendered (Llama and Gemma trim it) through the turn's end token; what
    Qwen writes after the content (its tool call) is part of the turn; Llama's tool call turn renders no content."""
    expected = {
        "llama3": "I am fine, thanks.<|eot_id|>|Paris is the capital.<|eot_id|>",
        "gemma2": "I am fine, thanks.<end_of_turn>|Paris is the capital.<end_of_turn>",
        "qwen3": "I am fine, thanks.<|im_end|>| Paris is the capital. <|im_end|>",
    }
    for family, text in expected.items():
        assert _scored_text(_ours(tokenizer_dirs[family]), tokenizer_dirs[family], TURNS) == text
    qwen = _ours(tokenizer_dirs["qwen3"])
    call = '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    assert _scored_text(qwen, tokenizer_dirs["qwen3"], TOOLS) == f"Let me check.{call}|It is sunny.<|im_end|>"
    llama = _ours(tokenizer_dirs["llama3"])
    assert _scored_text(llama, tokenizer_dirs["llama3"], TOOLS) == "It is sunny.<|eot_id|>"
    assert llama.unscored_turns == 1  # the tool call turn: Llama's template writes the call, not the content


def _rows(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))
    rows = []
    for _ in range(count):
        turns = []
        for _ in range(rng.randint(1, 2)):
            turns += [{"role": "user", "content": words(rng.randint(1, 4))}]
            turns += [{"role": "assistant", "content": words(rng.randint(1, 6))}]
        rows.append({"messages": turns})
    return rows


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_prepare_stores_the_mask_and_counts_overflow(tokenizer_dirs, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory = tokenizer_dirs["gemma2-generation"]
    long = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello " * 40}]}
    rows = [*_rows(1, 6), long]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chats.parquet")  # list<struct> columns, as datasets have
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    refs = [
        theirs.apply_chat_template(row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        for row in rows
    ]
    over = sum(len(ref["input_ids"]) > 32 for ref in refs)
    assert 1 <= over < len(rows)
    for overflow in ("truncate", "drop"):
        out = tmp_path / overflow
        argv = ["data", "prepare", str(tmp_path / "chats.parquet"), "--chat", "--tokenizer", str(directory)]
        code, stdout, err = run_cli(capsys, *argv, "--seq-len", "32", "--chat-overflow", overflow, "--out", str(out))
        assert code == 0, err
        dataset = PreparedDataset(out)
        chat = dataset.meta["chat"]
        kept = refs if overflow == "truncate" else [ref for ref in refs if len(ref["input_ids"]) <= 32]
        assert (dataset.documents, chat["truncated"] + chat["dropped"]) == (len(kept), over)
        assert f"{chat['truncated']} truncated and {chat['dropped']} dropped at --seq-len 32" in stdout
        assert dataset.has_mask and chat["mask_rule"] == "generation blocks"
        for doc, ref in enumerate(kept):
            assert dataset.document(doc).tolist() == list(ref["input_ids"])[:32]
            assert dataset.read_mask(doc, 0, int(dataset.lengths[doc])).tolist() == list(ref["assistant_masks"])[:32]
        assert chat["scored_tokens"] == sum(int(dataset.read_mask(d, 1, int(n)).sum()) for d, n in
                                            enumerate(dataset.lengths))  # fmt: skip
    assert run_cli(capsys, "data", "verify", str(tmp_path / "drop"))[0] == 0


SEQ, BATCH = 64, 4
LLAMA = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128,
)  # fmt: skip


def test_sft_step_loss_is_transformers_loss_on_assistant_labels(tokenizer_dirs, tmp_path, capsys):
    """A random tiny Llama (transformers' save) with the generation template's tokenizer: spmdkit's step-1 loss on
    one device is transformers' mean cross-entropy over the batch's conversations with labels -100 outside the
    assistant mask transformers computes (1e-5)."""
    import shutil

    import torch
    from hf_reference import load

    model_dir = tmp_path / "model"
    shutil.copytree(tokenizer_dirs["gemma2-generation"], model_dir)
    vocab = load_tokenizer(model_dir).vocab_size  # generation samples among the tokenizer's ids, as transformers
    save_model(transformers.LlamaConfig(vocab_size=vocab, **LLAMA), model_dir, seed=3)
    rows = _rows(2, 40)
    data = tmp_path / "sft"
    argv = ["data", "prepare", str(_write_jsonl(tmp_path / "c.jsonl", rows)), "--chat", "--tokenizer", str(model_dir)]
    assert run_cli(capsys, *argv, "--seq-len", str(SEQ), "--out", str(data))[0] == 0
    train = [
        "train", "--init-from", str(model_dir), "--data", str(data), "--cpu-devices", "1", "--dtype", "float32",
        "--steps", "1", "--batch-size", str(BATCH), "--seq-len", str(SEQ), "--eval-every", "0", "--log-every", "1",
        "--run-dir", str(tmp_path / "run"), "--no-progress",
    ]  # fmt: skip
    done = run_spmdkit(*train)
    assert done.returncode == 0, done.stderr[-2000:]
    ours = read_metrics(tmp_path / "run")[0]["loss"]

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    judged = {}
    for row in rows:
        out = tokenizer.apply_chat_template(
            row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        judged[tuple(out["input_ids"])] = out["assistant_masks"]
    batch = next(make_data(DataConfig(source=str(data)), seq_len=SEQ, global_batch=BATCH, vocab_size=vocab, seed=0))
    model, total, scored = load(model_dir), 0.0, 0
    for r in range(BATCH):
        for segment in range(1, batch["segment_ids"][r].max() + 1):
            where = batch["segment_ids"][r] == segment
            ids = batch["inputs"][r][where].astype(np.int64)
            mask = np.asarray(judged[tuple(ids.tolist())])
            assert batch["loss_mask"][r][where][:-1].tolist() == mask[1:].tolist()  # target t + 1 scored as stored
            labels = torch.tensor(np.where(mask == 1, ids, -100))[None]
            with torch.no_grad():
                loss = model(input_ids=torch.tensor(ids)[None], labels=labels).loss
            count = int((mask[1:] == 1).sum())
            total, scored = total + float(loss) * count, scored + count
    assert scored == int(batch["loss_mask"].sum()) and abs(ours - total / scored) <= 1e-5 * (total / scored)

    # generate --chat: the conversation rendered with the generation prompt, greedy tokens as transformers'
    chat = json.dumps(TURNS[:3])
    argv = ["generate", str(model_dir), "--chat", "--prompt", chat, "--temperature", "0", "--max-new-tokens", "4"]
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    result = json.loads(out.splitlines()[-1])
    prompt = tokenizer.apply_chat_template(TURNS[:3], tokenize=True, return_dict=True, add_generation_prompt=True)
    assert result["prompt_tokens"] == list(prompt["input_ids"])
    with torch.no_grad():
        greedy = model.generate(torch.tensor([result["prompt_tokens"]]), max_new_tokens=4, do_sample=False)
    assert result["tokens"] == greedy[0, len(result["prompt_tokens"]) :].tolist()[: len(result["tokens"])]


def test_end_of_turn_ids_are_the_templates_turn_enders(tokenizer_dirs):
    for family, token in (("llama3", "<|eot_id|>"), ("qwen3", "<|im_end|>"), ("gemma2", "<end_of_turn>")):
        theirs = transformers.AutoTokenizer.from_pretrained(tokenizer_dirs[family])
        assert _ours(tokenizer_dirs[family]).end_of_turn_ids() == [theirs.convert_tokens_to_ids(token)]
