"""The model's parallel building blocks: linear, embedding, attention, norm, rotary."""
