"""End to end on a real (tiny_checkpoint, random) Llama checkpoint: every executor and layout agree.

Needs torch and the model package; skipped without them.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.python_child import run_python

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.usefixtures("leak_check")]

LAYOUTS = [  # backend, TP, PP, async scheduling
    ("uni", 1, 1, True),
    ("mp", 1, 1, False), ("mp", 1, 1, True),
    ("mp", 2, 1, False), ("mp", 2, 1, True),
    ("mp", 1, 2, False), ("mp", 1, 2, True),
]
PROMPTS = ["hello world", "the quick brown fox", "a", "one two three four five six seven"]


def make_llm(tiny_checkpoint: Path, backend: str = "uni", tp: int = 1, pp: int = 1,
             async_scheduling: bool = False, **kwargs: Any) -> Any:
    from mpexec import LLM

    return LLM(str(tiny_checkpoint), tensor_parallel_size=tp, pipeline_parallel_size=pp,
               executor_backend=backend, async_scheduling=async_scheduling, num_threads=1,
               max_num_batched_tokens=kwargs.pop("max_num_batched_tokens", 64),
               shutdown_grace_s=2.0, shutdown_term_s=2.0, **kwargs)


def params() -> list[Any]:
    from mpexec import SamplingParams

    return [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=5),
            SamplingParams(temperature=1.0, top_k=20, max_tokens=16, ignore_eos=True)]


@pytest.fixture(scope="module")
def baseline(tiny_checkpoint: Path) -> list[list[int]]:
    with make_llm(tiny_checkpoint) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, params())]


@pytest.mark.parametrize(("backend", "tp", "pp", "async_scheduling"), LAYOUTS)
def test_same_tokens_everywhere(tiny_checkpoint: Path, baseline: list[list[int]], backend: str,
                                tp: int, pp: int, async_scheduling: bool) -> None:
    with make_llm(tiny_checkpoint, backend, tp, pp, async_scheduling) as llm:
        outputs = llm.generate(PROMPTS, params())
        assert [o.token_ids for o in outputs] == baseline
        assert all(o.text == llm.tokenizer.decode(o.token_ids) for o in outputs)


def test_preemption_on_a_small_kv_cache_gives_the_same_tokens(tiny_checkpoint: Path) -> None:
    from mpexec import SamplingParams

    long_params = [SamplingParams(temperature=t, seed=5, max_tokens=20, ignore_eos=True)
                   for t in (0, 0.8, 0, 1.0)]
    with make_llm(tiny_checkpoint, "uni", block_size=4, max_num_seqs=1) as reference:
        block_bytes = reference.engine.executor.collective_rpc("kv_cache_block_bytes")[0]
        longest = max(len(reference.tokenizer.encode(p)) for p in PROMPTS) + 20
        want = [o.token_ids for o in reference.generate(PROMPTS, long_params)]
    # room for the longest request alone, not for all of them at once
    blocks = -(-longest // 4) + 1
    with make_llm(tiny_checkpoint, "mp", 1, 1, True, kv_cache_memory_bytes=blocks * block_bytes,
                  block_size=4) as llm:
        assert llm.engine.num_blocks == blocks
        outputs = llm.generate(PROMPTS, long_params)
        assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == want


def test_chat_uses_the_checkpoints_template(tiny_checkpoint: Path) -> None:
    with make_llm(tiny_checkpoint) as llm:
        out = llm.chat([{"role": "user", "content": "hi"}])[0]
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert out.prompt_token_ids == ids and out.finished


def test_worker_killed_mid_generation(tiny_checkpoint: Path) -> None:
    from mpexec import SamplingParams, WorkerDiedError

    llm = make_llm(tiny_checkpoint, "mp", 2, 1, True)
    try:
        pid = llm.engine.executor.workers[1].proc.pid
        stream = llm.generate_stream(PROMPTS, SamplingParams(max_tokens=200, ignore_eos=True))
        with pytest.raises(WorkerDiedError):
            for n, _ in enumerate(stream):
                if n == 3:
                    os.kill(pid, signal.SIGKILL)
        assert llm.engine.is_dead
    finally:
        llm.shutdown()


def test_cli_generate_json_matches_the_api(tiny_checkpoint: Path,
                                           baseline: list[list[int]]) -> None:
    args = ["-m", "mpexec", "generate", "--model", str(tiny_checkpoint), "--json",
            "--temperature", "0",
            "--max-tokens", "12", "--tp", "2"]
    for prompt in PROMPTS[:2]:
        args += ["--prompt", prompt]
    result = run_python(*args, timeout=120)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == PROMPTS[:2]
    assert rows[0]["token_ids"] == baseline[0][: len(rows[0]["token_ids"])]


def test_cli_prompt_longer_than_the_context(tiny_checkpoint: Path) -> None:
    result = run_python("-m", "mpexec", "generate", "--model", str(tiny_checkpoint),
                        "--backend", "uni",
                        "--prompt", "word " * 600, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert "max_model_len" in lines[-1] and "Traceback" not in result.stderr


def test_cli_worker_killed_exits_nonzero(tiny_checkpoint: Path) -> None:
    code = (
        "import os, signal, sys\n"
        "from mpexec.cli import generate\n"
        "real = generate.start_llm\n"
        "def start(args, tp, pp):\n"
        "    llm = real(args, tp, pp)\n"
        "    pid = llm.engine.executor.workers[1].proc.pid\n"
        "    generate_first, killed = llm.generate, []\n"
        "    def kill_after_3(done, total, tokens):\n"
        "        if tokens >= 3 and not killed:\n"
        "            killed.append(os.kill(pid, signal.SIGKILL))\n"
        "    llm.generate = lambda p, s, progress=None: generate_first(p, s, kill_after_3)\n"
        "    return llm\n"
        "generate.start_llm = start\n"
        "from mpexec.cli import main\n"
        f"sys.exit(main(['generate', '--model', {str(tiny_checkpoint)!r}, '--tp', '2', "
        "'--prompt', 'x',"
        " '--max-tokens', '400', '--temperature', '0']))\n"
    )
    result = run_python("-c", code, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "a worker died" in result.stderr and "Traceback" not in result.stderr


def test_readme_python_example_runs(tiny_checkpoint: Path, tmp_path: Path) -> None:
    import re

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
                 if "from mpexec import LLM" in b)
    script = tmp_path / "use_llm.py"
    script.write_text(block.replace('LLM("default"', f'LLM({str(tiny_checkpoint)!r}'))
    result = run_python(str(script), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(300)
def test_cli_generate_tp3_on_two_cpus_warns_and_runs(tiny_checkpoint: Path,
                                                     baseline: list[list[int]]) -> None:
    # The child sees at most two CPUs (a laptop's share), then asks for three workers.
    code = (
        "import os, sys\n"
        "os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])\n"
        "from mpexec.cli import main\n"
        f"sys.exit(main(['generate', '--model', {str(tiny_checkpoint)!r}, '--tp', '3', "
        "'--json', '--prompt', " + repr(PROMPTS[0]) + ", '--max-tokens', '12', "
        "'--temperature', '0']))\n"
    )
    result = run_python("-c", code, timeout=280)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" in result.stderr and "3 CPU workers" in result.stderr
    row = json.loads(result.stdout.splitlines()[0])
    assert row["token_ids"] == baseline[0][: len(row["token_ids"])]
