"""Training data: tokenizers, prepared datasets, document packing, mixtures, as resumable grain streams.

What other layers use (each module's docstring has the details):

- `stream.make_data(config, *, seq_len, global_batch, vocab_size, seed, split="train") -> DataStream`: this
  process's batches, dicts of int32 [global_batch // process_count, seq_len] arrays. `DataStream.keys`:
  `inputs, targets, positions` (windows: stdlib, token files, synthetic, `--packing windows`) plus
  `segment_ids, loss_mask` (documents: prepared datasets, mixtures, `--packing documents`). Positions restart at 0
  at each document start; segment ids are 0 at padding and 1, 2, ... per document of a row; the loss mask is 0 at
  padding and at each document's last token. The global batch is the same on any process count; `get_state` /
  `set_state` / `iterator` resume exactly. `DataStream.tokenizer` and `DataStream.token_bytes` (int32
  [vocab_size] bytes of text per token id) come with it. `global_batch_arrays(local, shardings)` makes the global
  `jax.Array`s.
- `tokenizer.Tokenizer` (`encode`, `encode_document`, `decode`, `vocab_size`, `model_vocab_size`,
  `bos_id`, `eos_id`, `special_ids`, `sha256`, `save(dir)`, `token_bytes()`) and `tokenizer.load_tokenizer(spec)`
  ("bytes", a tokenizer.json, a model directory, a prepared dataset or a run directory holding tokenizer.json).
- `resolve.source_tokenizer(config)`: the tokenizer of a `DataConfig` source (None for token files and synthetic
  data); `Tokenizer.model_vocab_size` is the model vocab it needs (bytes: 264; others: rounded up to 128);
  `resolve.check_vocab` is the error for a smaller model vocab (it names `--model.vocab-size`).
- `bits.target_bytes` and `bits.bits_per_byte`: bits per byte = loss x tokens / bytes / ln 2, exact per batch.
- `prepare.prepare(PrepareOptions)`: what `spmdkit data prepare` runs; `store.PreparedDataset(dir)` reads and
  checks a prepared dataset (each chunk's checksum as `read` first touches it; `verify()` reads every byte);
  `store.check_vocabulary(dataset, vocab_size)` refuses a model vocabulary below the dataset's largest token id
  (`make_data` calls it); `store.format` is the on-disk format.
- `packing`: the packing plans and rows (`PackedRows`); `sources`: the stdlib corpus, token files, synthetic.
"""
