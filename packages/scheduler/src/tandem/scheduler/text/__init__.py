"""Text in and out: the tokenizer, the incremental detokenizer and stop strings."""
