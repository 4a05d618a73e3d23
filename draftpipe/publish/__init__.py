"""The draft as it leaves the build: its model card (``results/draft/README.md``) and ``draftpipe-publish``, which
pushes the draft folder to the Hugging Face Hub."""
