#!/usr/bin/env bash
# Fine-tune a downloaded model with LoRA on conversations, from its Hugging Face directory to a PEFT adapter, every
# step on the CPU (8 simulated devices, fsdp=4 x tensor=2) in a few minutes. The walk-through in docs/guide.md
# ("Fine-tuning with LoRA") explains each command.
#
#   bash examples/finetune_lora.sh [WORK_DIR]        (default: runs/finetune_lora; set SPMDKIT="python -m spmdkit"
#                                                     to run a checkout)
#
# 1. the "downloaded" model: here a tiny random Llama with a small BPE tokenizer and a ChatML chat template, written
#    by transformers' save_pretrained, as `huggingface-cli download ORG/MODEL --local-dir base` would give a real one;
#    and chat.jsonl, one {"messages": [{"role", "content"}, ...]} conversation per line
# 2. data prepare --chat: rendered with the model's own template, only the assistant turns scored
# 3. train --lora: adapters on the frozen base; the checkpoints hold the adapters (and the base's path and checksum)
# 4. eval and generate read the run directly (the base from its path, the adapters merged in)
# 5. export: the adapters as a PEFT adapter directory, and the merged model
set -euo pipefail
WORK=${1:-runs/finetune_lora}
SPMDKIT=${SPMDKIT:-spmdkit}
PYTHON=${PYTHON:-python}
if [ -e "$WORK" ] && [ -n "$(ls -A "$WORK")" ]; then  # never delete or overwrite what this script did not make
  echo "finetune_lora.sh: error: $WORK exists and is not empty: give a new directory" >&2
  exit 2
fi
mkdir -p "$WORK"

"$PYTHON" - "$WORK" <<'PY'
import json, random, sys
from pathlib import Path

import tokenizers, transformers
from tokenizers import decoders, models, pre_tokenizers, trainers

work = Path(sys.argv[1])
rng = random.Random(0)
CITIES = {"France": "Paris", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo", "Peru": "Lima", "Kenya": "Nairobi"}
rows = []
for _ in range(400):
    country = rng.choice(sorted(CITIES))
    rows.append({"messages": [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": f"What is the capital of {country}?"},
        {"role": "assistant", "content": f"The capital of {country} is {CITIES[country]}."},
    ]})
(work / "chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

base = work / "base"
bpe = tokenizers.Tokenizer(models.BPE())
bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
texts = [m["content"] for row in rows[:50] for m in row["messages"]]
specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
bpe.train_from_iterator(texts, trainers.BpeTrainer(
    vocab_size=512, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
tokenizer.save_pretrained(base)
(base / "chat_template.jinja").write_text(  # ChatML, as Qwen's instruct models use it
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
config = transformers.LlamaConfig(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id,
    pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
)
transformers.LlamaForCausalLM(config).save_pretrained(base)
print(f"wrote {base} (a random Llama, {config.vocab_size} ids) and {work / 'chat.jsonl'} ({len(rows)} conversations)")
PY

$SPMDKIT data prepare "$WORK/chat.jsonl" --chat --tokenizer "$WORK/base" --seq-len 64 --out "$WORK/data" --no-progress
$SPMDKIT train --init-from "$WORK/base" --data "$WORK/data" --cpu-devices 8 --mesh fsdp=4,tensor=2 \
    --lora.rank 8 --lora.alpha 16 --lora.targets q,k,v,o,gate,up,down --lr 3e-3 \
    --steps 60 --batch-size 16 --seq-len 64 --eval-every 0 --run-dir "$WORK/run" --no-progress
$SPMDKIT eval "$WORK/run" --batches 4
$SPMDKIT generate "$WORK/run" --chat --temperature 0 --max-new-tokens 12 \
    --prompt '[{"role": "system", "content": "You answer in one short sentence."}, {"role": "user", "content": "What is the capital of Peru?"}]'
$SPMDKIT ckpt export "$WORK/run" --adapters --out "$WORK/adapter"
$SPMDKIT ckpt export "$WORK/run" --out "$WORK/merged"
ls -l "$WORK/adapter"
# From here: peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("$WORK/base"), "$WORK/adapter"),
# or AutoModelForCausalLM.from_pretrained("$WORK/merged"); `spmdkit ckpt import-hf $WORK/base --adapters DIR --out
# CKPT` reads a PEFT adapter back (and `train --init-from CKPT` with the same --lora settings continues it).
