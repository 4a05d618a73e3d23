"""Rule `vocab_maps`: loss-masked token frequencies -> d2t / t2d (none when the draft vocab is the verifier's)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent))  # noqa: F821

from draftpipe.runtime.job import job

with job(snakemake):  # ML environment, log, GPUs, threads; manifests when the block ends normally
    import torch
    from transformers import AutoTokenizer

    from draftpipe.core.io import atomic_path, read_jsonl
    from draftpipe.core.progress import console
    from draftpipe.formats.hidden_states import sequence_and_mask
    from draftpipe.formats.vocab import build_maps, check_maps, count_tokens, frequency_table, write_maps

    p = snakemake.params

    def samples():
        for path in snakemake.input.completions:
            for row in read_jsonl(path):
                ids, mask = sequence_and_mask(row, p.max_len)
                yield {"input_ids": torch.tensor(ids, dtype=torch.long), "loss_mask": torch.tensor(mask)}

    counts = count_tokens(samples(), p.vocab_size)
    d2t, t2d = build_maps(counts, p.draft_vocab_size)
    if d2t is not None:
        check_maps(d2t, t2d, p.vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(p.verifier)
    table = frequency_table(counts, t2d, tokenizer)
    with atomic_path(snakemake.output.freq) as tmp:
        table.to_csv(tmp, index=False)
    write_maps(snakemake.output.maps, d2t, t2d, p.vocab_size, p.draft_vocab_size)
    covered = float(counts[t2d.bool()].sum() / max(float(counts.sum()), 1.0)) if t2d is not None else 1.0
    console(
        f"vocab_maps: {int(counts.sum())} loss-masked tokens, {int((counts > 0).sum())} distinct, draft vocab "
        f"{p.draft_vocab_size} of {p.vocab_size} covering {100 * covered:.1f}% of them"
    )
