"""What the Snakefile runs when it is parsed: the config and its schema, the verifier and the plan (``parse``), the
jobs' untracked settings (``settings``), prompt fingerprints, the plan."""
