"""What artifacts hold and how they are read: prompt sources, chat rendering, hidden-state shards, vocab maps, provenance manifests, the verifier's config and GGUF metadata."""
