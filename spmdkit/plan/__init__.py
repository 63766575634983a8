"""The layout planner: per-device memory, collective traffic, pipeline bubble, step time and MFU of a layout, and the
search for the fastest layout that fits. Pure arithmetic (no JAX): `spmdkit plan` answers without an accelerator.

- `layout`: what a layout is (`Layout`), the parameter inventory, how the rules split each parameter, and
  `check_layout`, the one statement of what spmdkit can run (the trainer calls it too).
- `estimate`: the formulas (memory, collectives, time) of one layout.
- `devices`: the accelerator table (HBM, peak FLOP/s, link bandwidths) that MFU also reads.
- `search` and `report`: the candidate meshes, the ranking, and the explanation of the winner.
"""
