"""The transformers integration: `kernelize(model)` and what it needs (parallel plans, quantized experts, the demo)."""
