"""What the Snakefile runs when it is parsed: the config and its schema, prompt fingerprints, the plan."""
