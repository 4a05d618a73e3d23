"""draftpipe: build EAGLE-3 speculative-decoding drafts for a verifier LLM, one artifact per stage.

The Snakemake rules under ``rules/`` stay thin; the logic lives here, in folders that are layers (a module imports
only from folders below its own, ``tests/unit/test_layers.py``):

- :mod:`draftpipe.core`       atomic I/O, the results layout, progress, GPU locks, quality gates (standard library)
- :mod:`draftpipe.formats`    prompt sources, chat rendering, hidden-state shards, vocab maps, manifests, verifier config
- :mod:`draftpipe.workflow`   what the Snakefile runs when it is parsed: config and schema, fingerprints, the plan
- :mod:`draftpipe.runtime`    a job's context, the stage store, the integrity of a results tree
- :mod:`draftpipe.inference`  vLLM's engine as every stage opens it, the hidden-state connector
- :mod:`draftpipe.stages`     verifier conversion, completions, hidden-state extraction, draft training
- :mod:`draftpipe.checks`     compatibility report, speculative decoding in vLLM, ``draftpipe-verify``
- :mod:`draftpipe.bench`      the vLLM benchmark and its report
"""

__version__ = "0.2.0"
