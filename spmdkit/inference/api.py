"""Text in, text out: `TextGenerator` (a `Generator` with its tokenizer) and `generate`, the one-call Python API.

```python
import spmdkit

completions = spmdkit.generate("runs/quickstart", ["def ", "import "], max_new_tokens=40, temperature=0.8, top_p=0.95)
print(completions[0].text)
```

`model` is a run or checkpoint directory, a Hugging Face model directory, or a `Transformer` (built, trained, or
loaded with `spmdkit.load_model`; pass its `tokenizer`, or token-id prompts). Prompts are strings (encoded with the
tokenizer, BOS first when it has one: every training document starts with it) or lists of token ids. `mesh` is a
`Mesh` or a spec such as `"tensor=4,data=2"` (default: one device). The tokenizer's EOS stops a row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

from jax.sharding import Mesh

from spmdkit.data.tokenizer import Tokenizer
from spmdkit.errors import SpmdkitError
from spmdkit.inference.engine import Completion, Generator
from spmdkit.inference.loading import generation_config, inference_mesh, inference_rules, place_model
from spmdkit.inference.sampling import Sampling
from spmdkit.inference.sources import model_tokenizer, open_source
from spmdkit.interop.loading import load_model
from spmdkit.models.transformer import Transformer

Prompt = str | Sequence[int]


@dataclasses.dataclass
class TextGenerator:
    """A `Generator` and the tokenizer of its model (None: prompts and results are token ids only)."""

    generator: Generator
    tokenizer: Tokenizer | None

    @classmethod
    def load(
        cls,
        model: Transformer | str | Path,
        *,
        mesh: Mesh | str | None = None,
        tokenizer: Tokenizer | None = None,
        max_len: int | None = None,
        dtype: str | None = None,
    ) -> TextGenerator:
        """`model` (a run/checkpoint directory, a Hugging Face model directory or a `Transformer`) on the
        inference `mesh`. `max_len`: the longest context (default: the run's training sequence length, a Hugging
        Face model's max_position_embeddings; for a module, unbounded); `dtype`: the compute dtype (default: the
        run's; a Hugging Face model's stored dtype)."""
        mesh = mesh if isinstance(mesh, Mesh) else inference_mesh(mesh)
        rules = inference_rules()
        if isinstance(model, Transformer):
            placed = place_model(model, mesh, rules, dtype=dtype)
            context = max_len or 1 << 30
        else:
            source = open_source(model)
            config = generation_config(source.model, dtype)  # parameters in the compute dtype: half the bytes read
            placed = load_model(
                source.directory, mesh, rules, config.dtype, config.dtype, step=source.step, config=config
            )
            tokenizer = tokenizer or model_tokenizer(source)
            context = max_len or source.seq_len or 1 << 30
        vocab = tokenizer.vocab_size if tokenizer is not None else None
        return cls(Generator(placed, mesh, rules, max_len=context, vocab_limit=vocab), tokenizer)

    def encode(self, prompt: Prompt) -> list[int]:
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if self.tokenizer is None:
            raise SpmdkitError("text prompts need a tokenizer: pass tokenizer=..., or prompts as lists of token ids")
        return self.tokenizer.bos + self.tokenizer.encode(prompt) if prompt else []

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling: Sampling,
        on_text: Callable[[int, str], None] | None = None,
        stop_tokens: Sequence[int] = (),
    ) -> list[Completion]:
        """Complete every prompt; `on_text(row, new_text)` streams each row's text as its tokens arrive. A row stops
        at the tokenizer's EOS or at one of `stop_tokens` (e.g. a chat template's end-of-turn token)."""
        ids = [self.encode(p) for p in prompts]
        tok = self.tokenizer
        stop = [] if tok is None or tok.eos_id is None else [tok.eos_id]
        stop += [int(t) for t in stop_tokens if int(t) not in stop]
        streams = [TextStream(tok) for _ in ids] if tok is not None and on_text is not None else None

        def on_tokens(row: int, new: list[int]) -> None:  # passed only with `streams`
            if text := streams[row].push([t for t in new if t not in stop]):
                on_text(row, text)

        completions = self.generator.generate(ids, sampling, stop=stop, on_tokens=on_tokens if streams else None)
        for row, completion in enumerate(completions):
            if tok is not None:
                completion.text = tok.decode(completion.tokens)
                if streams is not None and (rest := streams[row].push([], final=True)):
                    on_text(row, rest)
        return completions


class TextStream:
    """Incremental detokenization: the text of the ids so far, handed out once it is stable (a token that ends in
    the middle of a UTF-8 character decodes to U+FFFD until the next one completes it)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.ids, self.sent = tokenizer, [], 0

    def push(self, ids: list[int], final: bool = False) -> str:
        """The new stable text once `ids` are added (`final`: all the rest, the stream's end)."""
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids)
        stable = len(text) if final else len(text.rstrip("\ufffd"))
        new, self.sent = text[self.sent : stable], max(self.sent, stable)
        return new


def generate(
    model: Transformer | str | Path,
    prompts: Prompt | Sequence[Prompt],
    *,
    tokenizer: Tokenizer | None = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_tokens: Sequence[int] = (),
    mesh: Mesh | str | None = None,
    max_len: int | None = None,
    on_text: Callable[[int, str], None] | None = None,
) -> list[Completion]:
    """Complete `prompts` (one or a list; text or token ids) with `model`: one `Completion` per prompt (`tokens`,
    `text`, `finish_reason`, timing). Greedy by default; the same `seed` gives the same tokens on any mesh."""
    sampling = Sampling(max_new_tokens, temperature, top_k, top_p, seed, tuple(stop_tokens))
    single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
    batch = [prompts] if single else list(prompts)
    loaded = TextGenerator.load(model, mesh=mesh, tokenizer=tokenizer, max_len=max_len)
    return loaded.generate(batch, sampling, on_text)
