"""The queue benchmark's parts: messages, transports and one module per figure."""
