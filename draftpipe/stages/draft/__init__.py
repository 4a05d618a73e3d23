"""EAGLE-3 draft training with speculators: typed settings (``settings``), the shards as a dataset (``data``),
the resumable trainer and exact checkpointer (``trainer``, ``checkpoint``), the ranks and their launcher
(``ranks``), the driver (``training``), the exported draft (``export``) and its metrics (``metrics``), the
draft's attention on machines without flex attention (``attention``)."""
