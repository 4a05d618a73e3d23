"""How a job runs: the job context of every script, the content-addressed stage store, the integrity of a results tree."""
