"""A float GGUF rewritten with its weights quantised, for tests and benchmarks.

    float32 GGUF (e.g. ``testing.write_moe_gguf``) ── quantize_gguf ──► same
    metadata, same tensors; each weight of two or more dimensions whose rows
    are whole blocks of ``qtype`` stored in ``qtype`` (stacked experts too),
    the rest (norms, biases, routers, rows of other lengths) as they were

Routers (``ffn_gate_inp``, ``ffn_gate_inp_shexp``) stay float, as llama.cpp's
quantiser leaves them.  The values a reader dequantises from the new file are
what a model loading it dequantised computes with (the oracle's weights):
``dequantized_checkpoint`` writes them back into the transformers checkpoint
the GGUF came from, for transformers to load.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

_KEEP_FLOAT = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def quantize_gguf(source: str | Path, path: str | Path, qtype: str, *,
                  select: Callable[[str], bool] | None = None,
                  tokenizer: str | Path | None = None) -> Path:
    """Write ``source`` (a GGUF of float tensors) to ``path`` with its weights in
    ``qtype`` (a ``gguf.GGMLQuantizationType`` name: Q8_0, Q4_0, Q4_1, Q4_K …);
    with ``select``, only the weights whose GGUF name it accepts (e.g. the
    experts: ``lambda name: "_exps." in name``).  ``tokenizer``: a checkpoint
    directory with the tiny checkpoint's tokenizer (``testing``), added to
    the file as its vocabulary (an engine serving the file reads it there)."""
    import gguf
    import numpy as np

    from mpexec.models.testing import _add_gguf_tokenizer, _quantize

    quant = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[quant][0]
    reader = gguf.GGUFReader(str(source))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(path), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        main = field.types[0]
        sub = field.types[-1] if main == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), main, sub_type=sub)
    if tokenizer is not None:
        vocab = reader.fields[f"{arch}.vocab_size"].contents()
        _add_gguf_tokenizer(writer, Path(tokenizer), int(vocab))
    rng = np.random.default_rng(0)
    for tensor in reader.tensors:
        values: Any = np.array(tensor.data)  # torch order: the row is the last dimension
        if tensor.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ValueError(f"{source}: {tensor.name} is {tensor.tensor_type.name}, "
                             "not float32")
        if (values.ndim >= 2 and values.shape[-1] % block == 0
                and not tensor.name.endswith(_KEEP_FLOAT)
                and (select is None or select(tensor.name))):
            raw = _quantize(values.reshape(-1, values.shape[-1]), quant, rng)
            writer.add_tensor(tensor.name, raw.reshape(*values.shape[:-1], -1),
                              raw_dtype=quant)
        else:
            writer.add_tensor(tensor.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def dequantized_checkpoint(gguf_path: str | Path, hf_dir: str | Path,
                           directory: str | Path) -> Path:
    """``hf_dir`` (the transformers checkpoint ``gguf_path`` was written from)
    copied to ``directory`` with every tensor replaced by the GGUF's values as
    this package's loader dequantises them: transformers loads the same
    weights the quantised file holds."""
    import shutil

    from safetensors.torch import load_file, save_file

    from mpexec.models.loader import open_checkpoint

    hf_dir, directory = Path(hf_dir), Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for item in hf_dir.iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            shutil.copy(item, directory / item.name)
    with open_checkpoint(gguf_path) as checkpoint:
        for shard in sorted(hf_dir.glob("*.safetensors")):
            tensors = load_file(str(shard))
            values = {name: checkpoint.read(name).to(tensor.dtype).reshape(tensor.shape)
                      for name, tensor in tensors.items()}
            save_file({n: v.contiguous() for n, v in values.items()},
                      str(directory / shard.name), metadata={"format": "pt"})
    return directory
