"""``tandem bench``: the offline engine benchmark, the serving benchmark and perplexity."""
