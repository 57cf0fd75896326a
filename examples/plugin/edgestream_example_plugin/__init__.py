"""An example edgestream plugin: ``example_net`` (a model cut at ``stem`` and ``body``),
``warmup_bsp`` (BSP with a learning-rate warm-up) and ``example_bf16`` (a bfloat16 codec).

Nothing is imported here: edgestream imports each module when it looks up a name it does
not know (the entry points in pyproject.toml), and the module's decorators register it.
"""
