"""Base layer, standard library only: atomic I/O and caches, the results layout, progress lines, GPU locks and rank counts, quality gates and the tokenizer gate."""
