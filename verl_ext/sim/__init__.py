"""The trace-driven cluster simulator (issue: traces, calibrated simulator, A/B at scale).

* ``clock``: virtual-time asyncio loop, so strategies run unchanged;
* ``instance``: ``SimInstance``, the ``Instance`` contract over a cost model and a trace;
* ``source``: what each simulated request emits (the trace's response);
* ``drafting``: speculative decoding by exact-match replay with the real draft index;
* ``cost``: the per-step cost model, GPU presets, fitted CPU profiles; ``profile``: the fitter;
* ``runner`` / ``report``: ``verl-ext sim``.
"""
