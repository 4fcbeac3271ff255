"""What the forward and backward kernels share: the call's options, the problem and which pairs are visible
(`masking.py`), the tiles' type and block rules (`tiles.py`), the VMEM policy as this kernel takes it (`vmem.py`),
the order XLA stores q, K and V in, which both read them in (`layout.py`), and running a step's query heads
(`heads.py`)."""
