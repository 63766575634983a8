"""Training data: tokenizers, prepared datasets, document packing, mixtures, as resumable grain streams.

What other layers use (each module's docstring has the details):

- `stream`: `make_data(config, *, seq_len, global_batch, vocab_size, seed, split="train") -> DataStream`, this
  process's batches (`keys`, `tokenizer`, `token_bytes`, exact resume), and `global_batch_arrays`;
- `tokenizer`: `Tokenizer` and `load_tokenizer(spec)`;
- `resolve`: `source_tokenizer(config)` and `check_vocab`, the model vocab a source needs;
- `bits`: `target_bytes` and `bits_per_byte`, exact per batch;
- `prepare.prepare(PrepareOptions)`: what `spmdkit data prepare` runs; `store`: `PreparedDataset`,
  `check_vocabulary` and the on-disk `format`;
- `packing`: the packing plans and rows (`PackedRows`); `sources`: the stdlib corpus, token files, synthetic.
"""
