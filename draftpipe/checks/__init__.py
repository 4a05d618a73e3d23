"""Checks of a finished draft: the compatibility report against vLLM's loader, speculative decoding in vLLM, ``draftpipe-verify`` over a results tree."""
