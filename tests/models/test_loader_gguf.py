"""GGUF: dequantisation against gguf's reference, names, the Q/K interleave, damage."""

from __future__ import annotations

from pathlib import Path

import pytest

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from mpexec.models.config import CheckpointError  # noqa: E402
from mpexec.models.loader import open_checkpoint  # noqa: E402
from mpexec.models.loader.quants import dequantize, encoding_of  # noqa: E402
from mpexec.models.testing import write_tiny_checkpoint  # noqa: E402
from mpexec.models.testing_gguf import write_tiny_gguf  # noqa: E402

pytestmark = pytest.mark.torch
QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]


def _all_types() -> list[str]:
    from mpexec.models.loader.quants import supported_names

    return supported_names()


# Every type the installed gguf dequantises; the K-quants and IQ types among them.
ALL_TYPES = _all_types()
BLOCK_256 = [t for t in ALL_TYPES if gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]][0] == 256]


def test_the_k_quants_and_iq_types_are_supported() -> None:
    for name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS",
                 "IQ2_XXS", "IQ3_S", "IQ1_M"):
        assert name in ALL_TYPES
    for name in ("I8", "I32", "F64"):  # integer tensors are no model weights here
        assert name not in ALL_TYPES


def _blocks(kind: object, rows: int, blocks_per_row: int) -> np.ndarray:
    """``rows`` rows of ``blocks_per_row`` blocks: quantised data where gguf can
    quantise the type, random bytes with small finite float16 scales where not."""
    from mpexec.models.testing_gguf import _quantize

    elements, _ = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(7)
    data = (rng.standard_normal((rows, elements * blocks_per_row))
            * rng.uniform(0.01, 5, (rows, 1))).astype(np.float32)
    data[3, :elements] = 0.0  # an all-zero block
    return np.asarray(_quantize(data, kind, rng)).view(np.uint8).reshape(rows, -1)


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_dequantize_matches_gguf_reference(qtype: str) -> None:
    kind = gguf.GGMLQuantizationType[qtype]
    encoding = encoding_of(kind.value)
    assert encoding is not None
    raw = _blocks(kind, 7, 5)
    with np.errstate(all="ignore"):
        reference = gguf.quants.dequantize(raw.copy(), kind).reshape(7, -1)
    np.testing.assert_array_equal(dequantize(raw, encoding), reference)  # bit for bit
    # Whole blocks along a row dequantise on their own.
    per, width = encoding.block_elements, encoding.row_bytes(encoding.block_elements)
    part = raw[:, width:3 * width]
    np.testing.assert_array_equal(dequantize(part, encoding), reference[:, per:3 * per])
    np.testing.assert_array_equal(dequantize(raw[2:5], encoding), reference[2:5])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # hidden 288 / intermediate 224: whole 32-element blocks, so every weight is quantised.
    return write_tiny_checkpoint(tmp_path_factory.mktemp("hf") / "ckpt", hidden_size=288,
                                 intermediate_size=224, num_hidden_layers=2)


