"""What the kernels share: quantized weights (`quant.py`), the gated activations (`gates.py`), bf16 rows as
32-bit words (`packed_rows.py`), the picks sorted by expert (`routing.py`), the VMEM budget and what blocks hold
(`vmem.py`), and the order each projection's weights are read in (`weights_layout.py`)."""

# Bound by name, as the package binds its subpackages (its `__init__.py` says why): the kernel's tests reach them.
from . import gates, packed_rows, quant, routing, vmem, weights_layout
