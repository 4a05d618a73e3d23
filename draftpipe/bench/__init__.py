"""The vLLM benchmark: acceptance and speed with and without the draft, and its report."""
