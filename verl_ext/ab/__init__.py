"""Real-engine runs of strategies: ``verl-ext ab`` (``runner``: the same prompts and seeds through
each strategy on fresh engines, side by side) and ``verl-ext trace record`` (``record``)."""
