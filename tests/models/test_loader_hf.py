"""Hugging Face directories: slices, bytes read per rank, damaged files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from mpexec.models.config import CheckpointError  # noqa: E402
from mpexec.models.loader import open_checkpoint  # noqa: E402
from mpexec.models.testing import write_tiny_checkpoint  # noqa: E402

pytestmark = pytest.mark.torch


def all_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        tensors.update(safetensors_torch.load_file(str(shard)))
    return tensors


def test_names_shapes_and_full_reads(tiny_checkpoint: Path) -> None:
    reference = all_tensors(tiny_checkpoint)
    with open_checkpoint(tiny_checkpoint) as ckpt:
        assert set(ckpt.names()) == set(reference)  # tied: no lm_head
        assert "lm_head.weight" not in ckpt.names()
        for name in ckpt.names():
            assert ckpt.shape(name) == tuple(reference[name].shape)
            assert torch.equal(ckpt.read(name), reference[name])
        assert ckpt.bytes_read == sum(t.numel() * 4 for t in reference.values())


@pytest.mark.parametrize(("dim", "start", "stop"), [(0, 0, 48), (0, 17, 100), (1, 5, 144),
                                                    (-1, 0, 1), (0, 10, 10)])
def test_slices_match_the_full_tensor(tiny_checkpoint: Path, dim: int, start: int,
                                      stop: int) -> None:
    reference = all_tensors(tiny_checkpoint)["model.layers.1.self_attn.q_proj.weight"]
    with open_checkpoint(tiny_checkpoint) as ckpt:
        got = ckpt.read("model.layers.1.self_attn.q_proj.weight", dim=dim, start=start, stop=stop)
        assert torch.equal(got, reference.narrow(dim, start, stop - start))
        assert ckpt.bytes_read == got.numel() * 4


def test_dtype_and_bad_requests(tiny_checkpoint: Path) -> None:
    with open_checkpoint(tiny_checkpoint) as ckpt:
        assert ckpt.read("model.norm.weight", dtype=torch.bfloat16).dtype == torch.bfloat16
        with pytest.raises(KeyError, match="no parameter"):
            ckpt.read("model.layers.99.mlp.up_proj.weight")
        with pytest.raises(IndexError):
            ckpt.read("model.norm.weight", dim=0, start=0, stop=10_000)
        with pytest.raises(IndexError):
            ckpt.read("model.norm.weight", dim=1)


def tp_share_bytes(ckpt, rank: int, world: int) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """Read what TP rank ``rank`` of ``world`` needs; return (its share, replicated) bytes."""
    def bounds(n: int) -> tuple[int, int]:
        return n * rank // world, n * (rank + 1) // world

    share = replicated = 0
    for name in ckpt.names():
        shape = ckpt.shape(name)
        if len(shape) == 1:
            replicated += ckpt.read(name).numel() * 4
            continue
        by_columns = name.endswith(("o_proj.weight", "down_proj.weight"))
        dim = 1 if by_columns else 0
        start, stop = bounds(shape[dim])
        share += ckpt.read(name, dim=dim, start=start, stop=stop).numel() * 4
    return share, replicated


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_reads_about_its_share(tiny_checkpoint: Path, world: int) -> None:
    total = sum(t.numel() * 4 for t in all_tensors(tiny_checkpoint).values())
    for rank in range(world):
        with open_checkpoint(tiny_checkpoint) as ckpt:
            share, replicated = tp_share_bytes(ckpt, rank, world)
            assert ckpt.bytes_read == share + replicated
            # The uneven splits make a share differ from total/world by a few rows only.
            assert ckpt.bytes_read <= (total - replicated) / world * 1.05 + replicated


def test_single_file_without_index_and_untied_qwen2(tmp_path: Path) -> None:
    directory = write_tiny_checkpoint(tmp_path / "q", shards=1, attention_bias=True,
                                      tie_word_embeddings=False, num_hidden_layers=2)
    assert not (directory / "model.safetensors.index.json").exists()
    reference = all_tensors(directory)
    with open_checkpoint(directory) as ckpt:
        assert ckpt.config.architecture == "qwen2" and ckpt.config.attention_bias
        assert "lm_head.weight" in ckpt.names()
        assert "model.layers.1.self_attn.k_proj.bias" in ckpt.names()
        for name in ckpt.names():
            assert torch.equal(ckpt.read(name), reference[name])


def test_tiny_checkpoint_is_deterministic_and_small(tmp_path: Path,
                                                    tiny_checkpoint: Path) -> None:
    again = write_tiny_checkpoint(tmp_path / "again")
    for path in tiny_checkpoint.iterdir():
        assert (again / path.name).read_bytes() == path.read_bytes(), path.name
    assert sum(p.stat().st_size for p in again.iterdir()) < 5 * 2**20
    other_seed = write_tiny_checkpoint(tmp_path / "seed1", seed=1)
    a, b = all_tensors(again), all_tensors(other_seed)
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])


# ── damaged checkpoints: the error names the file and the tensor or field ──

@pytest.fixture
def copy(tmp_path: Path, tiny_checkpoint: Path) -> Path:
    return Path(shutil.copytree(tiny_checkpoint, tmp_path / "copy"))


def shard(directory: Path, index: int = 2) -> Path:
    return directory / f"model-0000{index}-of-00002.safetensors"


def test_truncated_shard(copy: Path) -> None:
    data = shard(copy).read_bytes()
    shard(copy).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as caught:
        open_checkpoint(copy)
    assert shard(copy).name in str(caught.value)


def test_every_cut_of_a_shard_fails_at_open(copy: Path) -> None:
    data = shard(copy).read_bytes()
    for cut in [0, 4, 8, 9, 100, len(data) // 3, len(data) - 1]:
        shard(copy).write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=shard(copy).name):
            open_checkpoint(copy)


def test_bad_header(copy: Path) -> None:
    shard(copy, 1).write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=shard(copy, 1).name):
        open_checkpoint(copy)


def test_missing_shard(copy: Path) -> None:
    shard(copy).unlink()
    with pytest.raises(CheckpointError, match=r"00002.*file: missing"):
        open_checkpoint(copy)


def test_missing_tensor(copy: Path) -> None:
    tensors = safetensors_torch.load_file(str(shard(copy)))
    victim = sorted(tensors)[0]
    del tensors[victim]
    safetensors_torch.save_file(tensors, str(shard(copy)))
    with pytest.raises(CheckpointError, match=victim.replace(".", r"\.")):
        open_checkpoint(copy)


def test_shape_mismatch_with_config(copy: Path) -> None:
    config = json.loads((copy / "config.json").read_text())
    config["intermediate_size"] += 1
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"mlp\.gate_proj\.weight: shape"):
        open_checkpoint(copy)


def test_a_head_dim_the_tensors_do_not_have(copy: Path) -> None:
    config = json.loads((copy / "config.json").read_text())
    config["head_dim"] += 2  # still even: refused by the tensors' shapes, not the config
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"self_attn\.q_proj\.weight: shape"):
        open_checkpoint(copy)


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        open_checkpoint(tmp_path / "nothing")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError):
        open_checkpoint(tmp_path / "weights.bin")
    with pytest.raises(CheckpointError, match=r"config\.json"):
        open_checkpoint(tmp_path)


def test_gguf_copy_of_the_tiny_checkpoint_is_identical(tiny_checkpoint: Path,
                                                       tiny_gguf: Path) -> None:
    with open_checkpoint(tiny_checkpoint) as hf, open_checkpoint(tiny_gguf) as gg:
        assert sorted(hf.names()) == sorted(gg.names())
        for name in hf.names():
            assert torch.equal(hf.read(name), gg.read(name)), name


@pytest.mark.timeout(300)
def test_transformers_loads_the_tiny_checkpoint_and_its_forward_is_sane(
        tiny_checkpoint: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint),
                                                              dtype=torch.float32)
    state = model.state_dict()
    with open_checkpoint(tiny_checkpoint) as ckpt:
        assert set(state) - {"lm_head.weight"} == set(ckpt.names())
        for name in ckpt.names():
            assert torch.equal(state[name], ckpt.read(name)), name
        tokenizer = ckpt.tokenizer()
    ids = torch.tensor([tokenizer.encode("the quick brown fox jumps over the lazy dog " * 8)])
    with torch.no_grad():
        logits = model(ids).logits[0]
    assert torch.isfinite(logits).all()
    spread = logits.std(dim=-1)
    assert float(spread.min()) > 0.3 and float(logits.abs().max()) < 100
    # Not one token everywhere: the argmax changes along the sequence.
    assert len(set(logits.argmax(dim=-1).tolist())) > 3
