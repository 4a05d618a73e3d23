"""draftpipe: build EAGLE-3 speculative-decoding drafts for a verifier LLM, one artifact per stage.

The Snakemake rules under ``rules/`` stay thin; every stage's logic lives in a module here:

- :mod:`draftpipe.verifier`     GGUF -> Hugging Face conversion, head_dim re-parameterisation, verifier lookup
- :mod:`draftpipe.prompts`      prompt sources -> normalised, deduplicated, split and sharded chat records
- :mod:`draftpipe.completions`  the verifier regenerates answers with vLLM
- :mod:`draftpipe.hidden_states` aux + last hidden states of the verifier, with the loss mask
- :mod:`draftpipe.vocab`        token frequencies and the d2t / t2d vocabulary maps
- :mod:`draftpipe.draft`        EAGLE-3 draft training with speculators
- :mod:`draftpipe.spec_decode`  EAGLE-3 speculative decoding in vLLM and its acceptance counters
"""

__version__ = "0.1.0"
