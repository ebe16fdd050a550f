"""The engine's policy, decided on the host from host data: the queue, the rows' owners and layout, the pacing and
the stop rule (``scheduler``: no JAX), which members each bucket runs and at what measured cost (``planner``), auto's
choice per iteration (``auto``), and the prompt chunk sizes (``prefill``). Nothing here runs on the device."""