@pytest.fixture(scope="module")
def tiny_gguf(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("gguf")
    return {q: write_tiny_gguf(out / f"tiny-{q}.gguf", tiny_dir, qtype=q) for q in QTYPES}


def reference_tensors(path: Path, head_dim: int) -> dict[str, torch.Tensor]:
    """gguf's own dequantisation, rows put back in HF order by an index formula."""
    from mpexec.models.loader.gguf_file import hf_name

    out = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        values = values.reshape([int(n) for n in reversed(tensor.shape.tolist())])
        if ".attn_q." in tensor.name or ".attn_k." in tensor.name:
            # File row h·d + 2i + j holds HF row h·d + j·d/2 + i.
            hf_order = np.empty_like(values)
            for row in range(values.shape[0]):
                h, r = divmod(row, head_dim)
                i, j = divmod(r, 2)
                hf_order[h * head_dim + j * head_dim // 2 + i] = values[row]
            values = hf_order
        out[str(hf_name(tensor.name))] = torch.from_numpy(np.array(values, dtype=np.float32))
    return out


@pytest.mark.parametrize("qtype", QTYPES)
def test_every_tensor_matches_reference(tiny_gguf: dict[str, Path], tiny_dir: Path,
                                        qtype: str) -> None:
    with open_checkpoint(tiny_gguf[qtype]) as ckpt, open_checkpoint(tiny_dir) as hf:
        assert sorted(ckpt.names()) == sorted(hf.names())
        reference = reference_tensors(tiny_gguf[qtype], ckpt.config.head_dim)
        for name in ckpt.names():
            assert ckpt.shape(name) == hf.shape(name)
            torch.testing.assert_close(ckpt.read(name), reference[name], rtol=1e-6, atol=1e-7)
            if qtype == "F32":
                assert torch.equal(ckpt.read(name), hf.read(name)), name


def test_config_matches_the_hf_directory(tiny_gguf: dict[str, Path], tiny_dir: Path) -> None:
    with open_checkpoint(tiny_gguf["Q8_0"]) as ckpt, open_checkpoint(tiny_dir) as hf:
        a, b = ckpt.config, hf.config
        for field in a.__dataclass_fields__:
            if field == "rms_norm_eps":  # stored as float32 in GGUF
                assert a.rms_norm_eps == pytest.approx(b.rms_norm_eps, rel=1e-6)
            elif field == "eos_token_ids":  # GGUF has a single eos id
                assert set(a.eos_token_ids) <= set(b.eos_token_ids)
            else:
                assert getattr(a, field) == getattr(b, field), field


@pytest.mark.parametrize(("name", "dim", "start", "stop"), [
    ("model.layers.0.self_attn.q_proj.weight", 0, 40, 200),   # crosses heads mid-way
    ("model.layers.1.self_attn.k_proj.weight", 0, 32, 64),    # exactly one head
    ("model.layers.0.self_attn.k_proj.weight", 1, 5, 70),     # unaligned blocks
    ("model.layers.1.mlp.down_proj.weight", 1, 64, 160),
    ("model.layers.1.mlp.gate_proj.weight", 0, 75, 149),
    ("model.embed_tokens.weight", 0, 130, 260),
    ("model.norm.weight", 0, 3, 100),
    ("model.layers.1.mlp.gate_proj.weight", 0, 7, 7),         # an empty share
    ("model.layers.0.self_attn.q_proj.weight", 1, 0, 0),
])
def test_slices_match_the_full_tensor(tiny_gguf: dict[str, Path], name: str, dim: int,
                                      start: int, stop: int) -> None:
    with open_checkpoint(tiny_gguf["Q4_1"]) as ckpt:
        full = ckpt.read(name)
        got = ckpt.read(name, dim=dim, start=start, stop=stop)
        assert torch.equal(got, full.narrow(dim, start, stop - start))


def test_bytes_read_is_the_slice(tiny_gguf: dict[str, Path]) -> None:
    with open_checkpoint(tiny_gguf["Q4_1"]) as ckpt:
        ckpt.read("model.layers.0.mlp.up_proj.weight", dim=0, start=10, stop=30)
        assert ckpt.bytes_read == 20 * (288 // 32) * 20           # 20 rows of 9 blocks
        ckpt.bytes_read = 0
        ckpt.read("model.layers.0.mlp.down_proj.weight", dim=1, start=5, stop=70)
        assert ckpt.bytes_read == 288 * 3 * 20                    # blocks 0..2 of every row


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_reads_about_its_share(tiny_gguf: dict[str, Path], world: int) -> None:
    path = tiny_gguf["Q8_0"]
    total = sum(t.n_bytes for t in gguf.GGUFReader(str(path)).tensors)
    for rank in range(world):
        with open_checkpoint(path) as ckpt:
            replicated = 0
            for name in ckpt.names():
                shape = ckpt.shape(name)
                if len(shape) == 1:
                    before = ckpt.bytes_read
                    ckpt.read(name)
                    replicated += ckpt.bytes_read - before
                    continue
                dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
                n = shape[dim]
                ckpt.read(name, dim=dim, start=n * rank // world, stop=n * (rank + 1) // world)
            # Whole heads and whole blocks round a share up a little, never to the whole.
            assert ckpt.bytes_read <= (total - replicated) / world * 1.25 + replicated


# ── 256-element super-blocks (K-quants, most IQ types) ─────────────────────

@pytest.fixture(scope="module")
def tiny_dir_256(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # hidden 256 / intermediate 512: whole 256-element super-blocks in every row.
    return write_tiny_checkpoint(tmp_path_factory.mktemp("hf256") / "ckpt", hidden_size=256,
                                 num_attention_heads=8, num_key_value_heads=2,
                                 intermediate_size=512, num_hidden_layers=2)


@pytest.mark.parametrize("qtype", BLOCK_256)
def test_super_block_types_every_tensor_and_slice(tiny_dir_256: Path, tmp_path: Path,
                                                  qtype: str) -> None:
    path = write_tiny_gguf(tmp_path / f"{qtype}.gguf", tiny_dir_256, qtype=qtype)
    with open_checkpoint(path) as ckpt:
        reference = reference_tensors(path, ckpt.config.head_dim)
        for name in ckpt.names():
            full = ckpt.read(name)
            torch.testing.assert_close(full, reference[name], rtol=0, atol=0, equal_nan=True)
        # A rank's rows, and columns that cut super-blocks: slices of the whole.
        for name, dim, start, stop in (("model.layers.0.self_attn.q_proj.weight", 0, 48, 160),
                                       ("model.layers.1.mlp.down_proj.weight", 1, 100, 300),
                                       ("model.layers.1.mlp.down_proj.weight", 1, 256, 512),
                                       ("model.layers.0.self_attn.o_proj.weight", 1, 0, 128)):
            full = ckpt.read(name)
            got = ckpt.read(name, dim=dim, start=start, stop=stop)
            torch.testing.assert_close(got, full.narrow(dim, start, stop - start), rtol=0,
                                       atol=0, equal_nan=True)
        encoding = encoding_of(gguf.GGMLQuantizationType[qtype].value)
        assert encoding is not None
        ckpt.bytes_read = 0
        ckpt.read("model.layers.1.mlp.down_proj.weight", dim=1, start=256, stop=512)
        assert ckpt.bytes_read == 256 * encoding.block_bytes   # one super-block of each row
        ckpt.bytes_read = 0
        ckpt.read("model.layers.1.mlp.up_proj.weight", dim=0, start=10, stop=30)
        assert ckpt.bytes_read == 20 * encoding.block_bytes    # 20 rows of one super-block


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_super_block_ranks_read_half_at_tp2(tiny_dir_256: Path, tmp_path: Path,
                                            qtype: str) -> None:
    path = write_tiny_gguf(tmp_path / f"{qtype}.gguf", tiny_dir_256, qtype=qtype)
    tensors = [t for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) == 2]
    weights = sum(t.n_bytes for t in tensors)
    # o_proj's rows are a single super-block (256 columns), which both ranks read
    # whole; every other weight splits exactly (by rows, or 1 of 2 super-blocks).
    o_proj = sum(t.n_bytes for t in tensors if t.name.endswith("attn_output.weight"))
    for rank in range(2):
        with open_checkpoint(path) as ckpt:
            for name in ckpt.names():
                shape = ckpt.shape(name)
                if len(shape) == 2:
                    dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
                    n = shape[dim]
                    ckpt.read(name, dim=dim, start=n * rank // 2, stop=n * (rank + 1) // 2)
            assert ckpt.bytes_read <= (weights - o_proj) * 0.51 + o_proj, (rank, weights)


def test_unsupported_type_names_the_tensor_and_the_types(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "int.gguf"), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 8), dtype=np.int32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"int\.gguf: blk\.0\.attn_q\.weight: ggml type "
                       r"26 \(I32\) cannot be dequantised.*Q4_K"):
        open_checkpoint(tmp_path / "int.gguf")


# ── damaged files ──────────────────────────────────────────────────────────

def test_bad_magic(tmp_path: Path, tiny_gguf: dict[str, Path]) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUX" + tiny_gguf["F32"].read_bytes()[4:])
    with pytest.raises(CheckpointError, match=r"bad\.gguf: header"):
        open_checkpoint(bad)


def test_truncated_tensor_data(tmp_path: Path, tiny_gguf: dict[str, Path]) -> None:
    data = tiny_gguf["Q8_0"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 5000])
    with pytest.raises(CheckpointError, match=r"cut\.gguf: blk\.\d+\..*truncated"):
        open_checkpoint(cut)


def test_truncated_header(tmp_path: Path, tiny_gguf: dict[str, Path]) -> None:
    cut = tmp_path / "head.gguf"
    cut.write_bytes(tiny_gguf["Q8_0"].read_bytes()[:300])
    with pytest.raises(CheckpointError, match=r"head\.gguf: header"):
        open_checkpoint(cut)


def test_missing_tensor(tmp_path: Path, tiny_dir: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", tiny_dir, skip=("blk.1.ffn_up.weight",))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        open_checkpoint(path)


def test_shape_mismatch_with_metadata(tmp_path: Path, tiny_dir: Path) -> None:
    path = write_tiny_gguf(tmp_path / "s.gguf", tiny_dir,
                           metadata_changes={"feed_forward_length": 192})
    with pytest.raises(CheckpointError, match=r"s\.gguf: model\.layers\.0\.mlp.*shape"):
        open_checkpoint(path)


@pytest.mark.parametrize(("count", "field"), [(3, r"llama\.block_count"),
                                               (10**9, "num_hidden_layers")])
def test_block_count_that_the_tensors_do_not_have(tmp_path: Path, tiny_dir: Path, count: int,
                                                  field: str) -> None:
    path = write_tiny_gguf(tmp_path / "b.gguf", tiny_dir, metadata_changes={"block_count": count})
    with pytest.raises(CheckpointError, match=rf"b\.gguf: {field}"):
        open_checkpoint(path)


@pytest.mark.parametrize(("changes", "field"), [
    ({"attention.value_length": 16}, "llama.attention.value_length"),
    ({"rope.dimension_count": 16}, "llama.rope.dimension_count"),
    ({"attention.key_length": 16, "attention.value_length": 16, "rope.dimension_count": 16},
     r"self_attn\.q_proj\.weight: shape"),
])
def test_head_sizes_that_the_model_or_the_tensors_do_not_have(
        tmp_path: Path, tiny_dir: Path, changes: dict[str, int], field: str) -> None:
    path = write_tiny_gguf(tmp_path / "h.gguf", tiny_dir, metadata_changes=changes)
    with pytest.raises(CheckpointError, match=field):
        open_checkpoint(path)


def test_missing_metadata_field(tmp_path: Path, tiny_dir: Path) -> None:
    path = write_tiny_gguf(tmp_path / "f.gguf", tiny_dir, metadata_changes={"block_count": 0})
    with pytest.raises(CheckpointError, match=r"f\.gguf: num_hidden_layers"):
        open_checkpoint(path)


# ── the default model against transformers (the oracle) ────────────────────

@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smollm2_weights_equal_transformers(smollm2_gguf: Path) -> None:
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32)
    oracle = model.state_dict()
    with open_checkpoint(smollm2_gguf) as ckpt:
        assert ckpt.config.tie_word_embeddings
        assert set(ckpt.names()) == set(oracle) - {"lm_head.weight"}
        for name in ckpt.names():
            torch.testing.assert_close(ckpt.read(name), oracle[name], rtol=1e-6, atol=1e-6,
                                       msg=lambda m, n=name: f"{n}: {m}")
        q = "model.layers.7.self_attn.q_proj.weight"
        torch.testing.assert_close(ckpt.read(q, dim=0, start=192, stop=384),
                                   oracle[q][192:384], rtol=1e-6, atol=1e-6)


# ── the header parser against gguf's own reader ────────────────────────────

def assert_header_matches_gguf(path: Path) -> None:
    from mpexec.models.loader.gguf_header import read_header

    header = read_header(path)
    reader = gguf.GGUFReader(str(path))
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert header.fields == expected
    assert header.version == reader.fields["GGUF.version"].contents()
    assert [(t.name, t.ne, t.ggml_type, t.offset) for t in header.tensors] == [
        (t.name, tuple(int(n) for n in t.shape), int(t.tensor_type), int(t.data_offset))
        for t in reader.tensors]


@pytest.mark.parametrize("qtype", ["F32", "Q4_1"])
def test_header_parser_matches_gguf_reader(tiny_gguf: dict[str, Path], qtype: str) -> None:
    assert_header_matches_gguf(tiny_gguf[qtype])


@pytest.mark.slow
def test_header_parser_matches_gguf_reader_on_smollm2(smollm2_gguf: Path) -> None:
    assert_header_matches_gguf(smollm2_gguf)


def test_every_cut_and_corruption_gives_a_checkpoint_error(tmp_path: Path,
                                                          tiny_gguf: dict[str, Path]) -> None:
    """Cut the file anywhere, or flip header bytes: a CheckpointError or a clean open."""
    from mpexec.models.loader.gguf_header import read_header

    data = tiny_gguf["Q8_0"].read_bytes()
    header_end = read_header(tiny_gguf["Q8_0"]).tensors[0].offset
    victim = tmp_path / "v.gguf"
    rng = np.random.default_rng(3)
    cuts = sorted(set(rng.integers(0, header_end, 60).tolist()) | {0, 3, 4, 8, 23, 24})
    for cut in [*cuts, header_end, len(data) - 1]:
        victim.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=r"v\.gguf"):
            open_checkpoint(victim)
    for position in rng.integers(4, header_end, 60).tolist():
        damaged = bytearray(data)
        damaged[position] ^= 0xFF
        victim.write_bytes(bytes(damaged))
        try:
            open_checkpoint(victim).close()
        except CheckpointError as e:
            assert "v.gguf" in str(e)
