"""What the kernels share: the call's options, the problem and which pairs are visible (`masking.py`), the paged
kernel's problem (`paged.py`), the online softmax of the forward and paged kernels (`softmax.py`), the tiles' type
and block rules (`tiles.py`), the VMEM policy as this kernel takes it (`vmem.py`), the order XLA stores q, K and V
in, which the forward and backward read them in (`layout.py`), and running a step's query heads (`heads.py`)."""
