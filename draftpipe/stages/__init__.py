"""The stages' computations: the verifier's conversion, completions, hidden-state extraction, the draft (:mod:`draftpipe.stages.draft`)."""
