"""vLLM as every stage opens it: the offline engine's settings and the hidden-state connector."""
