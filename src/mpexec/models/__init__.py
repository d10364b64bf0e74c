"""The model stack: what a worker runs on top of the executor.

Loading half (this package's lower modules, none of which import torch at
package import):

    resolve_model(spec) ──► Path (.gguf file or HF directory)      fetch.py
            │
            ▼
    open_checkpoint(path) ──► Checkpoint                          loader/
            ├── .config        ModelConfig (config.json or GGUF)  config.py
            ├── .read(name, dim, start, stop)   one slice, dequantised, HF layout
            └── .tokenizer()   Tokenizer (tokenizer.json or GGUF)  tokenizer.py

``testing.write_tiny_checkpoint`` writes a small random checkpoint in
Hugging Face format so the same loader runs in fast tests.

Importing ``mpexec.models`` is cheap on purpose: torch, safetensors, gguf and
tokenizers are imported by the modules that use them, when they are used.
"""
